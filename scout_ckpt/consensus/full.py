"""Full signatures of a (sharded) state: the collective that makes a checkpoint saved on N ranks comparable with
the same state loaded on M ranks (one all_reduce of per-rank partial signatures)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
import xxhash

from scout_ckpt.consensus.canonical import NotComparable
from scout_ckpt.consensus.flatten import flatten_state
from scout_ckpt.consensus.indexing import dtensor_box, dtensor_contributes
from scout_ckpt.consensus.kernels import rows_to_host
from scout_ckpt.consensus.mesh import is_dtensor
from scout_ckpt.consensus.signatures import batch_signatures, replica_signatures, signature_hex, tensor_signature


def assign_replicated(costs: list[int], world: int) -> list[int]:
    """Owner rank of each replicated item: greedy longest-processing-time assignment (largest first, ties by
    position, each to the least loaded rank, ties to the lowest rank). A function of the costs alone, so every rank
    computes the same assignment; each rank gets about 1/world of the bytes."""
    import heapq

    owners = [0] * len(costs)
    heap = [(0, r) for r in range(world)]
    for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    return owners


def _replicated_layout(flat: Mapping[str, Any], replicated: list[int]) -> tuple[list[int], int]:
    """(cost in bytes of each replicated tensor, 63-bit digest of keys, dtypes and shapes): what the assignment
    depends on. Non-tensor leaves cost nothing and stay with rank 0 (their bytes may legitimately differ)."""
    keys = list(flat)
    costs, blob = [], []
    for i in replicated:
        leaf = flat[keys[i]]
        if isinstance(leaf, torch.Tensor):
            costs.append(leaf.numel() * leaf.element_size())
            blob.append(f"{keys[i]}\0{leaf.dtype}{tuple(leaf.shape)}\0")
        else:
            costs.append(-1)
            blob.append(f"{keys[i]}\0bytes\0")
    return costs, xxhash.xxh3_64_intdigest("".join(blob).encode()) >> 1


def _same_everywhere(value: int, group) -> bool:
    """True on every rank iff `value` is the same on every rank of `group` (one all_reduce(MAX) of [v, -v])."""
    import torch.distributed as dist

    buf = torch.tensor([value, -value], dtype=torch.int64)
    backend = str(dist.get_backend(group))
    dev = buf if "gloo" in backend else buf.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(dev, op=dist.ReduceOp.MAX, group=group)
    hi, neg_lo = dev.cpu().tolist()
    return hi == -neg_lo


REPLICA_PREFIX = "r:"


def _partial(leaf, zero: torch.Tensor) -> torch.Tensor:
    """This rank's contribution to the full signature of DTensor `leaf` (zero where another rank of its Replicate
    group counts its elements, or where this rank is outside its mesh)."""
    box = dtensor_box(leaf)  # on every rank: a placement it cannot handle fails everywhere, not in a hang
    if box is None or not dtensor_contributes(leaf):
        return zero
    return tensor_signature(box[0], global_shape=box[1], global_offset=box[2])


def shard_partials(flat: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """{dotted key: [2] partial signature} of every DTensor leaf of a flattened state (keep_dtensor), exactly the
    row `full_signatures` computes for it before its all_reduce; local, so it may run in a background thread while
    the state is held (a sync save's write). A leaf it cannot sign is left out: `full_signatures` then meets it
    itself and raises there, on every rank alike."""
    zero = torch.zeros(2, dtype=torch.int64)
    out = {}
    for key, leaf in flat.items():
        if is_dtensor(leaf):
            try:
                out[key] = _partial(leaf, zero)
            except (ValueError, TypeError):
                continue
    return out


def full_signatures(
    state_dict: Mapping,
    group=None,
    *,
    plain: str = "additive",
    known: Mapping[str, torch.Tensor] | None = None,
    complete: bool = False,
    exclude: Collection[str] = (),
    partials: Mapping[str, torch.Tensor] | None = None,
    flat: Mapping | None = None,
) -> dict[str, str]:
    """{dotted key: hex} full-tensor signatures of a (sharded) state; collective over `group` (default: world).

    Each rank computes the partial signature of what it holds at its global offsets and one all_reduce(SUM) of the
    [n, 2] partials gives every rank the full signatures. Who contributes:
      * a DTensor (Shard(dim) / Replicate placements, even or uneven): every rank of its mesh contributes its local
        shard, except that within each Replicate group only the rank at coordinate 0 of every Replicate mesh dim
        does (the others add zero), so each element is counted exactly once;
      * a plain tensor is taken as replicated: one rank of `group` signs it, the tensors spread over the ranks by
        size (`assign_replicated`), so each rank signs about 1/world of the bytes; if the ranks' plain tensors do
        not have the same keys, dtypes and shapes (checked by one tiny all_reduce), rank 0 signs all of them;
      * a non-tensor leaf (bytes) is signed by rank 0 of `group`.
    As in DCP, which writes one copy of replicated items, replicas that differ are C3's business, not this
    function's: the value recorded is that of the signing rank.
    Every rank of `group` must call it with the same keys in the same order, and `group` must contain every rank of
    every DTensor's mesh. The result does not depend on the number of ranks or the sharding, so state saved on N
    ranks and loaded on M ranks compare equal iff their bits are equal.

    plain="replica" signs plain tensors with `replica_signatures` instead (xxh3 on CPU, 20x faster than the
    additive hash) and marks their values with REPLICA_PREFIX: such a value compares only with another plain
    tensor's (not with a DTensor's after resharding), which is what a same-layout restart needs.

    `known` ({dotted key: [2] replica signature}, with plain="replica" only): signatures this rank already computed
    of its own copy of those plain leaves (save-time consensus hashed every replicated byte; `PendingConsensus.
    replica_rows`); the signing rank takes its value from there instead of hashing the leaf a second time. The
    result is the same: both are `replica_signatures` of the same bits.

    `complete=True` (with plain="replica" and `known`): the caller has established, on every rank alike, that every
    rank's state is plain leaves all in its `known` (`PendingConsensus.full_rows`: consensus hashed every leaf on
    every rank and exchanged that fact). Then no rank calls a collective and each returns its own values, which
    are the signing rank's whenever the replicas agree (and when they do not, consensus rejects the checkpoint).

    `partials` ({dotted key: [2] row}, from `shard_partials` of the same state while it was held): this rank's
    rows of those DTensor leaves, taken instead of computed; the same values, so the same result.

    `exclude`: dotted keys left unsigned (`consensus.mesh.full_signable`: a _StridedShard has no one-box shard);
    the same on every rank. Leaves that have no canonical encoding (`canonical.NotComparable`) are never signed.

    `flat`: `flatten_state(state_dict, keep_dtensor=True)` where the caller holds it already (a save's consensus
    flattened the same state: `PendingConsensus.flattened`); not modified.
    """
    import torch.distributed as dist

    flat = flat if flat is not None else flatten_state(state_dict, keep_dtensor=True)
    skip = set(exclude)
    # a value without a canonical encoding is never signed (canonical.py); full_signable lists it as unsigned
    flat = {k: v for k, v in flat.items() if k not in skip and not isinstance(v, NotComparable)}
    if complete:
        if plain != "replica" or known is None or any(is_dtensor(v) or k not in known for k, v in flat.items()):
            raise ValueError("complete=True needs plain='replica' and a known signature of every plain leaf")
        return {key: REPLICA_PREFIX + signature_hex(known[key]) for key in flat}
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    grank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if distributed else 1
    rows: list[torch.Tensor] = []
    replicated: list[int] = []
    zero = torch.zeros(2, dtype=torch.int64)
    partials = partials or {}
    for i, (key, leaf) in enumerate(flat.items()):
        if is_dtensor(leaf):
            row = partials.get(key)
            rows.append(row if row is not None else _partial(leaf, zero))
        else:
            rows.append(zero)
            replicated.append(i)
    sums = rows_to_host(rows)
    costs, layout = _replicated_layout(flat, replicated)
    spread = world > 1 and _same_everywhere(layout, group)  # collective on every rank whatever it holds
    if replicated:
        if spread:
            tensor_idx = [j for j, c in enumerate(costs) if c >= 0]
            owners = [0] * len(replicated)
            for j, r in zip(tensor_idx, assign_replicated([costs[j] for j in tensor_idx], world)):
                owners[j] = r
        else:
            owners = [0] * len(replicated)
        leaves = list(flat.values())
        mine = [i for i, r in zip(replicated, owners) if r == grank]
        keys = list(flat) if known and plain == "replica" else []
        reuse = [i for i in mine if keys and keys[i] in known]
        for i in reuse:
            sums[i] = known[keys[i]]
        rest = [i for i in mine if not (keys and keys[i] in known)]
        if rest:
            sign = replica_signatures if plain == "replica" else batch_signatures
            sums[rest] = sign([leaves[i] for i in rest])
    if distributed:
        backend = str(dist.get_backend(group))
        buf = sums if "gloo" in backend else sums.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        sums = buf.cpu()
    marked = set(replicated) if plain == "replica" else set()
    return {key: (REPLICA_PREFIX if i in marked else "") + signature_hex(sums[i]) for i, key in enumerate(flat)}
