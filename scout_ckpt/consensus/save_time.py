"""Consensus at a save boundary: do all replicas of the same state hold the same bits?

Every rank fingerprints the state it shares with its replica group (DDP: every tensor; HSDP: its local shard of
each DTensor, which its replicate peers hold too; plus every scalar leaf such as the step and learning rate),
C3 runs per replica group, and the group verdicts are gathered to every rank over the world gloo group, so the
evidence returned is identical on every rank. Collective over all ranks; call it before the DCP write.

Collectives: one tiny all_gather of a structure digest over the replica group (so that replicas whose state has
different keys, shapes or dtypes are caught and the signature batches are known to line up), one all_gather of
the [n, 2] signatures over the replica group, one all_gather_object of the small group verdicts over the world
group. A group that times out raises (gloo's timeout of `ConsensusGroups.create`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Collection, Mapping

import torch
import torch.distributed as dist

from scout_ckpt.consensus.c3 import ATTRIBUTED, INCONCLUSIVE, GroupVerdict, c3_over_group, c3_verdict, combine
from scout_ckpt.consensus.groups import ConsensusGroups
from scout_ckpt.consensus.signatures import batch_signatures, bytes_signature, flatten_state
from scout_ckpt.policy import FAIL, INCONCLUSIVE as EV_INCONCLUSIVE, NOT_APPLICABLE, PASS, evidence

MAX_NAMES = 8          # tensor names listed per reason
STRUCTURE = "(state structure)"


def _select(flat: Mapping[str, Any], names_filter: Callable[[str], bool] | Collection[str] | None) -> list[str]:
    if names_filter is None:
        keep = flat
    elif callable(names_filter):
        keep = [n for n in flat if names_filter(n)]
    else:
        wanted = set(names_filter)
        keep = [n for n in flat if n in wanted]
    return sorted(keep)


def structure_digest(names: list[str], flat: Mapping[str, Any]) -> torch.Tensor:
    """[3] int64: entry count and a 128-bit digest of the names, dtypes and shapes (bytes leaves: their kind)."""
    kinds = (f"{flat[n].dtype}{tuple(flat[n].shape)}" if isinstance(flat[n], torch.Tensor) else "bytes" for n in names)
    blob = "".join(f"{n}\0{k}\0" for n, k in zip(names, kinds)).encode()
    return torch.cat([torch.tensor([len(names)], dtype=torch.int64), bytes_signature(blob)])


def _group_verdict(flat: Mapping[str, Any], names: list[str], groups: ConsensusGroups) -> GroupVerdict:
    if groups.group is None:  # alone in its group: nothing to compare with
        return combine([], groups.group_ranks, [])
    header = structure_digest(names, flat)
    rows = [torch.empty_like(header) for _ in groups.group_ranks]
    dist.all_gather(rows, header, group=groups.group)
    if any(not torch.equal(r, rows[0]) for r in rows):
        return combine([c3_verdict([tuple(r.tolist()) for r in rows])], groups.group_ranks, [STRUCTURE])
    sigs = batch_signatures([flat[n] for n in names])
    return c3_over_group(sigs, groups.group, groups.group_ranks, names)


def save_time_consensus(state_dict: Mapping, groups: ConsensusGroups, *,
                        names_filter: Callable[[str], bool] | Collection[str] | None = None) -> dict:
    """Consensus evidence, in the policy's format, identical on every rank.

    status: "pass" every group AGREEs; "fail" some group ATTRIBUTED (reason "consensus_attributed" with the
    attributed global ranks, the first few tensor names and the group); "inconclusive" some group disagrees
    without a strict majority (reason "consensus_inconclusive" with the group's ranks and tensors);
    "not_applicable" no rank has a replica (reason "no_replicas"). Detail: "mode", "groups" (per group: members,
    verdict, attributed, tensors_compared), "tensors_compared" (summed over groups), "duration_s" (the slowest
    rank's time to its verdict).

    `names_filter` (a predicate on dotted names, or a collection of names) limits what is compared, e.g. to
    leave out state that legitimately differs per rank (per-rank RNG states, rank ids).
    """
    t0 = time.perf_counter()
    if not groups.has_replicas:
        return evidence(NOT_APPLICABLE, [{"code": "no_replicas", "mode": groups.mode}],
                        mode=groups.mode, groups=[], tensors_compared=0, duration_s=0.0)
    flat = flatten_state(state_dict)
    names = _select(flat, names_filter)
    gv = _group_verdict(flat, names, groups)
    mine = {"members": list(gv.group_ranks), "verdict": gv.status, "attributed": list(gv.attributed_ranks),
            "attributed_tensors": gv.attributed_tensors, "inconclusive_tensors": gv.inconclusive_tensors,
            "tensors_compared": len(gv.per_tensor),
            "duration_s": time.perf_counter() - t0}
    everyone: list[Any] = [None] * groups.world_size
    dist.all_gather_object(everyone, mine, group=groups.world_group)
    by_group = {}
    for entry in everyone:  # members of a group hold the same verdict; keep the first
        by_group.setdefault(tuple(entry["members"]), entry)
    ordered = [by_group[tuple(g)] for g in groups.groups if tuple(g) in by_group]
    reasons = []
    for g in ordered:
        if g["attributed_tensors"]:
            reasons.append({"code": "consensus_attributed", "ranks": g["attributed"],
                            "tensors": g["attributed_tensors"][:MAX_NAMES],
                            "n_tensors": len(g["attributed_tensors"]), "group": g["members"]})
        if g["inconclusive_tensors"]:
            reasons.append({"code": "consensus_inconclusive", "ranks": g["members"],
                            "tensors": g["inconclusive_tensors"][:MAX_NAMES],
                            "n_tensors": len(g["inconclusive_tensors"]), "group": g["members"]})
    verdicts = {g["verdict"] for g in ordered}
    status = FAIL if ATTRIBUTED in verdicts else EV_INCONCLUSIVE if INCONCLUSIVE in verdicts else PASS
    return evidence(
        status, reasons, mode=groups.mode,
        groups=[{"members": g["members"], "verdict": g["verdict"], "attributed": g["attributed"],
                 "tensors_compared": g["tensors_compared"]} for g in ordered],
        tensors_compared=sum(g["tensors_compared"] for g in ordered),
        duration_s=max(e["duration_s"] for e in everyone),
    )
