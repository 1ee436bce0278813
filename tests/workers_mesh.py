"""Rank functions for the mesh tests (module level: run_ranks forks into them). Results are plain data.

Each function builds one topology, derives the consensus groups from the model (describe_topology), then takes
several evidences in the same run: healthy, after one rank's local shard of some tensor changed in one element
(not element 0), and back to healthy. Models are tiny: 8 ranks share 2 cores.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from scout_ckpt.consensus.groups import ConsensusGroups
from scout_ckpt.consensus.mesh import describe_topology
from scout_ckpt.consensus.save_time import save_time_consensus

TIMEOUT_S = 120


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def _nudge(t: torch.Tensor, rank: int, who: int, sign: float = 1.0) -> None:
    """On rank `who`, change element 1 of t's local shard (not element 0) by one ulp; `sign` -1 undoes it."""
    if rank != who:
        return
    flat = _local(t).view(-1)
    x = flat[1]
    flat[1] = torch.nextafter(x, torch.tensor(float("inf") * sign, dtype=x.dtype))


def _train_step(model: nn.Module, x: torch.Tensor) -> torch.optim.Optimizer:
    """One Adam step on the same batch on every rank: optimizer state with the parameters' layouts, plus plain
    step counters."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = model(x)
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    out.pow(2).mean().backward()
    opt.step()
    return opt


def _consensus(model, opt, groups, step=7, **kw) -> dict:
    state = {"model": model.state_dict(), "optim": opt.state_dict() if opt is not None else {}, "step": step}
    return save_time_consensus(state, groups, **kw)


def _scenarios(rank, model, opt, groups, flips) -> dict:
    """Evidence healthy, then with each (label, tensor, rank) change applied alone (and undone after)."""
    out = {"healthy": _consensus(model, opt, groups)}
    for label, tensor, who in flips:
        with torch.no_grad():
            _nudge(tensor, rank, who)
            out[label] = _consensus(model, opt, groups)
            _nudge(tensor, rank, who, -1.0)
    out["healthy_again"] = _consensus(model, opt, groups)
    return out


class MLP(nn.Module):
    def __init__(self, d: int = 8, h: int = 16):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def ddp_tp(rank, world):
    """DDP x TP on a 2x2 (dp, tp) mesh: the MLP tensor-parallel on mesh["tp"] (colwise up, rowwise down), the
    LayerNorm a plain module (DDP-replicated everywhere). The dp dim is not on the parameters' mesh at all."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = parallelize_module(MLP(), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = _train_step(model, torch.randn(4, 8))
    topo = describe_topology(model)
    groups = ConsensusGroups.from_topology(topo, timeout_s=TIMEOUT_S)
    flips = [
        ("tp_shard", model.up.weight, 2),  # replicated along dp only: pairs (0,2), (1,3)
        ("tp_replicated", model.down.bias, 3),  # Replicate on tp, copies along dp: all 4 ranks
        ("plain_param", model.norm.weight, 1),  # a plain tensor: the world
        ("optim_shard", opt.state[model.down.weight]["exp_avg"], 1),
    ]
    return {
        "topology": topo,
        "evidence": _scenarios(rank, model, opt, groups, flips),
        "kinds": [[list(k.names), k.members] for k in groups.kinds],
        "group_ranks": groups.group_ranks,
    }


