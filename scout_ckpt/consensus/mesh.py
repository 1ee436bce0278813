"""Which ranks hold the same bits: replica groups from the DeviceMesh and each DTensor's placements.

The topology mesh is the training job's root DeviceMesh (every rank once, in a grid of named dims), or a 1-D grid
of the world when the model has no DTensor (DDP). A piece of state is compared across a set of the mesh's dims, its
*compare dims*; its replica group is every rank whose coordinates equal this rank's on all other dims:

  * a DTensor on mesh S (the root or a submesh, possibly with flattened dims) with placements P: each dim i of S
    spans some dims of the root grid (found by rank arithmetic on S.mesh, so flattened and sliced meshes need no
    mesh internals). Shard(i) -> those root dims tell shards apart: never compared across. _StridedShard(i,
    split_factor) (FSDP over a dim TP already shards: TorchTitan's FSDP x TP) is a shard too: the split factor only
    interleaves which rows a rank holds, ranks along that dim still hold disjoint elements and replicas (equal
    coordinates on every shard dim) hold the same local tensor, so local-shard signatures compare as for Shard.
    (Full-tensor signatures need a contiguous box per rank, which a strided shard is not: consensus.indexing
    refuses it, and the TorchTitan manager lists such tensors as `load_check_unsigned`.)
    Replicate -> compared across. Root dims S does not span (DDP's dp dim beside a TP submesh) -> the copies of S
    along them are data-parallel replicas: compared across. Partial (a pending reduction has no value yet), a
    placement type this module does not know (a future torch's: never guessed from its name), a mesh
    that does not align with the root grid, or a rank outside the grid -> the layout cannot be determined: the
    piece is a *problem* and consensus fails closed (evidence `missing`, code `consensus_layout_unknown`).
  * plain state (non-DTensor tensors: DDP parameters, optimizer step counters, scalars, RNG): compared across every
    dim, i.e. the world. DCP saves one copy of a plain item whatever rank holds it (its planner de-duplicates items
    by key and offset), so under FSDP and TP too every rank's copy must be equal for the checkpoint to be sound.
    State that legitimately differs per rank is keyed by rank (DCP would drop it otherwise) or excluded by name.
  * dims named like pipeline stages ("pp", "pipeline", "stage") hold different state: never compared across.

A piece whose compare dims have size 1 has no replica (FSDP shards, TP shards under FSDP): it is single-owner and
counted, not compared. Everything here is local (no collective): a DTensor's compare dims follow from its mesh,
placements and the root grid, the same on every rank of an SPMD job.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

PIPELINE_NAMES = ("pp", "pipeline", "stage")
TP_NAMES = ("tp", "tensor", "model", "sp")


def is_dtensor(obj: Any) -> bool:
    """isinstance(obj, DTensor) without importing torch.distributed.tensor (about 1 s) where none can exist."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(obj, mod.DTensor)


def _is_pipeline(name: str) -> bool:
    low = name.lower()
    return any(low == p or low.startswith(p + "_") or low.endswith("_" + p) for p in PIPELINE_NAMES)


