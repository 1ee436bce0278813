"""Rank body for tests/test_fsdp_tp.py: a core Checkpointer on a 2-D FSDP x TP mesh (the layout that gives
_StridedShard placements), saved, then loaded by a fresh Checkpointer.

The oracle is the job's own sha256 of every full tensor (gathered with full_tensor, independent of scout-ckpt),
printed at the save and after the load."""

from __future__ import annotations

import hashlib


def _digest(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(name.encode())
        h.update(full.detach().contiguous().view(-1).view(torch_uint8()).numpy().tobytes())
    return h.hexdigest()


def torch_uint8():
    import torch

    return torch.uint8


def fsdp_tp_save_then_load(rank: int, world: int, root: str) -> dict:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from scout_ckpt import Checkpointer, ModelOptimizerState

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)

    model, opt = build()
    placements = sorted({type(pl).__name__ for p in model.parameters() for pl in p.placements})
    ckpt = Checkpointer(root, model=model, optimizer=opt, observer=False)
    saved = {}
    for step in (1, 2):
        torch.manual_seed(100 + step)  # same batch on every rank: TP needs it, FSDP does not mind
        x = torch.randn(4, 16)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(step)
        ckpt.save(step, {"app": ModelOptimizerState(model, opt)})
        saved[step] = _digest(model)
    ckpt.close()

    model2, opt2 = build()
    ckpt2 = Checkpointer(root, model=model2, optimizer=opt2, observer=False)
    loaded = ckpt2.load_latest_clean({"app": ModelOptimizerState(model2, opt2)})
    out = {"placements": placements, "saved": saved, "loaded_step": loaded, "loaded": _digest(model2)}
    ckpt2.close()
    return out