def fsdp_tp(rank, world):
    """FSDP x TP on a 2x2 (dp, tp) mesh: the MLP tensor-parallel on mesh["tp"], then fully_shard over mesh["dp"].
    TP-sharded weights are sharded on both dims (single-owner); the LayerNorm is replicated along tp only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = parallelize_module(MLP(), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = _train_step(model, torch.randn(4, 8))
    topo = describe_topology(model)
    groups = ConsensusGroups.from_topology(topo, timeout_s=TIMEOUT_S)
    step_tensor = opt.state[model.norm.weight]["step"]  # Adam's step: a plain 0-d tensor on every rank
    out = _scenarios(rank, model, opt, groups, [("norm_pair", model.norm.weight, 1)])
    with torch.no_grad():
        step_tensor.add_(1 if rank == 2 else 0)
        out["plain_step"] = _consensus(model, opt, groups)
        step_tensor.sub_(1 if rank == 2 else 0)
    # a pending reduction (Partial) has no value to compare: the piece fails closed, the rest is still compared
    pending = DTensor.from_local(torch.ones(3), mesh, [Partial(), Partial()])
    out["partial"] = save_time_consensus({"model": model.state_dict(), "pending": pending, "step": 7}, groups)
    out["everything_excluded"] = _consensus(model, opt, groups, names_filter=lambda name: False)
    return {
        "topology": topo,
        "evidence": out,
        "kinds": [[list(k.names), k.members] for k in groups.kinds],
        "group_ranks": groups.group_ranks,
    }


def hsdp_tp(rank, world):
    """HSDP x TP on a 2x2x2 (replicate, shard, tp) mesh, placements given by hand as FSDP2 + TP lay them out:
    a TP-sharded weight (Replicate, Shard(0), Shard(1)): replicas along `replicate` only; a TP-replicated norm
    (Replicate, Shard(0), Replicate): replicas along `replicate` and `tp`, groups of 4."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    torch.manual_seed(0)
    model = nn.Module()
    model.w = nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Replicate(), Shard(0), Shard(1)]))
    model.norm = nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Replicate(), Shard(0), Replicate()]))
    model.register_buffer("seen", torch.tensor([5.0, 6.0]))  # plain: the world
    topo = describe_topology(model)
    groups = ConsensusGroups.from_topology(topo, timeout_s=TIMEOUT_S)
    flips = [("norm", model.norm, 5), ("tp_shard", model.w, 6), ("plain", model.seen, 4)]
    return {
        "topology": topo,
        "evidence": _scenarios(rank, model, None, groups, flips),
        "kinds": [[list(k.names), k.members] for k in groups.kinds],
        "group_ranks": groups.group_ranks,
    }


def fsdp_only(rank, world):
    """FSDP2 over a 1-D mesh of every rank: parameters single-owner, plain state (Adam's step counters, lr, the
    training step) compared over the world; a state of shards alone compares nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = MLP()
    fully_shard(model, mesh=mesh)
    opt = _train_step(model, torch.randn(4, 8))
    topo = describe_topology(model)
    groups = ConsensusGroups.from_topology(topo, timeout_s=TIMEOUT_S)
    out = {"healthy": _consensus(model, opt, groups)}
    step_tensor = opt.state[model.up.weight]["step"]
    with torch.no_grad():
        step_tensor.add_(1 if rank == 3 else 0)
        out["plain_step"] = _consensus(model, opt, groups)
        step_tensor.sub_(1 if rank == 3 else 0)
    out["shards_only"] = save_time_consensus({"model": model.state_dict()}, groups)
    return {
        "topology": topo,
        "evidence": out,
        "kinds": [[list(k.names), k.members] for k in groups.kinds],
        "group_ranks": groups.group_ranks,
    }


def fsdp_runs(rank, world):
    """fsdp_tp then fsdp_only in one set of ranks (one start-up instead of two: 4 ranks share 2 cores)."""
    return {"fsdp_tp": fsdp_tp(rank, world), "fsdp_only": fsdp_only(rank, world)}


def mismatched_topology(rank, world):
    """Ranks that pass different topologies get a ValueError on every rank, not a hang in new_group."""
    from scout_ckpt.consensus.mesh import legacy_topology

    topo = legacy_topology("hsdp", world, (2, 2)) if rank == 1 else legacy_topology("ddp", world)
    try:
        ConsensusGroups.from_topology(topo, timeout_s=TIMEOUT_S)
        return "created"
    except ValueError as e:
        return str(e)
