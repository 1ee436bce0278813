"""MegatronCheckpointer's live evidence from the pieces of a sharded state dict: consensus over the pieces that
several ranks hold (Megatron's data-parallel copies, tensor-parallel-replicated layer norms), the finite check of
every piece, and the `single_owner` evidence of the pieces only one rank holds.

Each rank digests every ShardedTensor piece it holds (key, global offset, local shape, flattened range name the
piece) with xxh3-128 of its bytes (the project's replica signature function: the digests are compared between the
ranks of one save, never stored as file digests), and checks it for NaN/Inf; the caller gathers every rank's
{"pieces": {piece: digest}, "nonfinite": [piece]} and `evidence` decides, the same on every rank."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import xxhash
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from scout_ckpt import policy
from scout_ckpt.invariants.finite import UncheckableDtype, is_finite

__all__ = ["local_pieces", "evidence"]


def local_pieces(sharded_state_dict) -> dict:
    """Local: {"pieces": {piece id: digest}, "nonfinite": [piece id]} of the pieces this rank holds."""
    mine: dict[str, str] = {}
    nonfinite: list[str] = []
    for st in _sharded_tensors(sharded_state_dict):
        if st.data is None:
            continue
        pid = _piece_id(st)
        mine[pid] = _tensor_digest(st.data)
        try:
            ok = is_finite(st.data.detach())
        except UncheckableDtype:
            ok = False
        if not ok:
            nonfinite.append(pid)
    return {"pieces": mine, "nonfinite": nonfinite}


def _sharded_tensors(obj):
    if isinstance(obj, ShardedTensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _sharded_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _sharded_tensors(v)


def _piece_id(st: ShardedTensor) -> str:
    fr = st.flattened_range
    rng = f"[{fr.start}:{fr.stop}]" if fr is not None else ""
    return f"{st.key}@{tuple(st.global_offset)}{tuple(st.local_shape)}{rng}"


def _tensor_digest(t: torch.Tensor) -> str:
    """xxh3-128 of the tensor's row-major bytes, read in place where it is a contiguous CPU tensor."""
    t = t.detach().cpu().contiguous()
    data: Any = t.view(-1).view(torch.uint8).numpy()  # the buffer protocol: no copy
    return xxhash.xxh3_128_hexdigest(data)


def evidence(every: list[dict], *, consensus: bool, accept_single_owner: bool) -> dict:
    """Pure: the live evidence from every rank's {"pieces": {piece: digest}, "nonfinite": [piece]}."""
    holders: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for rank, g in enumerate(every):
        for pid, d in g["pieces"].items():
            holders[pid].append((rank, d))
    ev: dict = {}
    bad_fin = [
        {
            "code": "invariant_failed",
            "check": "finite",
            "ranks": [r],
            "tensors": g["nonfinite"][:8],
            "n_tensors": len(g["nonfinite"]),
        }
        for r, g in enumerate(every)
        if g["nonfinite"]
    ]
    ev["invariants"] = policy.evidence(
        policy.FAIL if bad_fin else policy.PASS, bad_fin, specs=["finite"], checked_by="writers", checked_at="save"
    )
    replicated = {p: h for p, h in holders.items() if len(h) > 1}
    single = sorted(p for p, h in holders.items() if len(h) == 1)
    if consensus:
        reasons, status = [], policy.PASS
        for pid, h in sorted(replicated.items()):
            counts: dict[str, list[int]] = defaultdict(list)
            for r, d in h:
                counts[d].append(r)
            if len(counts) == 1:
                continue
            ranked = sorted(counts.values(), key=len, reverse=True)
            if len(ranked[0]) * 2 > len(h):  # a strict majority: the others are attributed
                minority = sorted(r for rs in ranked[1:] for r in rs)
                reasons.append({"code": "consensus_attributed", "ranks": minority, "tensor": pid})
                status = policy.FAIL
            else:
                reasons.append({"code": "consensus_inconclusive", "ranks": sorted(r for r, _ in h), "tensor": pid})
                if status == policy.PASS:
                    status = policy.INCONCLUSIVE
        groups = sorted({tuple(sorted(r for r, _ in h)) for h in replicated.values()})
        if not replicated:
            status = policy.NOT_APPLICABLE
        ev["consensus"] = policy.evidence(
            status,
            reasons,
            tensors_compared=len(replicated),
            groups=[{"members": list(g)} for g in groups],
            source="replica_id",
        )
    if single:
        reason = {
            "code": "single_owner",
            "pieces": len(single),
            "keys": sorted({p.split("@")[0] for p in single})[:8],
            "ranks": sorted({holders[p][0][0] for p in single}),
            "detail": "one rank holds each of these pieces (tensor-parallel shards without data-parallel "
            "replicas): no replica to compare; bytes and finite checks alone do not vouch for them",
        }
        status = policy.NOT_APPLICABLE if accept_single_owner else policy.MISSING
        ev["single_owner"] = policy.evidence(status, [reason], accepted=accept_single_owner)
    else:
        ev["single_owner"] = policy.evidence(policy.PASS, [], pieces=0)
    return ev
