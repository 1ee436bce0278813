"""Triage of a disputed replay row: is the disagreement the rank's hardware, now or for good, or not hardware?

When a round attributes a module target to a rank R (the ring's two disagreeing pairs around it, its replay
disagreeing with the majority, or its live step with its own replay), or a ring round finds every pair in
disagreement (`suspects`), the disputed work is executed again with the same captured inputs and parameters: twice
on R, and twice on another peer Q (on another host where the job has one, else another torchrun node). The
work is the source's capture for a broadcast round's cross-check disagreement (every peer already holds it), and
R's own capture for a self-check disagreement or a ring row (R sends it). Exact signatures (consensus.signatures) of the four results decide (`classify`):

- Q gives two different answers to the same work: the disagreement is reproduced off R, by a rank the round did
  not blame: numerics or data (a nondeterministic layer), `not_hardware`;
- R's two answers equal Q's: R agrees on re-run: `transient` (a one-off on R);
- otherwise R disagrees again (with Q, or with itself): `persistent`.

Collective over the round's peer group; every peer calls `after_round` with the same rows (they are identical on
every peer) and ends with the same classes in them. Never raises: a replay that fails leaves its rank's class
unset (the row keeps its attribution). Runs only when a round disputes a rank on a module target, at most
MAX_RANKS ranks per round.
"""

from __future__ import annotations

import os
import socket
import warnings

import torch.distributed as dist

from scout_ckpt.consensus.signatures import replica_signatures
from scout_ckpt.replay import live as live_step
from scout_ckpt.replay.execute import replay_target
from scout_ckpt.replay.transport import broadcast_payload, host

CLASSES = ("persistent", "transient", "not_hardware")
MAX_RANKS = 4
RUNS = 2  # executions of the work on each of the two ranks


def classify(on_rank: list[tuple | None], on_other: list[tuple | None]) -> str | None:
    """Pure: `on_rank` and `on_other` are the signatures of RUNS executions of the same work on the attributed
    rank and on the other rank (None for an execution that failed). The class, or None when a run failed."""
    if any(s is None for s in on_rank + on_other) or not on_rank or not on_other:
        return None
    if len(set(on_other)) > 1:
        return "not_hardware"
    if set(on_rank) == set(on_other):
        return "transient"
    return "persistent"


def other_rank(rank: int, peers: list[int], nodes: dict[int, tuple], avoid: set[int]) -> int | None:
    """Pure: the peer that re-executes R's work, the first after R in peer order, not itself attributed where
    possible: on another host, else on another node (torchrun agent) of the same host, else any.
    `nodes`: peer -> (host, node rank or None), node_ranks' answer."""
    order = peers[peers.index(rank) + 1 :] + peers[: peers.index(rank)]
    me = nodes.get(rank) or (None, None)

    def where(p: int) -> tuple:
        return nodes.get(p) or (None, None)

    for pick in (
        lambda p: where(p)[0] != me[0] and p not in avoid,
        lambda p: where(p) != me and p not in avoid,
        lambda p: p not in avoid,
        lambda p: True,
    ):
        for p in order:
            if pick(p):
                return p
    return None


def suspects(row: dict) -> list[int]:
    """Pure: the ranks of a round's row whose work triage runs again. An ATTRIBUTED row's ranks; a ring row in
    which several pairs disagree and none is named (every rank's live step disputed: several faults at once, or a
    layer no rank reproduces) the rank whose live step the first disagreeing pair disputes. Two ranks that accuse
    each other name no one (INCONCLUSIVE, no ranks): with two, hardware on either side is the same observation."""
    if row["status"] == "ATTRIBUTED":
        return list(row["ranks"])
    pairs = ((row.get("detail") or {}).get("ring") or {}).get("failed_pairs") or []
    if row["status"] == "INCONCLUSIVE" and not row["ranks"] and len(pairs) >= 3:
        return [pairs[0][0]]
    return []


