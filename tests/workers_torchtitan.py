"""Rank functions for tests/test_integration_torchtitan.py: TorchTitan's own optimizer container, LR schedulers and
checkpoint manager (subclassed by ScoutCheckpointManager) on a small replicated model, on real gloo ranks."""

import hashlib
import os
import signal

import torch
import torch.nn as nn


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


def build(root: str, keep: int = 0, kill: tuple | None = None, async_mode: str = "disabled"):
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    from scout_ckpt.integrations.torchtitan import ScoutCheckpointManager

    class Killing(ScoutCheckpointManager):
        """SIGKILLs rank kill[0] in the middle of the save of step kill[1]: DCP wrote step-N, nothing certified."""

        @__import__("dataclasses").dataclass(kw_only=True, slots=True)
        class Config(ScoutCheckpointManager.Config):
            pass

        def _commit(self, step, *a):
            if kill and self.rank == kill[0] and step == kill[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            return super()._commit(step, *a)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = default_adamw(lr=1e-2).build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=20)
    ts = TrainState()
    cls = Killing if kill else ScoutCheckpointManager
    mgr = cls.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=keep,
                     async_mode=async_mode).build(
        dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched, states={"train_state": ts},
        sd_adapter=None, base_folder=root)
    return model, opt, sched, ts, mgr


def fingerprint(model, opt) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for s in opt.optimizers[0].state.values():
        for k in sorted(s):
            h.update(s[k].detach().numpy().tobytes())
    return h.hexdigest()


def train(rank, world, root, steps, keep=0, kill=None, async_mode="disabled"):
    """Fresh or resumed (load(step=-1)) run up to `steps`, saving every step; returns what it saw."""
    model, opt, sched, ts, mgr = build(root, keep, kill, async_mode)
    loaded = mgr.load(step=-1)
    start = ts.step
    out = {"loaded": loaded, "start": start, "fingerprints": {}, "verdicts": {}}
    if loaded:
        out["fingerprints"][start] = fingerprint(model, opt)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 8, generator=g) for _ in range(steps)]  # the same batches on every rank
    for step in range(start + 1, steps + 1):
        loss = model(data[step - 1]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ts.step = step
        mgr.save(step)
        out["fingerprints"][step] = fingerprint(model, opt)
        out["verdicts"][step] = dict(mgr.last_verdict or {})  # async: the previous step's, committed by now
    mgr.close()
    out["final"] = dict(mgr.last_verdict or {})
    return out
