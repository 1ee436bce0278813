"""Rank functions for tests/test_s3.py (module level: run_ranks forks into them). The S3 server is the test's
own moto server, reached over HTTP at `endpoint`."""

from __future__ import annotations

import hashlib
import os
import signal

import torch
import torch.nn as nn

from scout_ckpt.checkpointer import Checkpointer
from scout_ckpt.errors import ScoutError
from scout_ckpt.testing.faults import fault_points
from tests.workers_ckpt import ddp, flat_tensors, state_of, train_steps

BLOCK = 5 << 20  # the smallest S3 multipart part: a rank file past it is uploaded in parts


def options(endpoint: str) -> dict:
    return {"client_kwargs": {"endpoint_url": endpoint}, "default_block_size": BLOCK}


def make_model(seed: int = 0, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))


def digest(sd) -> str:
    """The test's own oracle: sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for k, v in sorted(flat_tensors(sd).items()):
        h.update(f"{k}|{v.dtype}|{tuple(v.shape)}|".encode())
        h.update(v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    return h.hexdigest()


def save_steps(
    rank,
    world,
    uri,
    ledger_dir,
    endpoint,
    steps,
    *,
    width=16,
    keep=None,
    kill=None,
    fail=None,
    async_save=False,
    resume=False,
    timeout_s=60.0,
):
    """Train and save at each step in `steps`; returns {step: oracle digest} of the state saved. `resume`: a
    restarted job (as load_latest) that loads the latest clean step first and trains on from it. `kill` =
    (step, rank): that rank SIGKILLs itself in the middle of its upload at that step (a part already sent);
    `fail` = (step, rank): that rank's upload raises there instead (the process lives on).

    With `async_save`, save() returns at once and training goes on while the upload runs (the next
    train_steps changes the parameters in place): the digest is taken when save() returns, which is the state
    the checkpoint must hold. A failed async save is raised by the next wait(); it is recorded in `errors`."""
    failed = []

    def hook(point, step):
        if kill and point == "during_write" and (step, rank) == tuple(kill):
            os.kill(os.getpid(), signal.SIGKILL)
        if fail and point == "during_write" and (step, rank) == tuple(fail):
            failed.append(step)
            raise RuntimeError(f"injected upload failure at step {step} on rank {rank}")

    model = make_model(seed=7 if resume else 0, width=width)
    net = ddp(model)  # trained as users train: DDP on gloo (tests/workers_ckpt.py)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if resume:
        train_steps(net, opt, 1, seed=99)  # moments materialized, values unlike the checkpoint's
    with fault_points(hook):
        ckpt = Checkpointer(
            uri,
            ledger_dir=ledger_dir,
            storage_options=options(endpoint),
            model=net,
            optimizer=opt,
            keep=keep,
            timeout_s=timeout_s,
            async_save=async_save,
        )
    saved, models, verdicts, errors, done, prev, loaded = {}, {}, {}, {}, 0, None, None
    if resume:
        done = _load_into(ckpt, model, opt) or 0
        loaded = {"step": done, "digest": digest(state_of(model, opt))}
    for s in steps:
        train_steps(net, opt, s - done, seed=s)
        done = s
        try:
            v = ckpt.save(s, state_of(model, opt))  # async: the previous save's failure is raised here
        except ScoutError as e:
            errors[prev] = str(e)
            v = ckpt.save(s, state_of(model, opt))
        verdicts[s] = v["state"] if v else None
        saved[s], prev = digest(state_of(model, opt)), s
        models[s] = digest(model.state_dict())  # the weights alone: what `export` must write
    if async_save:
        train_steps(net, opt, 1, seed=1000)  # training goes on while the last upload runs
        try:
            ckpt.wait()
        except ScoutError as e:
            errors[steps[-1]] = str(e)
    ckpt.close()
    return {
        "saved": saved,
        "models": models,
        "verdicts": verdicts,
        "errors": errors,
        "failed": failed,
        "loaded": loaded,
    }


def _load_into(ckpt, model, opt) -> int | None:
    st = state_of(model, opt)
    step = ckpt.load_latest_clean(st)
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optim"])
    return step


def load_latest(rank, world, uri, ledger_dir, endpoint, *, width=16, then_save=None):
    """A restarted job: fresh model and AdamW (moments materialized), load_latest_clean; optionally save again."""
    model = make_model(seed=7, width=width)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(net, opt, 1, seed=99)
    ckpt = Checkpointer(
        uri, ledger_dir=ledger_dir, storage_options=options(endpoint), model=net, optimizer=opt, timeout_s=60
    )
    step = _load_into(ckpt, model, opt)
    got = digest(state_of(model, opt))
    verdict = None
    if then_save is not None:
        train_steps(net, opt, 1, seed=then_save)
        verdict = ckpt.save(then_save, state_of(model, opt))["state"]
    ckpt.close()
    return {"step": step, "digest": got, "verdict": verdict}


# ---- FSDP2 (fully_shard at its defaults) on S3 ------------------------------------------------------------------


def fsdp_save(rank, world, uri, ledger_dir, endpoint, *, steps=4, save_every=2, async_save=False):
    """A user's FSDP2 job: the Checkpointer built before training (its defaults: shard evidence on), a step
    hook every step, saves every `save_every` steps. Returns {step: sha256 of the full (unsharded) model and
    optimizer state at the save}, computed by the job itself (every rank takes part in the gather)."""
    from scout_ckpt import ModelOptimizerState
    from tests.workers_ckpt import FSDP_CHECKS, _fsdp_model, _fsdp_train, _full_state

    model = _fsdp_model(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(
        uri,
        ledger_dir=ledger_dir,
        storage_options=options(endpoint),
        model=model,
        optimizer=opt,
        invariants=FSDP_CHECKS,
        async_save=async_save,
        timeout_s=120,
    )
    state = {"app": ModelOptimizerState(model, opt)}
    saved, verdicts = {}, {}
    for step in range(1, steps + 1):
        _fsdp_train(model, opt, 1, seed=step)
        ckpt.step(step)
        if step % save_every == 0:
            v = ckpt.save(step, state)
            verdicts[step] = v["state"] if v else None
            saved[step] = digest(_full_state(model, opt))
    ckpt.close()
    return {"saved": saved, "verdicts": verdicts, "mode": ckpt.mode}


def fsdp_load(rank, world, uri, ledger_dir, endpoint):
    """A restarted FSDP2 job on `world` ranks (the saving job's or another): fresh model, optimizer state
    materialized, load_latest_clean; the job's sha256 of the full state it loaded, or the error it raised."""
    from scout_ckpt import ModelOptimizerState
    from tests.workers_ckpt import FSDP_CHECKS, _fsdp_model, _fsdp_train, _full_state

    model = _fsdp_model(world, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _fsdp_train(model, opt, 1, seed=42)
    ckpt = Checkpointer(
        uri,
        ledger_dir=ledger_dir,
        storage_options=options(endpoint),
        model=model,
        optimizer=opt,
        invariants=FSDP_CHECKS,
        timeout_s=120,
    )
    try:
        step = ckpt.load_latest_clean({"app": ModelOptimizerState(model, opt)})
    finally:
        ckpt.close()
    return {"step": step, "digest": digest(_full_state(model, opt))}
