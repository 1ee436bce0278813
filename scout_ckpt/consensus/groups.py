"""Replica groups from the training topology, and the side process groups consensus runs on.

DDP:  every rank holds the whole state          -> one group of all ranks.
HSDP: mesh (replicate R, shard S), rank r*S + s -> S groups; group s = [s, S+s, 2S+s, ...] (same shard index).
FSDP: every rank holds its own shard            -> each rank alone: no replicas, consensus does not apply.

Consensus never runs on the training process groups: `ConsensusGroups.create` makes new gloo groups, in the same
order on every rank, at startup (TORCH-NOTES: side groups keep working while training groups are busy, and a PG
timeout kills only that group).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Sequence

MODES = ("ddp", "hsdp", "fsdp")


def replica_groups(mode: str, world_size: int, mesh_shape: Sequence[int] | None = None) -> list[list[int]]:
    """The replica groups of a topology: lists of global ranks that hold identical state."""
    mode = mode.lower()
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if mode == "ddp":
        return [list(range(world_size))]
    if mode == "fsdp":
        return [[r] for r in range(world_size)]
    if mode == "hsdp":
        if mesh_shape is None or len(mesh_shape) != 2:
            raise ValueError("hsdp needs mesh_shape=(replicate, shard)")
        reps, shards = (int(x) for x in mesh_shape)
        if reps * shards != world_size:
            raise ValueError(f"mesh {reps}x{shards} does not cover world size {world_size}")
        return [[r * shards + s for r in range(reps)] for s in range(shards)]
    raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")


@dataclass
class ConsensusGroups:
    """This rank's view of the replica groups: every group's members, this rank's own group (handle and members),
    and a world-level gloo group for gathering verdicts. Build it with `create` (collective)."""

    mode: str
    world_size: int
    rank: int
    groups: list[list[int]]
    group_ranks: list[int]              # members of this rank's replica group (global ranks, sorted)
    group: Any = None                   # gloo process group of this rank's replica group; None if alone
    world_group: Any = None             # gloo process group of all ranks
    mesh_shape: tuple[int, ...] | None = None
    timeout_s: float = 60.0

    @property
    def has_replicas(self) -> bool:
        """True when some group has two or more members (the same answer on every rank)."""
        return any(len(g) > 1 for g in self.groups)

    @classmethod
    def create(cls, mode: str, world_size: int, mesh_shape: Sequence[int] | None = None,
               timeout_s: float = 60.0) -> "ConsensusGroups":
        """Collective on all ranks of the default process group: creates one new gloo group per replica group
        of two or more members (all ranks call new_group for every group, in the same order) and one world
        gloo group."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ConsensusGroups.create needs an initialised default process group")
        if dist.get_world_size() != world_size:
            raise ValueError(f"world_size {world_size} differs from the process group's {dist.get_world_size()}")
        rank = dist.get_rank()
        groups = replica_groups(mode, world_size, mesh_shape)
        timeout = datetime.timedelta(seconds=timeout_s)
        mine = next(g for g in groups if rank in g)
        handle = None
        for g in groups:
            if len(g) < 2:
                continue
            pg = dist.new_group(ranks=g, backend="gloo", timeout=timeout)
            if rank in g:
                handle = pg
        world = dist.new_group(ranks=list(range(world_size)), backend="gloo", timeout=timeout)
        return cls(mode=mode.lower(), world_size=world_size, rank=rank, groups=groups, group_ranks=sorted(mine),
                   group=handle, world_group=world,
                   mesh_shape=tuple(mesh_shape) if mesh_shape is not None else None, timeout_s=timeout_s)
