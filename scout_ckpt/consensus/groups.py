"""Replica groups of a topology, and the side process groups consensus runs on.

Which ranks hold the same bits follows from the DeviceMesh and each DTensor's placements (`mesh.py`): state is
compared across its *compare dims*, and each set of compare dims partitions the world into replica groups. A
topology (`describe_topology(model)`, or `legacy_topology(mode, ...)` for the old mode names) lists the compare
dims the model's state uses; `ConsensusGroups.from_topology` makes one gloo group per replica group of two or more
ranks, for each of them.

Consensus never runs on the training process groups: the groups are new gloo groups, made at start-up in the same
order on every rank, with an explicit timeout (docs/pytorch-facts.md: side groups keep working while training groups are
busy, and a PG timeout kills only that group). Before making any, the ranks check (one all_gather of a digest)
that they all describe the same topology, so a mismatch raises on every rank instead of hanging in new_group.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from scout_ckpt.consensus.mesh import Grid, grid_of_topology, legacy_topology
from scout_ckpt.consensus.nodes import plan as node_plan

MODES = ("ddp", "hsdp", "fsdp")


def replica_groups(mode: str, world_size: int, mesh_shape: Sequence[int] | None = None) -> list[list[int]]:
    """The replica groups of the parameters under an old mode name: lists of global ranks that hold identical
    parameter shards (DDP: the world; HSDP (replicate R, shard S), rank r*S + s: S groups of the same shard index;
    FSDP: each rank alone)."""
    return legacy_topology(mode, world_size, mesh_shape)["replica_groups"]


@dataclass
class KindGroups:
    """One set of compare dims: its replica groups, this rank's group and its gloo group (None when alone)."""

    dims: tuple[int, ...]  # indices into the topology grid
    names: tuple[str, ...]  # their dim names
    groups: list[list[int]]
    members: list[int]  # this rank's group (global ranks, sorted)
    pg: Any = None

    @property
    def index(self) -> int:
        """The position of this rank's group in `groups` (the same group has the same index on every rank)."""
        return self.groups.index(self.members)


@dataclass
class ConsensusGroups:
    """This rank's view of the replica groups. `groups`/`group_ranks`/`group` are those of the primary compare
    dims (the parameters' replicas; the replay runner uses them); `kinds` holds every set of compare dims, plain
    state's first. Build it with `from_topology` or `create` (collective)."""

    mode: str
    world_size: int
    rank: int
    groups: list[list[int]]
    group_ranks: list[int]  # members of this rank's primary replica group (global ranks, sorted)
    group: Any = None  # gloo process group of that group; None if alone
    world_group: Any = None  # gloo process group of all ranks
    mesh_shape: tuple[int, ...] | None = None
    timeout_s: float = 60.0
    grid: Grid | None = None
    kinds: list[KindGroups] = field(default_factory=list)
    topology: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict, repr=False)  # (mesh, placements) -> compare dims, see mesh.py
    # Set once a save's evidence has used load-verification signatures (SaveEvidence.live): later background
    # consensus also computes this rank's partial signatures of its DTensor shards, in the write's flush
    # (save_time.start_consensus, full.shard_partials).
    sign_partials: bool = field(default=False, repr=False)
    # This rank's node on a multi-node torchrun job (consensus/nodes.py), else None: consensus then exchanges its
    # headers and verdicts through each node's aggregator (consensus/node_exchange.py) instead of over the world.
    nodes: Any = field(default=None, repr=False)

    @property
    def has_replicas(self) -> bool:
        """True when some state has a replica on another rank (the same answer on every rank)."""
        return any(len(k.members) > 1 for k in self.kinds)

    @property
    def problems(self) -> list[dict]:
        """Layouts of the model the topology could not determine (each fails consensus closed)."""
        return list(self.topology.get("problems") or [])

    @property
    def process_groups(self) -> list[Any]:
        """Every gloo group this rank uses for consensus (the world group first), e.g. for an observer to ignore."""
        out = [self.world_group] if self.world_group is not None else []
        for k in self.kinds:
            if k.pg is not None and all(k.pg is not g for g in out):
                out.append(k.pg)
        return out

    def kind_of(self, dims: Sequence[int]) -> KindGroups | None:
        dims = tuple(dims)
        return next((k for k in self.kinds if k.dims == dims), None)

    @classmethod
    def create(
        cls, mode: str, world_size: int, mesh_shape: Sequence[int] | None = None, timeout_s: float = 60.0
    ) -> "ConsensusGroups":
        """Collective: the groups of an old mode name (ddp, hsdp with mesh_shape, fsdp); see `from_topology`."""
        return cls.from_topology(legacy_topology(mode, world_size, mesh_shape), timeout_s=timeout_s)

    @classmethod
    def from_topology(cls, topology: dict, timeout_s: float = 60.0) -> "ConsensusGroups":
        """Collective on all ranks of the default process group, at start-up: one world gloo group, a check that
        every rank passed the same topology (ValueError on every rank otherwise), then one gloo group per replica
        group of two or more members for each set of compare dims, all ranks calling new_group for every group in
        the same order. A group of the whole world reuses the world group."""
        import torch
        import torch.distributed as dist
        import xxhash

        if not dist.is_initialized():
            raise RuntimeError("ConsensusGroups needs an initialised default process group")
        world_size = int(topology["world_size"])
        if dist.get_world_size() != world_size:
            raise ValueError(f"world_size {world_size} differs from the process group's {dist.get_world_size()}")
        rank = dist.get_rank()
        timeout = datetime.timedelta(seconds=timeout_s)
        world = dist.new_group(ranks=list(range(world_size)), backend="gloo", timeout=timeout)
        digest = xxhash.xxh3_64_intdigest(json.dumps(topology, sort_keys=True, default=str).encode()) >> 1
        mine = torch.tensor([digest], dtype=torch.int64)
        seen = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(seen, mine, group=world)
        if any(int(s) != digest for s in seen):
            odd = [r for r, s in enumerate(seen) if int(s) != int(seen[0])]
            raise ValueError(
                f"ranks describe different topologies (ranks {odd} differ from rank 0): consensus "
                "needs the same mesh and parameter layouts on every rank"
            )
        grid = grid_of_topology(topology)
        kinds: list[KindGroups] = []
        everyone = list(range(world_size))
        for names in topology["compare_dims"]:
            dims = grid.dims_of(names)
            groups = grid.partition(dims)
            members = next(g for g in groups if rank in g)
            handle = None
            for g in groups:
                if len(g) < 2:
                    continue
                pg = world if g == everyone else dist.new_group(ranks=g, backend="gloo", timeout=timeout)
                if rank in g:
                    handle = pg
            kinds.append(KindGroups(dims, tuple(names), groups, members, handle))
        primary = grid.dims_of(topology["primary"])
        groups = grid.partition(primary)
        members = next(g for g in groups if rank in g)
        kind = next((k for k in kinds if k.dims == primary), None)
        return cls(
            mode=topology["mode"],
            world_size=world_size,
            rank=rank,
            groups=groups,
            group_ranks=members,
            group=kind.pg if kind is not None and len(members) > 1 else None,
            world_group=world,
            mesh_shape=tuple(topology["mesh_shape"]),
            timeout_s=timeout_s,
            grid=grid,
            kinds=kinds,
            topology=topology,
            nodes=node_plan(rank, world_size),
        )
