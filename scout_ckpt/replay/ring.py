"""The sweep's peer check in a ring: every rank's capture of the save step is replayed by its successor and compared
with the live step it came from, one replay per target per rank.

Why: the sweep must check two things at every save -- that no rank's live step (the state the checkpoint carries)
was computed wrongly, and that no rank computes wrongly whenever it computes. The broadcast sweep did that with two
replays per target on most ranks: every peer replayed the source's capture (compared with each other, C3) and then
its own (the self-check, replay.live). In a ring the two checks are one replay: rank r replays the capture of its
predecessor p (inputs, output gradient, the parameters p's forward used, or r's own copy where its digest is p's:
shared_params.py) and compares the replay with p's live signatures (output, input and parameter gradients:
live.self_check). A pair that disagrees accuses two ranks, p's live step or r's arithmetic:

  no pair disagrees                    AGREE: every rank's live step checked by another rank's replay
  pairs (p->k) and (k->n) disagree     ATTRIBUTED to k: k's replay of p's step was wrong AND k's own live step
                                       disagrees with n's replay of it (a rank that computes wrongly, persistently)
  one pair (p->r) disagrees            the tie-break: p replays its own capture once more (only then, only p): p
                                       disagreeing with itself -> ATTRIBUTED to p (the self-check's rule: the rank
                                       disagrees with itself, no majority needed); p agreeing with itself ->
                                       INCONCLUSIVE naming both (p reproduces its live step, r does not: with 3+
                                       ranks r computed wrongly once, but one replay against another is no majority)
  anything else                        INCONCLUSIVE (several faults at once, or 2 ranks where both pairs disagree)

Either way a disagreement fails the save's replay evidence (policy.live_faults: the live state is bad). What the
ring does not compare: replays of ONE capture across every peer (the broadcast's C3); a rank that computes
wrongly on some inputs only is caught when its successor's replay of its own live step disagrees.

Transport: point to point on replay's gloo group (isend to the successor, irecv from the predecessor, posted
together); a capture's structure pickled without its tensors, its tensors as one byte buffer (transport.py's
framing). One small all_gather per round carries every rank's outcomes, so every rank writes the same rows.
"""

from __future__ import annotations

import pickle
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from scout_ckpt.consensus.signatures import replica_signatures
from scout_ckpt.replay import determinism, shared_params
from scout_ckpt.replay import live as live_step
from scout_ckpt.replay.execute import replay_target
from scout_ckpt.replay.transport import _layout, _pickled, host, unpickled

DISAGREE = (live_step.SELF_OUTPUT, live_step.SELF_GRAD)


def successor(peers: list[int], rank: int) -> int:
    return peers[(peers.index(rank) + 1) % len(peers)]


def predecessor(peers: list[int], rank: int) -> int:
    return peers[(peers.index(rank) - 1) % len(peers)]


