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


def fsdp2_frozen_weight(rank, world, root, flip_step=None, steps=6, save_every=3):
    """FSDP2 (fully_shard per block and at the root) with a frozen base weight (requires_grad=False, LoRA-style)
    in a sharded block, trained through the Checkpointer with its defaults. flip_step: after that step's optimizer
    step, rank 1 flips the lowest mantissa bit of one element of its local shard of the frozen weight. Returns
    each save's verdict state and reasons (a LiveStateCorrupt ends the run, as it ends the generation)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from scout_ckpt import ModelOptimizerState
    from scout_ckpt.errors import LiveStateCorrupt
    from tests.workers_fsdp_evidence import TinyLM, batch, train_step

    torch.manual_seed(0)
    model = TinyLM()
    frozen = model.blocks[0].fc1.weight
    frozen.requires_grad_(False)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ckpt = Checkpointer(root, model=model, optimizer=optimizer, timeout_s=120)
    state = {"app": ModelOptimizerState(model, optimizer)}
    saves = {}
    try:
        for step in range(1, steps + 1):
            train_step(model, optimizer, batch(step, rank))
            ckpt.step(step)
            if step == flip_step and rank == 1:
                with torch.no_grad():
                    local = dict(model.named_parameters())["blocks.0.fc1.weight"].to_local()
                    local.view(-1).view(torch.int32)[3] ^= 1
            if step % save_every == 0:
                try:
                    v = ckpt.save(step, state)
                except LiveStateCorrupt as e:
                    saves[step] = {"state": e.verdict["state"], "reasons": e.verdict["reasons"], "raised": True}
                    break
                saves[step] = {"state": v["state"], "reasons": v["reasons"], "raised": False}
    finally:
        ckpt.close()
    return saves


def diverge_everywhere(rank, world, root):
    """DDP trained normally, then the loss blows up on every rank alike (lr so large the weights overflow): the
    save is rejected; returns the verdict."""
    from scout_ckpt.errors import LiveStateCorrupt

    model = make_model(seed=1)
    net = ddp(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e38)
    ckpt = Checkpointer(root, model=net, optimizer=opt, timeout_s=60)
    try:
        for _ in range(3):
            train_steps(net, opt, 1, seed=2)
        try:
            return ckpt.save(3, state_of(model, opt))
        except LiveStateCorrupt as e:
            return e.verdict
    finally:
        ckpt.close()
