"""Rank functions for the checkpointer tests (module level: run_ranks forks into them)."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn

from scout_ckpt.checkpointer import Checkpointer


def make_model(seed: int = 0, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))


def train_steps(model, opt, steps, seed=0):
    """Explicit per-parameter all_reduce (TORCH-NOTES: bitwise-resumable, unlike DDP's reducer)."""
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    for _ in range(steps):
        x = torch.randn(8, model[0].in_features, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()


def state_of(model, opt):
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def flat_tensors(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, torch.Tensor):
            out[key] = v.detach().clone()
        elif isinstance(v, dict):
            out.update(flat_tensors(v, key))
    return out


def save_and_reload(rank, world, root, async_save, steps=3):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, model=model, optimizer=opt, async_save=async_save)
    train_steps(model, opt, steps)
    verdicts = []
    for s in (steps, steps + 1):
        if s > steps:
            train_steps(model, opt, 1, seed=s)
        verdicts.append(ckpt.save(s, state_of(model, opt)))
    ckpt.wait()
    saved = flat_tensors(state_of(model, opt))
    ckpt.close()
    # A fresh model/optimizer, loaded from the latest clean checkpoint.
    model2 = make_model(seed=123)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    train_steps(model2, opt2, 1, seed=99)  # materialize optimizer state so keys exist
    ckpt2 = Checkpointer(root, model=model2, optimizer=opt2)
    st = state_of(model2, opt2)
    loaded_step = ckpt2.load_latest_clean(st)
    model2.load_state_dict(st["model"])
    opt2.load_state_dict(st["optim"])
    loaded = flat_tensors(state_of(model2, opt2))
    ckpt2.close()
    equal = sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)
    return {"verdicts": verdicts, "loaded_step": loaded_step, "equal": equal}


def crash_during_save(rank, world, root, point, victim, crash_step):
    """Save at steps 2 and 4; `victim` SIGKILLs itself at `point` of the save at crash_step."""
    def hook(p, step):
        if p == point and step == crash_step and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root, model=model, optimizer=opt, fault_hook=hook, timeout_s=20)
    for s in (2, 4):
        train_steps(model, opt, 2, seed=s)
        ckpt.save(s, state_of(model, opt))
    ckpt.close()
    return True
