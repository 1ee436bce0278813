"""Rank functions for tests/test_consensus_node_exchange.py (module level: run_ranks forks into them)."""

from __future__ import annotations

import os

from scout_ckpt.consensus.groups import ConsensusGroups
from scout_ckpt.consensus.save_time import save_time_consensus
from scout_ckpt.consensus.signatures import flatten_state
from tests import workers_consensus as W


def _as_torchrun_node(rank: int, node_size: int) -> None:
    """The variables torchrun sets on a worker of a job whose nodes hold `node_size` ranks each."""
    os.environ.update(
        LOCAL_RANK=str(rank % node_size), LOCAL_WORLD_SIZE=str(node_size), GROUP_RANK=str(rank // node_size)
    )


def _state(rank: int, mode: str, flip_rank: int | None):
    if mode == "hsdp":  # as workers_consensus.hsdp_consensus: (Replicate, Shard(0)) on a 2x2 mesh
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        w, b = torch.randn(6, 5), torch.randn(6)
        state = {
            "model": {
                "w": distribute_tensor(w, mesh, [Replicate(), Shard(0)]),
                "b": distribute_tensor(b, mesh, [Replicate(), Shard(0)]),
            },
            "step": 3,
        }
        if rank == flip_rank:
            W.flip_bit(state["model"]["w"].to_local(), element=2, bit=30)
        return state
    state = W.replicated_state()
    if rank == flip_rank:
        W.flip_bit(flatten_state(state)["app.model.0.weight"], element=1, bit=17)
    return state


def both_ways(rank, world, node_size, flip_rank=None, mode="ddp", mesh_shape=None):
    """One save's consensus on the same state, through the node aggregators and then flat (the world's
    all_gathers); a rank of `flip_rank` holds one bit flipped."""
    _as_torchrun_node(rank, node_size)
    groups = ConsensusGroups.create(mode, world, mesh_shape, timeout_s=30)
    state = _state(rank, mode, flip_rank)
    used_nodes = groups.nodes is not None
    per_node = save_time_consensus(state, groups)
    exchange = per_node.pop("exchange", None)
    groups.nodes = None
    flat = save_time_consensus(state, groups)
    for ev in (per_node, flat):
        ev.pop("duration_s", None)
        for g in ev.get("groups", []):
            g.pop("duration_s", None)
    return {"per_node": per_node, "flat": flat, "used_nodes": used_nodes, "exchange": exchange}
