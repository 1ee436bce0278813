"""Rank functions for the invariants and adopt/export tests (run by scout_ckpt.testing.launch.run_ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def flip_bit(t: torch.Tensor, index: int, bit: int = 30) -> None:
    """Flip one bit of a float32 element in place (t must be contiguous)."""
    t.view(-1).view(torch.int32)[index] ^= 1 << bit


def sphere_state(world: int):
    """A small model whose weights sit on known manifolds, sharded with FSDP2 plus two hand-placed DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)  # the same full tensors on every rank
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 8, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p /= p.norm()  # Frobenius sphere, radius 1
    fully_shard(model, mesh=mesh)
    rows = torch.nn.functional.normalize(torch.randn(12, 20), dim=1)  # oblique rows
    orth = torch.linalg.qr(torch.randn(24, 8))[0].contiguous()  # spectral norm 1
    extra = {
        "emb": distribute_tensor(rows, mesh, [Shard(1)]),  # row norms need a sum over ranks
        "orth": distribute_tensor(orth, mesh, [Shard(0)]),
    }  # spectral norm via the Gram matrix
    return model, extra


SPECS = [
    "finite",
    "frobenius_sphere:radius=1.0:params=model.*.weight",
    "oblique:params=emb:axis=rows",
    "spectral_sphere:radius=1.0:params=orth",
    "monotone:path=step",
]


def sphere_scenarios(rank: int, world: int, save_dir: str):
    """run_local on the healthy sharded state (saved to save_dir with dcp.save), then with one high bit of
    rank 2's own shard flipped. Returns both evidences."""
    import torch.distributed.checkpoint as dcp

    from scout_ckpt.invariants import flatten, parse_specs, run_local

    checks = parse_specs(SPECS)
    model, extra = sphere_state(world)
    state = {"model": model.state_dict(), **extra, "step": 7}
    healthy = run_local(checks, flatten(state), previous={"step": 6})
    dcp.save(state, checkpoint_id=save_dir)
    if rank == 2:
        with torch.no_grad():
            flip_bit(model[0].weight.to_local(), 5)  # a high exponent bit of this rank's own shard
    flipped = run_local(checks, flatten({"model": model.state_dict(), **extra, "step": 7}), previous={"step": 6})
    return healthy, flipped


def plain_dcp_save(rank: int, world: int, root: str, steps: list[int]):
    """Plain DCP saves as a training script writes them (TorchTitan layout ROOT/step-N), no scout-ckpt involved.
    Returns, on rank 0, the full model tensors of each step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    saved = {}
    for step in steps:
        torch.manual_seed(step)
        full = {
            "layers.0.weight": torch.randn(16, 8),
            "layers.1.weight": torch.randn(8, 8),
            "head.bias": torch.randn(8),
        }
        model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
        optim = {
            "state": {k: {"exp_avg": torch.zeros_like(v)} for k, v in model.items()},
            "param_groups": [{"lr": 0.1}],
        }
        dcp.save(
            {"model": model, "optimizer": optim, "train_state": {"step": step}}, checkpoint_id=f"{root}/step-{step}"
        )
        saved[step] = full
    dist.barrier()
    return saved if rank == 0 else None
