"""SDC replay for DeepSpeed's drop-in (integrations.deepspeed): where it runs, and the two per-step calls it needs
on the job's own engine.

Replay (on by default at stages 0-2 with 2+ ranks; `install(..., replay=False)` turns it off): a rank whose
forward or backward computes wrongly has its gradient averaged into every replica, so the replicas agree and
consensus passes. `install` wraps the engine's `step` (after an optimizer step, at a gradient-accumulation
boundary: the rotation, and the capture armed for the next step) and `load_checkpoint` (the schedule restarts
from the loaded step); `save_checkpoint` runs the sweep before any byte is written, and the save's verdict
requires replay evidence (save/evidence/replay.py, as the core Checkpointer). A replay that disagrees is a live
fault: LiveStateCorrupt, as for consensus. Stage 3 partitions the parameters: replay is off (one WARNING).
"""

from __future__ import annotations

import logging

import torch

from scout_ckpt.errors import ScoutError

log = logging.getLogger("scout_ckpt.deepspeed")

__all__ = ["start", "wrap"]


def start(engine, run, *, stage: int, unsupported: str | None, groups, replay):
    """Every rank: the core's replay (save/evidence/replay.py) on the engine's module, where the data-parallel
    ranks compute the same functions on whole parameters (ZeRO 0-2) and consensus groups exist; else None (one
    WARNING when defaulted; an error when asked for).

    Args:
        engine: the DeepSpeed engine.
        run: the drop-in's IntegrationRun (world size, rank).
        stage: the ZeRO stage.
        unsupported: why the ranks are not data-parallel replicas, or None.
        groups: the consensus groups replay runs on (None: consensus off).
        replay: `install`'s replay= in options.as_replay's form (None: the default).
    """
    from scout_ckpt.save.evidence.replay import ReplayEvidence

    off = (
        "ZeRO stage 3 partitions the parameters: no layer is replayed"
        if stage >= 3
        else f"the ranks are not data-parallel replicas ({unsupported})"
        if unsupported
        else ReplayEvidence.off_by_default(run.world, "ddp")
        or ("consensus=False: replay runs on the consensus groups" if groups is None else None)
    )
    if off is not None:
        if replay:
            raise ScoutError(f"replay was asked for but cannot run here: {off}")
        if replay is None and run.rank == 0:
            log.warning("scout-ckpt: replay is off (%s): a rank computing wrongly (SDC) is not detected", off)
        return None
    return ReplayEvidence.start(
        replay, model=engine.module, optimizer=_torch_optimizer(engine), groups=groups, auto_on=True
    )


def wrap(engine, scout) -> None:
    """Replay's two per-step calls, on the job's own `engine.step()` and `engine.load_checkpoint()`: after an
    optimizer step (DeepSpeed counts `global_steps` at gradient-accumulation boundaries only) the rotation and the
    arming of the next step's capture; after a load, the schedule starts again from the loaded step. `scout` is
    the installed ScoutCheckpointEngine (its `replay`, None once closed)."""
    step_fn, load_fn = engine.step, engine.load_checkpoint

    def step(*args, **kwargs):
        before = engine.global_steps
        out = step_fn(*args, **kwargs)
        if engine.global_steps != before and scout.replay is not None:
            scout.replay.on_step(int(engine.global_steps))
        return out

    def load_checkpoint(*args, **kwargs):
        out = load_fn(*args, **kwargs)
        if scout.replay is not None:
            scout.replay.begin(int(engine.global_steps))
        return out

    step.__doc__, load_checkpoint.__doc__ = step_fn.__doc__, load_fn.__doc__
    engine.step, engine.load_checkpoint = step, load_checkpoint


def _torch_optimizer(engine):
    """The torch optimizer DeepSpeed steps, for replay of its elementwise update (stage 0: the optimizer itself;
    stages 1-2: the one ZeRO wraps, stepping this rank's partition), or None."""
    opt = getattr(engine, "optimizer", None)
    return opt if isinstance(opt, torch.optim.Optimizer) else getattr(opt, "optimizer", None)
