"""DTensor index maths for the additive signature: where each local element sits in the global tensor.

A local shard is a box of the global tensor (its shape and global offset, from the DTensor's placements); its
elements' global flat indices are base + an affine map of the local flat index (`index_map`, `global_index`).
Only Shard(dim) and Replicate placements have such a box; anything else is refused on every rank alike.
"""

from __future__ import annotations

import torch


def index_map(local_shape, global_shape, offset) -> tuple[int, list[tuple[int, int]]]:
    """Global flat index of local flat index j: base + sum over (size, stride) of ((j // inner) % size) * stride,
    with adjacent dims merged where the global layout is contiguous. [] or [(n, 1)] means base + j."""
    if len(local_shape) != len(global_shape) or len(offset) != len(global_shape):
        raise ValueError(
            f"shape/offset ranks differ: local {tuple(local_shape)}, global {tuple(global_shape)}, "
            f"offset {tuple(offset)}"
        )
    gstrides, acc = [], 1
    for g in reversed(global_shape):
        gstrides.append(acc)
        acc *= g
    gstrides.reverse()
    base = 0
    for n, g, o, s in zip(local_shape, global_shape, offset, gstrides):
        if o < 0 or o + n > g:
            raise ValueError(
                f"local shape {tuple(local_shape)} at offset {tuple(offset)} exceeds global shape {tuple(global_shape)}"
            )
        base += o * s
    dims: list[tuple[int, int]] = []
    for n, s in zip(local_shape, gstrides):
        if n == 1:
            continue
        if dims and dims[-1][1] == n * s:
            dims[-1] = (dims[-1][0] * n, s)
        else:
            dims.append((n, s))
    return base, dims


def global_index(j: torch.Tensor, base: int, dims: list[tuple[int, int]]) -> torch.Tensor:
    g = torch.full_like(j, base)
    inner = 1
    for size, stride in reversed(dims):
        g.add_(torch.remainder(torch.div(j, inner, rounding_mode="floor"), size).mul_(stride))
        inner *= size
    return g


# (global shape, mesh id, placements) -> (local shape, global offset) or the ValueError to raise: a save sees the
# same few hundred DTensors of the same shapes every time, and torch's placement maths cost tens of microseconds a
# tensor, twice a save (full_signable, then full_signatures). Each entry keeps its mesh alive, so an id is never
# reused while its entry exists; the cache is emptied when it grows past _BOX_MAX (a job that keeps making meshes).
_BOXES: dict = {}
_BOX_MAX = 1 << 14


def _box_of(dt) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = dt.device_mesh, tuple(dt.placements)
    key = (tuple(dt.shape), id(mesh), placements)
    hit = _BOXES.get(key)
    if hit is None:
        try:
            for p in placements:
                _check_placement(p)
            shape, offset = compute_local_shape_and_global_offset(dt.shape, mesh, placements)
            result = (tuple(int(s) for s in shape), tuple(int(o) for o in offset))
        except ValueError as e:
            result = e
        if len(_BOXES) >= _BOX_MAX:
            _BOXES.clear()
        _BOXES[key] = hit = (mesh, result)
    if isinstance(hit[1], ValueError):
        raise ValueError(str(hit[1]))
    return hit[1]


def dtensor_box(dt) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]] | None:
    """(local tensor, global shape, global offset) of a DTensor with Shard/Replicate placements; None on a rank
    outside its mesh. The placement maths are remembered per (global shape, mesh, placements) (`_BOXES`)."""
    if dt.device_mesh.get_coordinate() is None:
        for p in dt.placements:  # refused the same on every rank, inside the mesh or not
            _check_placement(p)
        return None
    shape, offset = _box_of(dt)
    local = _local(dt)
    if shape != tuple(local.shape):
        raise ValueError(f"local shard shape {tuple(local.shape)} differs from the placement's {shape}")
    return local, tuple(dt.shape), offset


def _check_placement(p) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard) or not isinstance(p, (Shard, Replicate)):
        raise ValueError(f"full signatures support Shard(dim) and Replicate placements, not {p}")


def _local(dt) -> torch.Tensor:
    """A DTensor's local tensor, the very object it holds: the same bits as `to_local()`, which is an autograd
    call costing tens of microseconds a tensor."""
    local = getattr(dt, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else dt.to_local()


def dtensor_contributes(dt) -> bool:
    """One rank per Replicate group contributes: the one at coordinate 0 on every Replicate mesh dimension."""
    from torch.distributed.tensor import Replicate

    coord = dt.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, p in zip(coord, dt.placements) if isinstance(p, Replicate))
