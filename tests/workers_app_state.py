"""Rank functions for tests/test_app_state.py (importable: the forkserver children import them)."""

import random

import numpy as np
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scout_ckpt import Checkpointer, ModelOptimizerState, RankLocal, RNGState, Scalars


def _job(rank, root):
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {"iter_num": 0, "best_val_loss": 1e9}
    local = {"data_pos": 0, "best_val_loss": 1e9}
    state = {
        "app": ModelOptimizerState(model, opt),
        "extra": Scalars(extra),
        "rng": RankLocal(RNGState()),
        "local": RankLocal(Scalars(local)),
    }
    return model, opt, extra, local, state


def save_then_draw(rank, world, root):
    """Each rank seeds differently (as nanoGPT does), saves at step 3, then records what it draws next."""
    model, opt, extra, local, state = _job(rank, root)
    ckpt = Checkpointer(root, model=model, optimizer=opt)
    torch.manual_seed(1337 + rank)
    np.random.seed(rank)
    random.seed(rank)
    for step in range(1, 4):
        x = torch.randn(5, 8)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        extra["iter_num"] = step
        local["data_pos"] = 100 * rank + step
        local["best_val_loss"] = 1.0 / (rank + step)
        ckpt.step(step)
    verdict = ckpt.save(3, state)
    after = {"torch": torch.rand(3).tolist(), "numpy": np.random.rand(2).tolist(), "python": random.random()}
    ckpt.close()
    return {"verdict": verdict, "after": after, "local": dict(local), "extra": dict(extra)}


def load_then_draw(rank, world, root):
    model, opt, extra, local, state = _job(rank, root)
    ckpt = Checkpointer(root, model=model, optimizer=opt)
    torch.manual_seed(999)  # all three must be overwritten by the load
    np.random.seed(999)
    random.seed(999)
    start = ckpt.load_latest_clean(state)
    after = {"torch": torch.rand(3).tolist(), "numpy": np.random.rand(2).tolist(), "python": random.random()}
    ckpt.close()
    return {"start": start, "after": after, "local": dict(local), "extra": dict(extra)}