def exchange(objs: list, peers: list[int], group) -> list:
    """Send this rank's objects (None entries allowed) to its successor and receive its predecessor's, in the
    same order: a size word, the pickled structures, then one byte buffer per object. Collective over `peers`."""
    me = dist.get_rank()
    nxt, prv = successor(peers, me), predecessor(peers, me)
    heads: list = []
    sent: list[list[torch.Tensor]] = []
    for obj in objs:
        if obj is None:
            heads.append(None)
            sent.append([])
            continue
        data, tensors = _pickled(obj)
        heads.append((data, [(t.dtype, tuple(t.shape), t.numel() * t.element_size()) for t in tensors]))
        sent.append(tensors)
    blob = torch.frombuffer(bytearray(pickle.dumps(heads, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    size_out, size_in = torch.tensor([blob.numel()], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    works: list[Any] = [dist.isend(size_out, nxt, group=group), dist.irecv(size_in, prv, group=group)]
    for w in works:
        w.wait()
    blob_in = torch.empty(int(size_in.item()), dtype=torch.uint8)
    works = [dist.isend(blob, nxt, group=group), dist.irecv(blob_in, prv, group=group)]
    for w in works:
        w.wait()
    their_heads = pickle.loads(blob_in.numpy().tobytes())
    works, bufs = [], list[list[torch.Tensor]]()
    for i, head in enumerate(heads):  # mine out
        spans, total = _layout(head[1] if head is not None else [])
        if total:
            flat = torch.empty(total, dtype=torch.uint8)
            for t, (at, n) in zip(sent[i], spans):
                if n:
                    flat[at : at + n].copy_(t.reshape(-1).view(torch.uint8))
            works.append(dist.isend(flat, nxt, group=group))
    for head in their_heads:  # theirs in
        spans, total = _layout(head[1] if head is not None else [])
        flat = torch.empty(total, dtype=torch.uint8)
        if total:
            works.append(dist.irecv(flat, prv, group=group))
        bufs.append([flat[at : at + n] for at, n in spans])
    for w in works:
        w.wait()
    return [None if head is None else unpickled(head, views) for head, views in zip(their_heads, bufs)]


def sendable(cap, share: bool):
    """What a rank sends of its capture: nothing when it has no live signatures to be checked against or its
    referenced inputs were written since; without parameters where its successor holds the same copy."""
    inv = getattr(cap, "invocation", None)
    if inv is None or inv.live is None or not inv.intact() or not inv.params:
        return None
    return host(shared_params.without_params(inv) if share else inv)


def pair_shared(words: dict[int, list[int]], targets: list, a: int, b: int, offset: int) -> set[str]:
    """The targets whose parameter copy rank `b` holds with rank `a`'s digest (the sweep's first gather)."""
    out = set()
    for k, t in enumerate(targets):
        at = offset + shared_params.WORDS * k
        mine = words[a][at : at + shared_params.WORDS]
        if mine[0] and words[b][at : at + shared_params.WORDS] == mine:
            out.add(t[1])
    return out


def check(step: int, target, cap, payload, *, rank: int, deterministic: bool) -> int:
    """This rank's replay of its predecessor's capture (`payload`) against the predecessor's live signatures:
    a live.SELF_* outcome. Never raises: a replay that fails leaves the pair unchecked (could not check is not a
    fault, and a rank that cannot replay must still reach the round's gather)."""
    if payload is None:
        return live_step.SELF_UNCHECKED
    try:
        if not payload.params and not payload.buffers:
            payload = shared_params.with_own(payload, cap)
        labels, tensors = replay_target(target[0], cap, payload, deterministic, None)
        return live_step.self_check(labels, replica_signatures(tensors), payload)
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"ring replay of {target[1]} at step {step} failed on rank {rank}: {e!r}")
        return live_step.SELF_UNCHECKED


def own_check(step: int, target, cap, *, rank: int, deterministic: bool) -> int:
    """The tie-break: this rank's own capture replayed once more against its own live signatures."""
    inv = getattr(cap, "invocation", None)
    if inv is None or inv.live is None or not inv.intact() or not inv.params:
        return live_step.SELF_UNCHECKED
    return check(step, target, cap, inv, rank=rank, deterministic=deterministic)


def judge(outcomes: dict[int, int], peers: list[int], tiebreak: dict[int, int] | None = None) -> tuple[str, list, dict]:
    """A target's row from every rank's outcome (`outcomes`: rank r -> its check of its predecessor's live step)
    and, where it ran, the tie-break (`tiebreak`: rank -> its check of its own capture). Returns (status, ranks,
    detail); see the module docstring for the rule."""
    failed = sorted(r for r, c in outcomes.items() if c in DISAGREE)
    checked = sorted(predecessor(peers, r) for r, c in outcomes.items() if c in (live_step.SELF_AGREE, *DISAGREE))
    unchecked = sorted(predecessor(peers, r) for r, c in outcomes.items() if c == live_step.SELF_UNCHECKED)
    pairs = [[predecessor(peers, r), r, live_step.SELF_WHAT[outcomes[r]]] for r in failed]
    detail: dict = {"ring": {"checked": checked, "unchecked": unchecked, "failed_pairs": pairs}}
    if not failed:
        return "AGREE", [], detail
    accused = [{p, r} for p, r, _ in pairs]
    common = set.intersection(*accused)
    if len(failed) == 2 and len(common) == 1:
        return "ATTRIBUTED", [common.pop()], detail  # computes wrongly whenever it computes: not the live step alone
    if len(failed) == 1:
        r = failed[0]
        p = predecessor(peers, r)  # pairs[0]: (its predecessor, r)
        mine = (tiebreak or {}).get(p)
        outcome = (
            "unchecked"
            if mine is None
            else live_step.SELF_WHAT.get(mine, "agree" if mine == live_step.SELF_AGREE else "unchecked")
        )
        detail["ring"]["tiebreak"] = {"rank": p, "outcome": outcome}
        if mine in DISAGREE:
            detail["live_disagree"] = True
            return "ATTRIBUTED", [p], detail
        return "INCONCLUSIVE", sorted({p, r}), detail
    return "INCONCLUSIVE", [], detail


def needs_tiebreak(outcomes: dict[int, int], peers: list[int]) -> int | None:
    """The rank whose own capture decides a one-pair disagreement (its predecessor side), or None."""
    failed = [r for r, c in outcomes.items() if c in DISAGREE]
    return predecessor(peers, failed[0]) if len(failed) == 1 else None


def run(
    step: int,
    items: list,
    *,
    peers: list[int],
    group,
    words: dict[int, list[int]],
    targets: list,
    offset: int,
    deterministic: bool,
    gather,
) -> tuple[list[dict], list[str]]:
    """One ring round over the module targets `items` ((target, this rank's capture) pairs, the same targets in
    the same order on every rank): exchange, replay, one gather of outcomes, the tie-break where one pair
    disagrees (one more replay on one rank, one more gather), rows. `gather(values)` is the runner's all_gather
    of a float list over `peers` (rank -> values)."""
    me = dist.get_rank()
    nxt = successor(peers, me)
    share_out = pair_shared(words, targets, me, nxt, offset)
    received = exchange([sendable(cap, t[1] in share_out) for t, cap in items], peers, group)
    values: list[float] = []
    for (target, cap), payload in zip(items, received):
        t0 = time.perf_counter()
        outcome = check(step, target, cap, payload, rank=me, deterministic=deterministic)
        values += [time.perf_counter() - t0, float(outcome)]
    header = gather(values)
    outcomes = [{r: int(h[2 * i + 1]) for r, h in header.items()} for i in range(len(items))]
    who = [needs_tiebreak(o, peers) for o in outcomes]
    tiebreaks: list[dict[int, int] | None] = [None] * len(items)
    if any(w is not None for w in who):
        mine = [
            float(own_check(step, t, cap, rank=me, deterministic=deterministic))
            if w == me
            else float(live_step.SELF_NONE)
            for (t, cap), w in zip(items, who)
        ]
        again = gather(mine)
        tiebreaks = [{w: int(again[w][i])} if w is not None else None for i, w in enumerate(who)]
    rows: list[dict] = []
    unchecked: list[str] = []
    for i, (target, _) in enumerate(items):
        status, ranks, detail = judge(outcomes[i], peers, tiebreaks[i])
        if not detail["ring"]["checked"]:
            # no rank's capture could be checked against a live step (none signed one: e.g. parameters still
            # sharded at forward time): no ring row; the caller replays it in the broadcast round instead
            unchecked.append(target[1])
            continue
        took = {r: h[2 * i] for r, h in header.items()}
        detail.update(
            {
                "check": "ring",
                "peers": list(peers),
                "durations": {str(r): round(d, 6) for r, d in took.items()},
                "comparison": determinism.comparison(),
            }
        )  # what bitwise rests on (determinism.py)
        rows.append(
            {
                "step": step,
                "recipe": target[0],
                "target": target[1],
                "status": status,
                "ranks": ranks,
                "duration_s": max(took.values()),
                "detail": detail,
            }
        )
    return rows, unchecked


__all__ = ["check", "exchange", "judge", "needs_tiebreak", "predecessor", "run", "successor"]
