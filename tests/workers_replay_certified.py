"""Rank workers for "certified when committed": a user-shaped script (TorchTitan-shaped model, a plain training
loop, `Checkpointer(root, model=model, optimizer=opt)` with the defaults) under DDP or FSDP2, optionally with a
block that starts computing wrongly on one rank between two saves, as failing hardware would."""

from __future__ import annotations

import torch
import torch.distributed as dist


def w_user_script(rank, world, root, mode, steps, save_every, fault=None, replay=None, shard_cycle=None):
    """Train and save every `save_every` steps; returns each save's verdict as `save()` returned it (the commit's
    verdict; a save that raised LiveStateCorrupt ends the loop, `ended`) and the run's policy. fault: (rank, block index, from step, scale). replay: the Checkpointer's
    `replay=` (None: the default, True). shard_cycle: FSDP shard evidence cycle (None: the default)."""
    from scout_ckpt import Checkpointer, LiveStateCorrupt, ModelOptimizerState, ShardEvidenceOptions
    from tests import workers_health as wh
    from tests import workers_replay_targets as wt

    model = wh._model(mode, world)
    inner = model.module if mode == "ddp" else model  # ddp, fsdp or hsdp (tests/workers_health._model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw = {} if replay is None else {"replay": replay}
    if shard_cycle is not None:
        kw["shard_evidence"] = ShardEvidenceOptions(cycle=shard_cycle)
    ckpt = Checkpointer(root, model=model, optimizer=opt, **kw)
    state = {"app": ModelOptimizerState(model, opt)}
    start = ckpt.load_latest_clean(state) or 0
    verdicts, ended = {}, None
    for step in range(start + 1, steps + 1):
        if fault and rank == fault[0] and step == fault[2]:
            wt.blocks_of(inner)[fault[1]].fault_scale = fault[3]
        wt.train_step(model, opt, step, rank)
        ckpt.step(step)
        if step % save_every == 0:
            try:
                v = ckpt.save(step, state)
            except LiveStateCorrupt as e:  # the generation ends here on every rank (torchrun would restart it)
                verdicts[step] = {"state": e.verdict["state"], "reasons": e.verdict["reasons"]}
                ended = step
                break
            verdicts[step] = {"state": v["state"], "reasons": v["reasons"]}
    out = {
        "verdicts": verdicts,
        "replay": ckpt.replay is not None,
        "mode": ckpt.mode,
        "ended": ended,
        "targets": ckpt.replay.targets() if ckpt.replay else [],
    }
    ckpt.close()
    dist.barrier()
    return out


def w_sdc_and_healthy(rank, world, root_fault, root_healthy, root_ddp_fault, steps, save_every, fault, shard_cycle):
    """Three scenarios in one start-up, all with the defaults: FSDP2 with a fault, DDP healthy, DDP with the same
    fault (replay is on for replicas too: consensus alone would agree on the averaged, poisoned state)."""
    return {
        "fault": w_user_script(
            rank, world, root_fault, "fsdp", steps, save_every, fault=fault, shard_cycle=shard_cycle
        ),
        "healthy": w_user_script(rank, world, root_healthy, "ddp", steps, save_every),
        "ddp_fault": w_user_script(rank, world, root_ddp_fault, "ddp", steps, save_every, fault=fault),
    }
