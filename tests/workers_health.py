"""Rank workers for health evidence end to end: a user-shaped DDP or FSDP2 job with the library defaults, its
observers watching a fake NVML source on one rank that reports an uncorrectable ECC error between two saves.

The fault is timed by the job itself (a trigger file written after a save), and the job waits until the observer's
event is in the ledger before it trains on, so the event lies between the two saves on every run, however loaded
the machine is."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

FAULTY = 1
SOURCE = "tests.fake_health:FakeEccWhenFileAppears"


def _model(mode: str, world: int):
    """The TorchTitan-shaped test model: DDP-wrapped, or FSDP2 per block and at the root (`hsdp`: on a 2-D
    (replicate, shard) mesh of world // 2 x 2)."""
    from tests import workers_replay_targets as wt

    model = wt.build("titan")
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mode == "hsdp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _wait_for_event(ckpt, timeout_s: float = 90.0) -> list[dict]:
    """Coordinator: until the observer's health event is in the ledger (then every rank trains on)."""
    events: list[dict] = []
    if ckpt.is_coordinator:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            events = [e for e in ckpt.ledger.events(kinds=("health",)) if e.get("run_id") == ckpt.run_id]
            if events:
                break
            time.sleep(0.1)
    box = [events]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def w_ecc_between_saves(rank, world, root, mode, steps=9, save_every=3, fault_after=3):
    """Train `steps` steps, save every `save_every` with the defaults (observer on); after the save at
    `fault_after`, rank FAULTY's GPU reports an uncorrectable ECC error. Returns each save's verdict and, from the
    coordinator, the ledger's health events and final states. The one option set: FSDP's shard evidence cycle
    fits the save interval (as the demo does), so that the first save is certifiable at all."""
    from scout_ckpt import Checkpointer, ModelOptimizerState, ObserverOptions, ShardEvidenceOptions
    from scout_ckpt.errors import LiveStateCorrupt
    from tests import workers_replay_targets as wt

    trigger = os.path.join(root + "-trigger", "ecc")
    os.makedirs(os.path.dirname(trigger), exist_ok=True)
    model = _model(mode, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    health = {"factory": SOURCE, "kwargs": {"path": trigger}} if rank == FAULTY else None
    ckpt = Checkpointer(
        root,
        model=model,
        optimizer=opt,
        shard_evidence=ShardEvidenceOptions(cycle=save_every - 1) if mode == "fsdp" else True,
        observer=ObserverOptions(stall_s=120.0, health_source=health, health_poll_s=0.1),
    )
    state = {"app": ModelOptimizerState(model, opt)}
    start = ckpt.load_latest_clean(state) or 0
    verdicts, events = {}, []
    for step in range(start + 1, steps + 1):
        wt.train_step(model, opt, step, rank)
        ckpt.step(step)
        if step % save_every == 0:
            try:
                v = ckpt.save(step, state)
            except LiveStateCorrupt as e:  # the default: a save showing the live state bad ends the generation
                verdicts[step] = {"state": e.verdict["state"], "reasons": e.verdict["reasons"], "raised": True}
                break
            verdicts[step] = {"state": v["state"], "reasons": v["reasons"]}
            if step == fault_after:
                if rank == FAULTY:
                    open(trigger, "w").close()
                events = _wait_for_event(ckpt)
    out = {
        "verdicts": verdicts,
        "events": events,
        "mode": ckpt.mode,
        "replay": ckpt.replay is not None,
        "policy": ckpt.policy,
    }
    ckpt.close()
    dist.barrier()
    return out
