"""Workers for tests/test_murphy_journal.py (run by scout_ckpt.testing.launch.run_ranks; importable)."""

from __future__ import annotations

import builtins
import pickle

import torch
import torch.distributed as dist

from scout_ckpt.checkpointer import Checkpointer
from scout_ckpt.save.loading import LatestCleanLoader
from tests.workers_ckpt import ddp, make_model, state_of, train_steps


class _RunsCode:
    """Unpickling this creates `path`: the proof that a pickle's code ran."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return builtins.open, (self.path, "w")


def swap_metadata_after_verification(rank, world, root, step_dir, marker):
    """A restarted job's load_latest_clean, where `step_dir/.metadata` is replaced by a pickle that runs code the
    moment the byte verification of that step has passed (rank 0 swaps it; every rank waits for the swap)."""
    original = LatestCleanLoader._verify_bytes

    def verify_then_swap(self, cand, path):
        failed = original(self, cand, path)
        if str(path) == step_dir:
            if rank == 0:
                with open(f"{step_dir}/.metadata", "wb") as f:
                    f.write(pickle.dumps(_RunsCode(marker)))
            dist.barrier()
        return failed

    LatestCleanLoader._verify_bytes = verify_then_swap
    model = make_model(seed=3)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(net, opt, 1, seed=5)
    ckpt = Checkpointer(root, model=net, optimizer=opt)
    try:
        st = state_of(model, opt)
        step = ckpt.load_latest_clean(st)
        return {"step": step, "weight": st["model"]["0.weight"].tolist()}
    finally:
        ckpt.close()
