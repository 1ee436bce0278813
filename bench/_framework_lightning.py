"""bench/framework_save.py's Lightning job (torchrun, 2 CPU/gloo ranks): a LightningModule with Adam trained by
`Trainer(strategy=ScoutDDPStrategy(root=...), accelerator="cpu", devices=2)` (the drop-in, defaults), where a
callback saves every --steps-per-save optimizer steps, as ModelCheckpoint does: `trainer.save_checkpoint(path)`
(certified by the strategy) and Lightning's own save of the same state, the order alternating. Lightning's own save
is what `trainer.save_checkpoint` does under the plain `DDPStrategy`: the same dump, `DDPStrategy.save_checkpoint`
(rank 0 `torch.save`s the dump through its CheckpointIO), then the barrier. tiny: tests/scripts/lightning_job.py's
regression net (8-32-1); large: the transformer LM at --width/--layers.
"""

from __future__ import annotations

import os

import _framework_common as fc
import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from scout_ckpt.integrations.lightning import ScoutDDPStrategy


class Net(pl.LightningModule):
    def __init__(self, size: str, width: int, layers: int):
        super().__init__()
        self.size = size
        if size == "tiny":
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        else:
            self.net = fc.transformer(width, layers)

    def training_step(self, batch, batch_idx):
        if self.size == "tiny":
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)
        (tokens,) = batch
        logits = self.net(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Saves(pl.Callback):
    """Every `every` optimizer steps, one round of the contest (ModelCheckpoint's hook, on every rank)."""

    def __init__(self, args, size: str, root: str):
        self.args, self.size, self.root = args, size, root
        self.contest: fc.Contest | None = None
        self.sizes: dict[str, int] = {}
        self.result: dict | None = None

    def on_train_start(self, trainer, pl_module):
        def framework(i: int) -> None:
            path = os.path.join(self.root, "lightning", f"step={trainer.global_step}.ckpt")
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(False)  # trainer.save_checkpoint's own
            DDPStrategy.save_checkpoint(trainer.strategy, checkpoint, path)
            trainer.strategy.barrier("Trainer.save_checkpoint")

        def scout(i: int) -> dict | None:
            trainer.save_checkpoint(os.path.join(self.root, "pointers", f"step={trainer.global_step}.ckpt"))
            return trainer.strategy.scout.last_verdict

        def after_framework(i: int) -> None:
            if trainer.global_rank == 0:
                path = os.path.join(self.root, "lightning", f"step={trainer.global_step}.ckpt")
                self.sizes["framework"] = os.path.getsize(path)

        self.contest = fc.Contest(
            framework,
            scout,
            warmup=self.args.warmup,
            after_framework=after_framework,
            profile=self.args.profile and os.path.join(self.args.profile, f"lightning-{self.size}"),
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step and step % self.args.steps_per_save == 0 and self.contest is not None:
            self.contest.round(step // self.args.steps_per_save - 1)

    def on_train_end(self, trainer, pl_module):
        assert self.contest is not None
        opt = trainer.optimizers[0]
        held = fc.local_bytes([*pl_module.parameters(), *(t for st in opt.state.values() for t in st.values())])
        if trainer.global_rank == 0:
            step_dir = os.path.join(self.root, "scout", f"step-{trainer.global_step:08d}")
            self.sizes["scout"] = fc.du(step_dir)
        self.result = self.contest.result(held, self.sizes, strategy="ddp")


def run_size(args, size: str, root: str) -> dict | None:
    pl.seed_everything(1234, verbose=False)
    total = fc.rounds(args, size) * args.steps_per_save
    g = torch.Generator().manual_seed(7)
    n = 4 * 2 * total  # batches of 4 per rank, one epoch
    if size == "tiny":
        x = torch.randn(n, 8, generator=g)
        data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    else:
        data = TensorDataset(torch.randint(0, fc.VOCAB, (n, 33), generator=g))
    saves = Saves(args, size, root)
    trainer = pl.Trainer(
        strategy=ScoutDDPStrategy(root=os.path.join(root, "scout"), process_group_backend="gloo"),  # scout-ckpt
        accelerator="cpu",
        devices=2,
        max_steps=total,
        callbacks=[saves],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(Net(size, args.width, args.layers), DataLoader(data, batch_size=4, shuffle=True))
    return saves.result


def main() -> None:
    args = fc.options(__doc__.splitlines()[0])
    fc.run_sizes(args, run_size)


if __name__ == "__main__":
    main()
