"""Consensus at a save boundary: do all replicas of the same state hold the same bits?

Every rank fingerprints the state it shares with its replica group (DDP: every tensor; HSDP: its local shard of
each DTensor, which its replicate peers hold too; plus every scalar leaf such as the step and learning rate),
C3 runs per replica group, and the group verdicts are gathered to every rank over the world gloo group, so the
evidence returned is identical on every rank. Collective over all ranks; call it before the DCP write.

Signatures are replica signatures (`replica_signatures`): xxh3-128 of a CPU tensor's bytes, the additive torch-op
signature on device for an accelerator tensor. Replicas are compared with each other at the same moment on the
same device type, so additivity is not needed here (full_signatures keeps it for resharded loads).

Collectives: one tiny all_gather over the replica group of a fixed-size header: a structure digest (so that
replicas whose state has different keys, shapes or dtypes are caught and the signature batches are known to line
up), a 128-bit digest of the [n, 2] signatures and the time taken. When all members' digests are equal (the
healthy case) every tensor AGREEs and nothing more is exchanged within the group; otherwise one all_gather of the
[n, 2] signatures gives per-tensor verdicts. With several replica groups (HSDP), one all_gather_object of the
small group verdicts over the world group; with one group of every rank (DDP) every rank already has the only
verdict. A healthy DDP save thus costs one collective of 48 bytes per rank. A group that times out raises (gloo's
timeout of `ConsensusGroups.create`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Collection, Mapping

import torch
import torch.distributed as dist

from scout_ckpt.consensus.c3 import (
    ATTRIBUTED, INCONCLUSIVE, GroupVerdict, c3_over_group, c3_verdict, combine, verdicts_from_gathered,
)
from scout_ckpt.consensus.groups import ConsensusGroups
from scout_ckpt.consensus.signatures import _is_dtensor, bytes_signature, flatten_state, replica_signatures
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


def _group_verdict(flat: Mapping[str, Any], names: list[str], groups: ConsensusGroups, t0: float
                   ) -> tuple[GroupVerdict, float]:
    """(verdict of this rank's replica group, the slowest member's time to its signatures); identical on every
    member. One all_gather of a fixed-size header (structure digest, a 128-bit digest of the [n, 2] signature
    rows, the time taken) decides the healthy case; only when the signature digests differ are the signatures
    themselves gathered, for per-tensor verdicts."""
    header = structure_digest(names, flat)
    sigs = replica_signatures([flat[n] for n in names])
    elapsed = time.perf_counter() - t0
    if groups.group is None:  # alone in its group: nothing to compare with
        return combine([], groups.group_ranks, []), elapsed
    mine = torch.cat([header, bytes_signature(sigs.numpy().tobytes()),
                      torch.tensor([elapsed], dtype=torch.float64).view(torch.int64)])
    rows = [torch.empty_like(mine) for _ in groups.group_ranks]
    dist.all_gather(rows, mine, group=groups.group)
    slowest = max(float(r[5:6].view(torch.float64)) for r in rows)
    if any(not torch.equal(r[:3], rows[0][:3]) for r in rows):
        return combine([c3_verdict([tuple(r[:3].tolist()) for r in rows])], groups.group_ranks, [STRUCTURE]), slowest
    if all(torch.equal(r[3:5], rows[0][3:5]) for r in rows):  # every member holds the same signatures
        return verdicts_from_gathered(sigs.unsqueeze(0).expand(len(rows), -1, -1), groups.group_ranks, names), slowest
    return c3_over_group(sigs, groups.group, groups.group_ranks, names), slowest


def _reasons(entry: dict) -> list[dict]:
    reasons = []
    if entry["attributed_tensors"]:
        reasons.append({"code": "consensus_attributed", "ranks": entry["attributed"],
                        "tensors": entry["attributed_tensors"][:MAX_NAMES],
                        "n_tensors": len(entry["attributed_tensors"]), "group": entry["members"]})
    if entry["inconclusive_tensors"]:
        reasons.append({"code": "consensus_inconclusive", "ranks": entry["members"],
                        "tensors": entry["inconclusive_tensors"][:MAX_NAMES],
                        "n_tensors": len(entry["inconclusive_tensors"]), "group": entry["members"]})
    return reasons


def _unreplicated(state_dict: Mapping, groups: ConsensusGroups, names_filter, t0: float) -> dict:
    """Pure FSDP: the sharded tensors have no replica, but the plain state every rank holds (step, LR schedule,
    RNG, data position, mixing weights) does, and DCP saves one rank's copy of it: compare that over the world.
    Agreement still leaves the single-owner shards unvouched, so the status stays `not_applicable`."""
    na = [{"code": "no_replicas", "mode": groups.mode}]
    flat = flatten_state(state_dict, keep_dtensor=True)
    names = [n for n in _select(flat, names_filter) if not _is_dtensor(flat[n])]
    if groups.world_size < 2 or groups.world_group is None or not names:
        return evidence(NOT_APPLICABLE, na, mode=groups.mode, groups=[], tensors_compared=0, duration_s=0.0)
    world = dataclasses.replace(groups, group=groups.world_group, group_ranks=list(range(groups.world_size)))
    gv, slowest = _group_verdict(flat, names, world, t0)
    entry = {"members": list(gv.group_ranks), "verdict": gv.status, "attributed": list(gv.attributed_ranks),
             "attributed_tensors": gv.attributed_tensors, "inconclusive_tensors": gv.inconclusive_tensors}
    status = FAIL if gv.status == ATTRIBUTED else EV_INCONCLUSIVE if gv.status == INCONCLUSIVE else NOT_APPLICABLE
    reasons = _reasons(entry) if status != NOT_APPLICABLE else na
    return evidence(status, reasons, mode=groups.mode,
                    groups=[{"members": entry["members"], "verdict": gv.status, "attributed": entry["attributed"],
                             "tensors_compared": len(gv.per_tensor)}],
                    tensors_compared=len(gv.per_tensor), plain_state_only=True, duration_s=slowest)


def save_time_consensus(state_dict: Mapping, groups: ConsensusGroups, *,
                        names_filter: Callable[[str], bool] | Collection[str] | None = None) -> dict:
    """Consensus evidence, in the policy's format, identical on every rank.

    status: "pass" every group AGREEs; "fail" some group ATTRIBUTED (reason "consensus_attributed" with the
    attributed global ranks, the first few tensor names and the group); "inconclusive" some group disagrees
    without a strict majority (reason "consensus_inconclusive" with the group's ranks and tensors);
    "not_applicable" no rank has a replica (reason "no_replicas"). Detail: "mode", "groups" (per group: members,
    verdict, attributed, tensors_compared), "tensors_compared" (summed over groups), "duration_s" (the slowest
    rank's time to its signatures: flattening and hashing, before the exchange).

    `names_filter` (a predicate on dotted names, or a collection of names) limits what is compared, e.g. to
    leave out state that legitimately differs per rank (per-rank RNG states, rank ids).
    """
    t0 = time.perf_counter()
    if not groups.has_replicas:
        return _unreplicated(state_dict, groups, names_filter, t0)
    flat = flatten_state(state_dict)
    names = _select(flat, names_filter)
    gv, slowest = _group_verdict(flat, names, groups, t0)
    mine = {"members": list(gv.group_ranks), "verdict": gv.status, "attributed": list(gv.attributed_ranks),
            "attributed_tensors": gv.attributed_tensors, "inconclusive_tensors": gv.inconclusive_tensors,
            "tensors_compared": len(gv.per_tensor), "duration_s": slowest}
    if len(groups.groups) == 1:  # DDP: one group of every rank, whose verdict every rank already holds
        everyone: list[Any] = [mine]
    else:
        everyone = [None] * groups.world_size
        dist.all_gather_object(everyone, mine, group=groups.world_group)
    by_group = {}
    for entry in everyone:  # members of a group hold the same verdict; keep the first
        by_group.setdefault(tuple(entry["members"]), entry)
    ordered = [by_group[tuple(g)] for g in groups.groups if tuple(g) in by_group]
    reasons = [r for g in ordered for r in _reasons(g)]
    verdicts = {g["verdict"] for g in ordered}
    status = FAIL if ATTRIBUTED in verdicts else EV_INCONCLUSIVE if INCONCLUSIVE in verdicts else PASS
    return evidence(
        status, reasons, mode=groups.mode,
        groups=[{"members": g["members"], "verdict": g["verdict"], "attributed": g["attributed"],
                 "tensors_compared": g["tensors_compared"]} for g in ordered],
        tensors_compared=sum(g["tensors_compared"] for g in ordered),
        duration_s=max(e["duration_s"] for e in everyone),
    )