@dataclass(frozen=True)
class Grid:
    """The topology mesh: global ranks in a row-major grid of named dims."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    ranks: tuple[int, ...]  # row-major, every rank of the world once
    coords: dict = field(default_factory=dict, compare=False, hash=False)  # rank -> coordinate

    @classmethod
    def make(cls, shape: Sequence[int], names: Sequence[str] | None, ranks: Iterable[int]) -> "Grid":
        shape = tuple(int(s) for s in shape)
        ranks = tuple(int(r) for r in ranks)
        names = tuple(names) if names else tuple(f"dim{i}" for i in range(len(shape)))
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise ValueError(f"mesh dim names {names} do not fit shape {shape}")
        if math.prod(shape) != len(ranks):
            raise ValueError(f"{len(ranks)} ranks do not fill a mesh of shape {shape}")
        coords = {}
        for flat, r in enumerate(ranks):
            c, rest = [], flat
            for s in reversed(shape):
                c.append(rest % s)
                rest //= s
            coords[r] = tuple(reversed(c))
        return cls(shape, names, ranks, coords)

    @classmethod
    def world(cls, world_size: int) -> "Grid":
        return cls.make((world_size,), ("world",), range(world_size))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def distinct_dims(self) -> tuple[int, ...]:
        """Dims whose ranks hold different state by design (pipeline stages): never compared across."""
        return tuple(d for d, n in enumerate(self.names) if _is_pipeline(n))

    @property
    def plain_dims(self) -> tuple[int, ...]:
        """Compare dims of plain (non-DTensor) state: every dim but pipeline stages."""
        return tuple(d for d in range(self.ndim) if d not in self.distinct_dims)

    def nested(self) -> list:
        """The rank grid as nested lists (JSON)."""

        def build(dim: int, offset: int) -> list:
            inner = math.prod(self.shape[dim + 1 :])
            if dim == self.ndim - 1:
                return list(self.ranks[offset : offset + self.shape[dim]])
            return [build(dim + 1, offset + i * inner) for i in range(self.shape[dim])]

        return build(0, 0)

    def partition(self, dims: Sequence[int]) -> list[list[int]]:
        """The replica groups of state compared across `dims`: ranks with equal coordinates on every other dim,
        each group sorted, groups ordered by their lowest rank."""
        dims = set(dims)
        by_key: dict[tuple, list[int]] = {}
        for r in self.ranks:
            key = tuple(c for d, c in enumerate(self.coords[r]) if d not in dims)
            by_key.setdefault(key, []).append(r)
        return sorted((sorted(g) for g in by_key.values()), key=lambda g: g[0])

    def group_size(self, dims: Sequence[int]) -> int:
        return math.prod(self.shape[d] for d in dims)

    def dim_names(self, dims: Sequence[int]) -> list[str]:
        return [self.names[d] for d in dims]

    def dims_of(self, names: Sequence[str]) -> tuple[int, ...]:
        return tuple(sorted(self.names.index(n) for n in names))


class LayoutError(ValueError):
    """A DTensor's layout that consensus cannot map to replica groups (the piece fails closed)."""


def placement_kind(p) -> str:
    """ "replicate", "shard" (Shard and _StridedShard), "partial", or "unknown" (fails closed in dtensor_dims).
    _StridedShard is not a Shard subclass in torch 2.13 and its is_shard() is False, so it is named explicitly."""
    if p.is_replicate():
        return "replicate"
    if p.is_shard():
        return "shard"
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # a torch without strided shards
        _StridedShard = ()
    if _StridedShard and isinstance(p, _StridedShard):
        return "shard"
    if p.is_partial():
        return "partial"
    return "unknown"


def dtensor_dims(dt, grid: Grid) -> tuple[int, ...]:
    """Compare dims (root-grid dim indices) of a DTensor, from its mesh and placements; LayoutError if they
    cannot be determined. Local: reads only dt.device_mesh.mesh (this rank's copy of the mesh) and the grid."""
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise LayoutError("this rank is outside the tensor's mesh")
    ranks = mesh.mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    spanned: set[int] = set()
    shard: set[int] = set()
    for i, p in enumerate(dt.placements):
        index = list(coord)
        index[i] = slice(None)
        fiber = [int(r) for r in ranks[tuple(index)].reshape(-1).tolist()]
        missing = [r for r in fiber if r not in grid.coords]
        if missing:
            raise LayoutError(f"mesh dim {names[i]!r} holds ranks {missing[:4]} outside the topology mesh")
        cs = [grid.coords[r] for r in fiber]
        varied = {d for d in range(grid.ndim) if len({c[d] for c in cs}) > 1}
        if len(set(fiber)) != len(fiber) or grid.group_size(varied) != len(fiber) or varied & spanned:
            raise LayoutError(
                f"mesh dim {names[i]!r} (ranks {fiber[:8]}) does not align with the topology mesh "
                f"{dict(zip(grid.names, grid.shape))}"
            )
        spanned |= varied
        kind = placement_kind(p)
        if kind == "replicate":
            continue
        if kind == "shard":
            shard |= varied
            continue
        if kind == "partial":
            raise LayoutError(f"placement {p} on mesh dim {names[i]!r}: a pending reduction has no value to compare")
        raise LayoutError(
            f"placement {p!r} ({type(p).__name__}) on mesh dim {names[i]!r} is not one scout-ckpt can "
            "map to replica groups (known: Replicate, Shard, _StridedShard, Partial)"
        )
    return tuple(d for d in range(grid.ndim) if d not in shard and d not in grid.distinct_dims)


