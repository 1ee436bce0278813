"""A user's Lightning job under torchrun (CPU/gloo ranks, as many as torchrun starts), for
tests/test_integration_lightning.py: a small regression LightningModule (Adam, a per-step LambdaLR, gradient
accumulation), a shuffled DataLoader (Lightning's DistributedSampler), ModelCheckpoint(every_n_train_steps,
save_top_k on the synced train loss, save_last).

Its own oracle, computed without scout-ckpt: rank 0 appends JSON lines to --record: per optimizer step
{"step", "loss", "lr", "batch", "attempt"} (the loss is the all-reduced one, `batch` a fingerprint of the samples
each rank trained on), at each save {"saved": step, "digest"} (sha256 of the model and optimizer state in memory),
when a resumed run starts training {"started": step, "digest"} (the same sha256 of what it restored), at the end
{"final": digest, "global_step"}, and {"scout_steps": [...]} (the steps Checkpointer.step saw).

--scout ddp|mp|none: ScoutDDPStrategy, ScoutModelParallelStrategy (fully_shard in configure_model, FSDP2), plain
DDPStrategy with Lightning's own ModelCheckpoint (the run without scout-ckpt), mp-none the same for
ModelParallelStrategy. --kill-step S: in the first attempt (TORCHELASTIC_RESTART_COUNT 0) rank 1 SIGKILLs itself
after optimizer step S. Observer faults, first attempt only, before a step's forward (the faulty rank writes
ROOT/fault.json {"kind", "rank", "step", "time"} when it strikes): --hang-rank/--hang-step (blocks forever),
--crash-rank/--crash-step (SIGKILL), --desync-rank/--desync-step (an all_reduce only this rank issues),
--slow-rank/--slow-s (sleeps that long before every step's forward). --ckpt-path: fit(ckpt_path=...). The world size is torchrun's (`devices` =
LOCAL_WORLD_SIZE, FSDP2's data_parallel_size = WORLD_SIZE); --samples defaults to 16 per rank, so that every world
size has 4 batches of 4 per rank per epoch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def tensor_bytes(v) -> bytes:
    if hasattr(v, "full_tensor"):  # an FSDP2 DTensor shard: the whole tensor (collective)
        v = v.full_tensor()
    return v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def digest(module: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 over the model's and the optimizer's tensors (and scalars), in name order; every rank calls it."""
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode())
        h.update(tensor_bytes(v))
    names = {id(p): n for n, p in module.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in sorted(opt.state.get(p, {}).items()):
                h.update(f"{names[id(p)]}.{k}".encode())
                h.update(tensor_bytes(v) if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()


class Record:
    def __init__(self, path: str | None):
        self.path = path

    def __call__(self, **row) -> None:
        if self.path and RANK == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps({**row, "attempt": ATTEMPT}) + "\n")


class Regression(pl.LightningModule):
    def __init__(self, record: Record, kill_step: int | None, fsdp2: bool, sched: bool = True, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters("lr")
        self.record, self.kill_step, self.fsdp2, self.sched = record, kill_step, fsdp2, sched
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self._loss_sum, self._fp, self._last_step = 0.0, 0, 0

    def configure_model(self):
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def on_train_batch_start(self, batch, batch_idx):
        step = self.trainer.global_step + 1  # the optimizer step this batch is for (accumulation aside)
        f = getattr(self, "faults", None)
        if f is None or ATTEMPT != 0:
            return
        if (RANK, step) == f["hang"]:
            mark(f["root"], "hang", step)
            threading.Event().wait()
        if (RANK, step) == f["crash"]:
            mark(f["root"], "crash", step)
            os.kill(os.getpid(), signal.SIGKILL)
        if (RANK, step) == f["desync"]:
            mark(f["root"], "desync", step)
            dist.all_reduce(torch.ones(3))  # a rank-dependent branch: the others never issue it
        if RANK == f["slow"][0]:
            if not Path(f["root"], "fault.json").exists():
                mark(f["root"], "slow", step)
            time.sleep(f["slow"][1])

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        self._loss_sum += float(loss.detach())
        self._fp = (self._fp * 1000003 + int(idx.sum())) % (1 << 61)
        return loss

    def on_train_start(self):
        self._last_step = self.trainer.global_step  # a resumed run starts counting after the loaded step
        if self._last_step:  # what a resumed run trains on: every restore (model, optimizers) is done by now
            self.record(started=self._last_step, digest=digest(self.net, self.trainer.optimizers[0]))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # once per real optimizer step: the batch whose end follows it (gradient accumulation included)
        step = self.trainer.global_step
        if step == self._last_step:
            return
        self._last_step = step
        t = torch.tensor([self._loss_sum, float(self._fp)], dtype=torch.float64)
        dist.all_reduce(t)
        self.record(step=step, loss=t[0].item(), batch=t[1].item(), lr=self.trainer.optimizers[0].param_groups[0]["lr"])
        self._loss_sum, self._fp = 0.0, 0
        if self.kill_step is not None and ATTEMPT == 0 and RANK == 1 and step == self.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_save_checkpoint(self, checkpoint):
        # a user's extra in the dump: must come back through the certified remainder
        checkpoint["user_extra"] = {"saved_at": self.trainer.global_step}
        d = digest(self.net, self.trainer.optimizers[0])
        self.record(saved=self.trainer.global_step, digest=d)

    def on_load_checkpoint(self, checkpoint):
        assert checkpoint["user_extra"]["saved_at"] == checkpoint["global_step"], checkpoint.get("user_extra")
        self.record(loaded=checkpoint["global_step"])

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.net.parameters(), lr=self.hparams.lr)
        if not self.sched:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def mark(root, kind: str, step: int) -> None:
    Path(root, "fault.json").write_text(json.dumps({"kind": kind, "rank": RANK, "step": step, "time": time.time()}))


class StepsSeen(Callback):
    """The steps the strategy's Checkpointer.step hook saw (the per-step hook's cadence)."""

    def on_train_end(self, trainer, pl_module):
        seen = getattr(trainer.strategy, "scout_steps", None)
        if seen is not None:
            pl_module.record(scout_steps=seen)
        scout = getattr(trainer.strategy, "scout", None)
        if scout is not None:  # what the observer watches: "counted" is DDP's wrapper, "fsdp2" FSDP2's groups
            pl_module.record(observer_attached=scout.observer.attached if scout.observer is not None else None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--scout", choices=("ddp", "mp", "none", "mp-none"), default="ddp")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--save-last", action="store_true")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--samples", type=int, default=16 * WORLD)
    ap.add_argument("--kill-step", type=int)
    ap.add_argument("--ckpt-path")
    ap.add_argument("--record")
    ap.add_argument("--clip", type=float, help="gradient_clip_val")
    ap.add_argument("--no-sched", action="store_true", help="a constant learning rate")
    for kind in ("hang", "crash", "desync"):
        ap.add_argument(f"--{kind}-rank", type=int)
        ap.add_argument(f"--{kind}-step", type=int)
    ap.add_argument("--slow-rank", type=int)
    ap.add_argument("--slow-s", type=float, default=0.1)
    ap.add_argument("--options", default="{}", help="JSON: the strategy's Checkpointer options")
    ap.add_argument(
        "--kill-in-save",
        type=int,
        help="in the first attempt, rank 1 SIGKILLs itself in the middle "
        "of writing this step's checkpoint (the Checkpointer's during_write point)",
    )
    a = ap.parse_args()

    pl.seed_everything(1234, verbose=False)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(a.samples, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    data = DataLoader(TensorDataset(x, y, torch.arange(a.samples)), batch_size=4, shuffle=True)
    record = Record(a.record)
    model = Regression(record, a.kill_step, fsdp2=a.scout.startswith("mp"), sched=not a.no_sched)
    model.faults = {
        "root": a.root,
        "hang": (a.hang_rank, a.hang_step),
        "crash": (a.crash_rank, a.crash_step),
        "desync": (a.desync_rank, a.desync_step),
        "slow": (a.slow_rank, a.slow_s),
    }
    opts = json.loads(a.options)
    hook = None
    if a.kill_in_save is not None:

        def die_mid_write(point, step, _at=a.kill_in_save):
            if point == "during_write" and step == _at and ATTEMPT == 0 and RANK == 1:
                os.kill(os.getpid(), signal.SIGKILL)

        hook = die_mid_write

    root = Path(a.root)
    from scout_ckpt.testing.faults import fault_points

    with fault_points(hook):  # the strategy keeps the hook for the Checkpointer it makes at setup
        if a.scout == "ddp":
            from scout_ckpt.integrations.lightning import ScoutDDPStrategy

            strategy = ScoutDDPStrategy(root=root, process_group_backend="gloo", checkpointer=opts)
        elif a.scout == "mp":
            from scout_ckpt.integrations.lightning import ScoutModelParallelStrategy

            strategy = ScoutModelParallelStrategy(
                root=root,
                data_parallel_size=WORLD,
                tensor_parallel_size=1,
                process_group_backend="gloo",
                checkpointer=opts,
            )
        elif a.scout == "mp-none":
            from lightning.pytorch.strategies import ModelParallelStrategy

            strategy = ModelParallelStrategy(
                data_parallel_size=WORLD, tensor_parallel_size=1, process_group_backend="gloo"
            )
        else:
            strategy = DDPStrategy(process_group_backend="gloo")
    ckpt_cb = ModelCheckpoint(
        dirpath=root / "lightning",
        every_n_train_steps=a.save_every,
        save_top_k=a.top_k,
        monitor="train_loss" if a.top_k > 0 else None,
        save_last=a.save_last or None,
        filename="{step}",
    )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        max_steps=a.steps,
        accumulate_grad_batches=a.accum,
        gradient_clip_val=a.clip,
        callbacks=[ckpt_cb, StepsSeen()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
        log_every_n_steps=1,
        deterministic=True,
    )
    trainer.fit(model, train_dataloaders=data, ckpt_path=a.ckpt_path)
    d = digest(model.net, trainer.optimizers[0])
    record(final=d, global_step=trainer.global_step)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
