"""Rank workers of tests/test_one_truth.py (module level: the launcher imports them by name)."""

from __future__ import annotations

import hashlib
import time

import torch

from scout_ckpt.checkpointer import Checkpointer
from scout_ckpt.options import LocalTierOptions
from scout_ckpt.testing.faults import fault_points
from tests.workers_ckpt import ddp, make_model, state_of, train_steps


def digest(model, opt) -> str:
    """The job's own fingerprint of its model and optimizer (sha256 of every tensor's bytes, no scout-ckpt)."""
    h = hashlib.sha256()
    for part in (model.state_dict(), opt.state_dict()["state"]):
        for k in sorted(part, key=str):
            v = part[k]
            for t in v.values() if isinstance(v, dict) else [v]:
                if isinstance(t, torch.Tensor):
                    h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def local_verdict_races_durable_save(rank, world, root, local_dir):
    """Local save at step 2 of a state with a NaN (its commit slowed by 2 s on the commit thread), the NaN gone
    again before the durable save of step 3: the durable save must see the local verdict first."""

    def slow(point, step):
        if point == "local_written":
            time.sleep(2.0)

    model = make_model(seed=3)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with fault_points(slow):
        ckpt = Checkpointer(
            root,
            model=net,
            optimizer=opt,
            local=LocalTierOptions(dir=local_dir, every=2),
            on_live_fault="continue",
            replay=False,
            observer=False,
        )
    train_steps(net, opt, 1, seed=1)
    ckpt.step(1, state_of(model, opt))
    train_steps(net, opt, 1, seed=2)
    with torch.no_grad():
        keep = model[2].weight[1, 3].item()
        model[2].weight[1, 3] = float("nan")
    ckpt.step(2, state_of(model, opt))  # the local save: staged with the NaN, committing in the background
    with torch.no_grad():
        model[2].weight[1, 3] = keep
    verdict = ckpt.save(3, state_of(model, opt))
    try:
        ckpt.wait()
    except Exception as e:  # noqa: BLE001 - reported
        return {"durable": verdict, "local": ckpt.local.last_verdict, "error": repr(e)}
    local = ckpt.local.last_verdict
    ckpt.close()
    return {"durable": verdict, "local": local}


def train_and_save(rank, world, root, steps=10, save_every=5):
    """A job from step 0: saves every `save_every` steps; returns {step: (verdict state, its own digest)}."""
    model = make_model(seed=5)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, model=net, optimizer=opt, replay=False, observer=False)
    out = {}
    for step in range(1, steps + 1):
        train_steps(net, opt, 1, seed=step)
        if step % save_every == 0:
            v = ckpt.save(step, state_of(model, opt))
            out[step] = (v["state"], digest(model, opt))
    ckpt.close()
    return out


def restart(rank, world, root, save_step=None, load=True):
    """A restarted job: load_latest_clean (unless `load` is False), then optionally one save of `save_step`.
    Returns what it loaded and its own digest after the load, or the refusal (class, message, exit code)."""
    from scout_ckpt.errors import ScoutError

    model = make_model(seed=6)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(net, opt, 1, seed=99)  # optimizer state exists before loading
    try:
        ckpt = Checkpointer(root, model=net, optimizer=opt, replay=False, observer=False, timeout_s=60)
    except ScoutError as e:
        return {"refused": type(e).__name__, "message": str(e), "exit_code": e.exit_code}
    out = {}
    try:
        if load:
            st = state_of(model, opt)
            out["loaded"] = ckpt.load_latest_clean(st)
            model.load_state_dict(st["model"])
            opt.load_state_dict(st["optim"])
            out["digest"] = digest(model, opt)
        if save_step is not None:
            train_steps(net, opt, 1, seed=save_step)
            out["verdict"] = ckpt.save(save_step, state_of(model, opt))
            out["saved_digest"] = digest(model, opt)  # the job's own digest of what it saved
    except ScoutError as e:
        out.update(refused=type(e).__name__, message=str(e), exit_code=e.exit_code)
    finally:
        ckpt.close()
    return out


def _tier_opts(local_dir, rank):
    """Each rank its own node (LOCAL_WORLD_SIZE=1 in the env) with its own node-local directory: the ring puts
    each rank's peer copy on the other node."""
    return LocalTierOptions(dir=f"{local_dir}/node{rank}", every=2)


def tiers_job(rank, world, root, local_dir, steps=6, durable=(3, 6)):
    """Local saves every 2 steps, durable saves at `durable`; the digest the job computed at every step."""
    model = make_model(seed=5)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, model=net, optimizer=opt, local=_tier_opts(local_dir, rank), replay=False, observer=False)
    printed, verdicts = {}, {}
    for step in range(1, steps + 1):
        train_steps(net, opt, 1, seed=step)
        ckpt.step(step, state_of(model, opt))
        if step in durable:
            verdicts[step] = ckpt.save(step, state_of(model, opt))["state"]
        printed[step] = digest(model, opt)
    ckpt.wait()
    local = ckpt.local.last_verdict
    ckpt.close()
    return {"digests": printed, "durable": verdicts, "last_local": local}