def full_signable(flat: dict) -> tuple[dict, list[str]]:
    """({key: leaf} that full-tensor signatures (consensus.full) can sign, [keys of DTensors they cannot]) of a
    flattened state. Local, the same on every rank (placements are SPMD). Full signatures need each rank's shard
    to be one box of the global tensor (Shard(dim), Replicate); a _StridedShard (FSDP over a dim TP already
    shards) is not, and consensus.full raises on it: a save path that records load signatures should sign the rest
    and list these (their bytes still vouch for them at load), instead of failing the save. A non-tensor leaf
    without a canonical encoding (canonical.NotComparable) is listed with them: no signature could compare it."""
    from scout_ckpt.consensus.canonical import NotComparable
    from scout_ckpt.consensus.indexing import dtensor_box

    out, unsigned = {}, []
    for k, v in flat.items():
        if isinstance(v, NotComparable):
            unsigned.append(k)
            continue
        if is_dtensor(v):
            try:
                dtensor_box(v)
            except ValueError:
                unsigned.append(k)
                continue
        out[k] = v
    return out, unsigned


def dtensor_dims_cached(dt, grid: Grid, cache: dict) -> tuple[int, ...]:
    """`dtensor_dims`, remembered per (mesh, placements): a save sees the same few layouts on every tensor.
    The cache keeps the mesh alive beside its result, so its id is not reused while the entry exists."""
    key = (id(dt.device_mesh), tuple(dt.placements))
    hit = cache.get(key)
    if hit is None:
        try:
            hit = (dt.device_mesh, dtensor_dims(dt, grid), None)
        except LayoutError as e:
            hit = (dt.device_mesh, None, str(e))
        cache[key] = hit
    if hit[2] is not None:
        raise LayoutError(hit[2])
    return hit[1]


def _root_mesh(mesh):
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_root_mesh(mesh)


def _grid_of(mesh, world_size: int) -> Grid:
    root = _root_mesh(mesh)
    grid = Grid.make(tuple(root.mesh.shape), root.mesh_dim_names, root.mesh.reshape(-1).tolist())
    if sorted(grid.ranks) != list(range(world_size)):
        raise LayoutError(
            f"the root mesh {dict(zip(grid.names, grid.shape))} does not hold every rank of the "
            f"world of {world_size} exactly once"
        )
    return grid


def _role(name: str, sharded: int, replicated: int) -> str:
    low = name.lower()
    if _is_pipeline(name):
        return "pipeline"
    if any(low == t or low.startswith(t + "_") or low.endswith("_" + t) for t in TP_NAMES):
        return "tensor_parallel"
    if sharded and replicated:  # some parameters sharded, others replicated along it: tensor parallel's mark
        return "tensor_parallel"
    if sharded:
        return "shard"
    return "replicate"


def _mode(roles: list[str]) -> str:
    has = set(roles)
    base = ("hsdp" if "replicate" in has else "fsdp") if "shard" in has else "ddp"
    return base + ("+tp" if "tensor_parallel" in has else "") + ("+pp" if "pipeline" in has else "")


