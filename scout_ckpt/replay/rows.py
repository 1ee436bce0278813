"""What a replay round records: the replayed tensors signed, the peers' signatures compared (C3), one ledger row
per target, the same on every peer.

Why apart from runner.py: the runner decides what is replayed where and moves the captures and signatures over
the peer group; this module turns what came back into evidence -- which rows are comparable at all (every peer
replayed the target and signed as many tensors), the verdict, the attributed ranks and what disagreed -- so the
shape of a `replays` row (what `explain`, `report` and schedule.coverage read) is written in one place.

A round's per-target results are lists [labels, tensors -> their signatures, seconds, payload, live votes]; the
header every peer gathers holds, per target, (seconds, has signatures, how many, this rank's self-check outcome)
(`header_values`): the self-check (replay.live) needs no collective of its own, every peer learns every other's
outcome in the gather the round makes anyway, so every peer writes the same row.
"""

from __future__ import annotations

import warnings

from scout_ckpt.consensus.c3 import verdicts_from_gathered
from scout_ckpt.consensus.signatures import replica_signatures
from scout_ckpt.replay import determinism
from scout_ckpt.replay import live as live_step

HEADER_SLOTS = 4  # per target: seconds, has signatures (0/1), how many signatures, self-check (live.SELF_*)


def header_values(results: list[list], selfc: list[int] | None = None) -> list[float]:
    """This peer's part of the round's one small gather: per target its time, whether it has signatures, how
    many, and its self-check's outcome (`selfc`, live.SELF_*; SELF_NONE when it ran none)."""
    selfc = selfc if selfc is not None else [live_step.SELF_NONE] * len(results)
    return [
        v
        for (lab, sig, dt, _, _), sc in zip(results, selfc)
        for v in (dt, float(sig is not None), float(len(lab)), float(sc))
    ]


def comparable(header: dict[int, list[float]], n_targets: int) -> list[bool]:
    """Per target: did every peer sign it, with the same number of signatures (else the row is inconclusive)."""
    k = HEADER_SLOTS
    return [
        all(h[k * i + 1] for h in header.values()) and len({h[k * i + 2] for h in header.values()}) == 1
        for i in range(n_targets)
    ]


def durations(header: dict[int, list[float]], i: int) -> dict[int, float]:
    """Every peer's replay time of target i (the straggler rule's input)."""
    return {r: h[HEADER_SLOTS * i] for r, h in header.items()}


def sign(step: int, work: list, results: list[list], pending: list[int], rank: int) -> None:
    """Replace the replayed tensors of the `pending` targets by their signatures, hashed in ONE call (per-call
    and per-tensor fixed costs were a tenth of a sweep). A batch that cannot be hashed is
    hashed per target, so that only the target whose tensors fail loses its signatures (INCONCLUSIVE, as a
    replay that failed). The straggler rule's durations are the replays' own, without the hashing."""
    if not pending:
        return
    try:
        sigs = replica_signatures([t for k in pending for t in results[k][1]])
        at = 0
        for k in pending:
            n = len(results[k][1])
            results[k][1], at = sigs[at : at + n], at + n
    except Exception:  # noqa: BLE001 -- find the target at fault
        for k in pending:
            try:
                results[k][1] = replica_signatures(results[k][1])
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"replay of {work[k][1][1]} at step {step} failed on rank {rank}: {e!r}")
                results[k][0], results[k][1] = [], None
    pending.clear()


def replay_row(
    step: int,
    target,
    payload,
    labels: list[str],
    header: dict[int, list[float]],
    i: int,
    signatures,
    src: int,
    peers: list[int],
    grad_notes: list[str] | None = None,
) -> dict:
    """The ledger row of target i of a round. `signatures`: every peer's signatures of it (one row per peer),
    or None when the target is not comparable (some peer failed, or the counts differ): INCONCLUSIVE. A peer
    whose self-check found its own live step differing from its replay (live.self_check) makes the row
    ATTRIBUTED to it, whatever the rest says (replay.live: the rule); `grad_notes`: the live gradients its
    self-check does not sign, and why."""
    took = durations(header, i)
    detail: dict = {
        "source": src,
        "peers": list(peers),
        "signatures": len(labels),
        "durations": {str(r): round(d, 6) for r, d in took.items()},
        "comparison": determinism.comparison(),
    }  # what bitwise rests on here (determinism.py)
    if target[0] == "optimizer" and payload is not None:  # what this round compared: every window
        detail.update(tensors=len(payload.params), elements=payload.elements, round=payload.round, cycle=payload.cycle)
    if signatures is None:
        status, ranks = "INCONCLUSIVE", list[int]()
        detail["failed_ranks"] = sorted(r for r, h in header.items() if not h[HEADER_SLOTS * i + 1])
        detail["counts"] = {str(r): int(h[HEADER_SLOTS * i + 2]) for r, h in header.items()}
    else:
        verdict = verdicts_from_gathered(signatures, peers, labels)
        status, ranks, why = summarise(verdict)
        detail.update(why)
        detail.update(live_step.row_detail(labels, verdict.disagreeing, src))
    selfc = live_step.self_detail({r: int(h[HEADER_SLOTS * i + 3]) for r, h in header.items()})
    if selfc:
        detail.update(selfc)
        detail.update(live_step.grads_detail(grad_notes or []))
        failed = live_step.self_failed(detail)
        if failed:  # a rank's live step disagreed with its own replay: that rank, with 2 peers too
            status, ranks = "ATTRIBUTED", sorted(set(ranks) | set(failed))
            detail["live_disagree"] = True
    if target[0] == "optimizer" and payload is not None and payload.unsupported:
        status, detail["unsupported"] = "INCONCLUSIVE", payload.unsupported
    return {
        "step": step,
        "recipe": target[0],
        "target": target[1],
        "status": status,
        "ranks": ranks,
        "duration_s": max(took.values()),
        "detail": detail,
    }


def summarise(verdict) -> tuple[str, list[int], dict]:
    """Row status, attributed global ranks, and what disagreed (at most 16 signature names, and how the peers
    split on the first of them)."""
    detail: dict = {"disagree": list(verdict.disagreeing_names[:16]), "n_disagree": len(verdict.disagreeing)}
    if verdict.disagreeing:
        first = verdict.per_tensor[verdict.disagreeing[0]]
        detail["split"] = [[verdict.group_ranks[p] for p in cls] for cls in first.classes]
    return verdict.status.upper(), sorted(verdict.attributed_ranks), detail


__all__ = ["comparable", "durations", "header_values", "replay_row", "sign", "summarise"]