def tiers_restart(rank, world, root, local_dir):
    """A restart with the fast tier: what it loaded, from which tier, and the job's own digest after it."""
    from scout_ckpt.errors import ScoutError

    model = make_model(seed=6)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(net, opt, 1, seed=99)
    ckpt = Checkpointer(
        root, model=net, optimizer=opt, local=_tier_opts(local_dir, rank), replay=False, observer=False, timeout_s=60
    )
    st = state_of(model, opt)
    try:
        loaded = ckpt.load_latest_clean(st)
    except ScoutError as e:
        ckpt.close()
        return {"refused": type(e).__name__, "message": str(e)}
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optim"])
    out = {
        "loaded": loaded,
        "tier": ckpt.loaded_tier,
        "digest": digest(model, opt),
        "fetched": (ckpt.local.last_loaded or {}).get("fetched"),
    }
    ckpt.close()
    return out


def restart_with_loader_fault(rank, world, root):
    """A restart whose every load sees one loaded weight changed right after dcp.load (the after_load fault
    point): every candidate is rejected for load_mismatch. Returns the refusal, or what was loaded."""
    from scout_ckpt.errors import ScoutError

    model = make_model(seed=6)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(net, opt, 1, seed=99)

    def corrupt(point, step):
        if point == "after_load":
            with torch.no_grad():
                model[0].weight.view(-1).view(torch.int32)[0] ^= 1

    with fault_points(corrupt):
        ckpt = Checkpointer(root, model=net, optimizer=opt, replay=False, observer=False, timeout_s=60)
    try:
        return {"loaded": ckpt.load_latest_clean(state_of(model, opt))}
    except ScoutError as e:
        return {"refused": type(e).__name__, "message": str(e), "exit_code": e.exit_code}
    finally:
        ckpt.close()


def tiers_restart_eio(rank, world, root, local_dir):
    """tiers_restart while every file under ROOT's step folders and the node-local directories answers EIO (a
    storage outage): the refusal, or what was loaded."""
    import errno
    import os

    real = os.open
    roots = (os.path.realpath(root) + "/step-", os.path.realpath(local_dir) + "/")

    def flaky(path, flags, *args, **kwargs):
        if not isinstance(path, int) and os.path.realpath(os.fspath(path)).startswith(roots):
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
        return real(path, flags, *args, **kwargs)

    from pathlib import Path

    real_read = Path.read_bytes

    def flaky_read(self):  # the local tier reads its files whole, through io.open (not os.open)
        if os.path.realpath(self).startswith(roots):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(self))
        return real_read(self)

    os.open, Path.read_bytes = flaky, flaky_read
    try:
        return tiers_restart(rank, world, root, local_dir)
    finally:
        os.open, Path.read_bytes = real, real_read


def tiers_job_with_replay(rank, world, root, local_dir, steps=8):
    """The fast tier with the defaults (replay on, every step hooked): local saves every 2 steps (`ckpt.step`),
    no durable save; the job's own digest at every step and each local save's verdict as it was committed."""
    model = make_model(seed=5)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, model=net, optimizer=opt, local=_tier_opts(local_dir, rank), observer=False)
    printed, verdicts = {}, {}
    for step in range(1, steps + 1):
        train_steps(net, opt, 1, seed=step)
        ckpt.step(step, state_of(model, opt))
        printed[step] = digest(model, opt)
        if step % 2 == 0:
            ckpt.local.wait()
            verdicts[step] = ckpt.local.last_verdict["state"]
    ckpt.close()
    return {"digests": printed, "verdicts": verdicts}


def resave_then_sigkill(rank, world, root, save_step, load):
    """A job that saves `save_step`, a step whose checkpoint is certified, with rank 0 SIGKILLing itself at the
    first write point of that save (before the data is written, and after it, before the commit's rename).
    `load`: it loaded the latest clean step first. Returns what the save returned or the refusal; a rank that
    reached a write point never returns."""
    import os
    import signal

    from scout_ckpt.errors import ScoutError

    def kill(point, step):
        if rank == 0 and point in ("before_write", "after_write") and step == save_step:
            os.kill(os.getpid(), signal.SIGKILL)

    model = make_model(seed=6)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(net, opt, 1, seed=99)
    with fault_points(kill):
        ckpt = Checkpointer(root, model=net, optimizer=opt, replay=False, observer=False, timeout_s=60)
    out = {}
    try:
        if load:
            out["loaded"] = ckpt.load_latest_clean(state_of(model, opt))
        else:
            train_steps(net, opt, 1, seed=save_step)
        out["verdict"] = ckpt.save(save_step, state_of(model, opt))
    except ScoutError as e:
        out.update(refused=type(e).__name__, message=str(e))
    finally:
        ckpt.close()
    return out