def describe_topology(
    model=None, *, mesh=None, world_size: int | None = None, grid: Grid | None = None, roles: dict | None = None
) -> dict:
    """The training topology as consensus sees it (JSON, identical on every rank of an SPMD job; no collective).

    mesh: the job's DeviceMesh (any submesh of it will do: its root is used); by default the root mesh of the
    model's DTensor parameters and buffers; a model without DTensors and no mesh is DDP over the world.
    grid: the topology grid itself, when the job's meshes do not have it as their root (TorchTitan unflattens every
    mesh from a 1-D world mesh; integrations.torchtitan passes its dense (pp, dp_replicate, dp_shard, cp, tp) grid):
    each DTensor is placed on it by rank arithmetic, as on a root. roles: {dim name: role} for the dims whose role
    the caller knows (otherwise inferred from the names and the placements).
    Returns {"mode": "ddp" | "fsdp" | "hsdp" with "+tp" / "+pp" (a name for people; groups do not depend on it),
    "world_size", "mesh_shape", "mesh_dim_names", "mesh" (the rank grid), "dim_roles" {dim: replicate | shard |
    tensor_parallel | pipeline}, "compare_dims" (the dim sets state is compared across, plain state's first, then
    each DTensor layout of the model's parameters), "primary" (the compare dims of most parameter elements),
    "replica_groups" (the primary dims' groups), "problems" (layouts that could not be determined: each piece of
    state they concern fails closed at every save)}.
    """
    if world_size is None:
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    tensors = []
    if model is not None:
        tensors = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers()) if is_dtensor(t)]
    problems: list[dict] = []
    given = grid is not None
    grid = grid if given else Grid.world(world_size)
    source = mesh if mesh is not None else (tensors[0][1].device_mesh if tensors else None)
    if source is not None and not given:
        try:
            grid = _grid_of(source, world_size)
            meshes = {id(t.device_mesh): t.device_mesh for _, t in tensors}
            if any(_grid_of(m, world_size) != grid for m in meshes.values()):
                raise LayoutError("the model's DTensors live on meshes with different roots")
        except LayoutError as e:
            problems.append({"code": "consensus_layout_unknown", "detail": str(e)})
            grid = Grid.world(world_size)
    weights: dict[tuple[int, ...], int] = {}
    sharded = [0] * grid.ndim
    replicated = [0] * grid.ndim
    for name, t in tensors:
        try:
            dims = dtensor_dims(t, grid)
        except LayoutError as e:
            problems.append({"code": "consensus_layout_unknown", "tensor": name, "detail": str(e)})
            continue
        weights[dims] = weights.get(dims, 0) + t.numel()
        for d in range(grid.ndim):
            if d in dims:
                replicated[d] += 1
            else:
                sharded[d] += 1
    plain = grid.plain_dims
    if not tensors:
        weights[plain] = 1
    compare = [plain] + sorted((d for d in weights if d != plain), key=lambda d: (len(d), d))
    primary = max(weights, key=lambda d: (weights[d], d)) if weights else plain
    roles = [(roles or {}).get(n) or _role(n, sharded[d], replicated[d]) for d, n in enumerate(grid.names)]
    return {
        "mode": _mode(roles) if tensors or mesh is not None or given else "ddp",
        "world_size": world_size,
        "mesh_shape": list(grid.shape),
        "mesh_dim_names": list(grid.names),
        "mesh": grid.nested(),
        "dim_roles": dict(zip(grid.names, roles)),
        "compare_dims": [grid.dim_names(d) for d in compare if grid.group_size(d) > 1],
        "primary": grid.dim_names(primary),
        "replica_groups": grid.partition(primary),
        "problems": problems,
    }


def legacy_topology(mode: str, world_size: int, mesh_shape: Sequence[int] | None = None) -> dict:
    """The topology of the old mode names, for callers that still pass one: ddp (the world), hsdp (mesh_shape =
    (replicate, shard), row-major), fsdp (every rank its own shard; plain state still compared over the world)."""
    mode = mode.lower()
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if mode == "ddp":
        grid, roles, primary, extra = Grid.make((world_size,), ("dp",), range(world_size)), ["replicate"], (0,), []
    elif mode == "fsdp":
        grid, roles, primary, extra = Grid.make((world_size,), ("shard",), range(world_size)), ["shard"], (), []
    elif mode == "hsdp":
        if mesh_shape is None or len(mesh_shape) != 2:
            raise ValueError("hsdp needs mesh_shape=(replicate, shard)")
        reps, shards = (int(x) for x in mesh_shape)
        if reps * shards != world_size:
            raise ValueError(f"mesh {reps}x{shards} does not cover world size {world_size}")
        grid = Grid.make((reps, shards), ("replicate", "shard"), range(world_size))
        roles, primary, extra = ["replicate", "shard"], (0,), [(0,)]
    else:
        raise ValueError(f"unknown mode {mode!r}; expected one of ddp, hsdp, fsdp")
    compare = [grid.plain_dims] + [d for d in extra if d != grid.plain_dims]
    return {
        "mode": mode,
        "world_size": world_size,
        "mesh_shape": list(grid.shape),
        "mesh_dim_names": list(grid.names),
        "mesh": grid.nested(),
        "dim_roles": dict(zip(grid.names, roles)),
        "compare_dims": [grid.dim_names(d) for d in compare if grid.group_size(d) > 1],
        "primary": grid.dim_names(primary),
        "replica_groups": grid.partition(primary),
        "problems": [],
    }


def grid_of_topology(topo: dict) -> Grid:
    """The Grid a topology dict describes."""
    flat: list[int] = []

    def walk(x):
        if isinstance(x, list):
            for y in x:
                walk(y)
        else:
            flat.append(int(x))

    walk(topo["mesh"])
    return Grid.make(topo["mesh_shape"], topo["mesh_dim_names"], flat)