def _digest(sigs) -> tuple:
    return tuple(int(v) for v in sigs.reshape(-1).tolist())


def _runs(recipe: str, cap, payload, deterministic: bool, optimizer) -> list[tuple | None]:
    out: list[tuple | None] = []
    for _ in range(RUNS):
        try:
            _, tensors = replay_target(recipe, cap, payload, deterministic, optimizer)
            out.append(_digest(replica_signatures(tensors)))
        except Exception as e:  # noqa: BLE001 - every peer must still reach the gather below
            warnings.warn(f"triage replay failed: {e!r}", stacklevel=2)
            out.append(None)
    return out


def after_round(runner, step: int, rows: list[dict], items: dict[str, tuple], own_capture: bool = False) -> None:
    """Classify the attributed ranks of a round's module rows, in place (row["detail"]["triage"]). `items`:
    target name -> (target, this rank's capture, the payload this rank replayed in the round: the source's
    capture, or None). `own_capture`: the disagreeing work is always the attributed rank's own capture (the
    ring's rows); else it is for a self-check disagreement, and the source's capture otherwise."""
    todo: list[tuple[int, int, bool]] = []  # (row index, R, own)
    for k, row in enumerate(rows):
        if row["recipe"] == "optimizer" or row["target"] not in items or len(runner.peers) < 2:
            continue
        failed = set(live_step.self_failed(row["detail"]))
        for r in suspects(row):
            if len(todo) < MAX_RANKS and r in runner.peers:
                todo.append((k, r, own_capture or r in failed or items[row["target"]][2] is None))
    if not todo:
        return
    nodes = node_ranks(runner.group, runner.peers)
    mine: dict[int, list] = {}
    for n, (k, r, own) in enumerate(todo):
        target, cap, payload = items[rows[k]["target"]]
        q = other_rank(r, runner.peers, nodes, set(rows[k]["ranks"]))
        if own:  # R's own capture: only R holds it
            inv = getattr(cap, "invocation", None) if runner.rank == r else None
            payload = broadcast_payload(host(inv) if inv is not None else None, r, runner.group)
        if runner.rank in (r, q) and payload is not None:
            mine[n] = _runs(target[0], cap, payload, runner.deterministic, runner.optimizer)
    everyone: list = [None] * len(runner.peers)
    dist.all_gather_object(everyone, mine, group=runner.group)
    by_rank = dict(zip(runner.peers, everyone))
    for n, (k, r, own) in enumerate(todo):
        q = other_rank(r, runner.peers, nodes, set(rows[k]["ranks"]))
        on_rank = (by_rank.get(r) or {}).get(n) or []
        on_other = (by_rank.get(q) or {}).get(n) or [] if q is not None else []
        tri = rows[k]["detail"].setdefault("triage", {"ranks": {}})
        tri["ranks"][str(r)] = {
            "class": classify(on_rank, on_other),
            "other": q,
            "other_host": None if q is None else nodes[q][0],
            "other_node": None if q is None else nodes[q][1],
            "work": "own capture" if own else "source capture",
        }
    for row in rows:
        tri = row["detail"].get("triage")
        if tri:  # the row's class: the most hardware-like of its ranks' (persistent > transient > not_hardware)
            found = [v["class"] for v in tri["ranks"].values() if v["class"]]
            tri["class"] = next((c for c in CLASSES if c in found), None)


def node_ranks(group, peers: list[int]) -> dict[int, tuple]:
    """Collective over `group`: every peer's (host, node rank): SCOUT_CKPT_HOST or the hostname (the fleet
    record's host), and torchrun's GROUP_RANK (None where it is not set)."""
    node = os.environ.get("GROUP_RANK")
    mine = (os.environ.get("SCOUT_CKPT_HOST") or socket.gethostname(), int(node) if node and node.isdigit() else None)
    out: list = [None] * len(peers)
    dist.all_gather_object(out, mine, group=group)
    return {p: tuple(v) for p, v in zip(peers, out)}
