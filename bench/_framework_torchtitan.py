"""bench/framework_save.py's TorchTitan job (torchrun, 2 CPU/gloo ranks): TorchTitan's pure-FSDP layout (its
ParallelDims with dp_shard 2, `fully_shard` per block and at the root), its AdamW container (implementation
"foreach", as docs/integrations/torchtitan.md advises) and LR schedulers, and two checkpoint managers over the same
model, optimizer and schedulers: TorchTitan's own DCP `CheckpointManager` and the drop-in `ScoutCheckpointManager`
(defaults), each `Config(enable=True, interval=--steps-per-save, keep_latest_k=0)`. As TorchTitan's Trainer does,
`save(step)` is called after every optimizer step (the manager saves on its interval); at the interval both save
the same state, the order alternating. tiny: the transformer LM at width 32, 2 blocks; large: at
--sharded-width/--sharded-layers. TorchTitan's Trainer needs a GPU; its checkpoint manager runs alone on CPU.
"""

from __future__ import annotations

import os

import _framework_common as fc
import torch
import torch.distributed as dist


class TrainState:
    """Stands for TorchTitan's Trainer, which passes itself as `states["train_state"]` and holds `parallel_dims`."""

    def __init__(self, parallel_dims):
        self.step = 0
        self.parallel_dims = parallel_dims

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


def parallel_dims(world: int):
    """TorchTitan's ParallelDims on CPU (dp_shard = world). Its device type falls back to "cuda" (set to "cpu"), and
    it puts mesh dims of size 1 on torch's "fake" backend (registered by importing fake_pg; nothing runs on it)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    import torchtitan.distributed.parallel_dims as pdm

    pdm.device_type = "cpu"
    pd = pdm.ParallelDims(
        dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, world_size=world, spmd_backend="partial_dtensor"
    )
    pd.build_mesh()
    return pd


def run_size(args, size: str, root: str, pd) -> dict | None:
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    from scout_ckpt.integrations.torchtitan import ScoutCheckpointManager

    rank = dist.get_rank()
    model = fc.transformer(32, 2) if size == "tiny" else fc.transformer(args.sharded_width, args.sharded_layers)
    mesh = pd.get_mesh("fsdp")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    cfg = default_adamw(lr=1e-3)
    cfg.implementation = "foreach"
    opt = cfg.build(model_parts=[model])
    total = fc.rounds(args, size) * args.steps_per_save
    sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=total)
    ts = TrainState(pd)
    every = args.steps_per_save
    common = dict(dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched, sd_adapter=None)
    plain = CheckpointManager.Config(enable=True, folder="titan", interval=every, keep_latest_k=0).build(
        states={"train_state": ts}, base_folder=root, **common
    )
    scout = ScoutCheckpointManager.Config(enable=True, folder="ckpt", interval=every, keep_latest_k=0).build(
        states={"train_state": ts}, base_folder=root, **common
    )  # scout-ckpt: the drop-in, defaults
    sizes: dict[str, int] = {}

    def train(n: int) -> None:
        for _ in range(n):
            ts.step += 1
            loss = fc.lm_loss(model, ts.step, rank)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            if ts.step % every:
                scout.save(ts.step)  # the Trainer calls it every step: the drop-in's per-step checks
                plain.save(ts.step)

    def scout_save(i: int) -> dict:
        scout.save(ts.step)
        return dict(scout.last_verdict or {})

    def after_framework(i: int) -> None:
        if rank == 0:
            d = os.path.join(root, "titan", f"step-{ts.step}")
            sizes["framework"] = fc.du(d)

    contest = fc.Contest(
        lambda i: plain.save(ts.step),
        scout_save,
        warmup=args.warmup,
        after_framework=after_framework,
        profile=args.profile and os.path.join(args.profile, f"torchtitan-{size}"),
    )
    for i in range(fc.rounds(args, size)):
        train(every)
        contest.round(i)
    held = fc.local_bytes(
        [*model.parameters(), *(t for o in opt.optimizers for st in o.state.values() for t in st.values())]
    )
    sizes["scout"] = fc.du(os.path.join(root, "ckpt", f"step-{ts.step}")) if rank == 0 else 0
    out = contest.result(held, sizes, layout="fsdp2 dp_shard 2")
    scout.close()
    plain.close()
    return out


def main() -> None:
    args = fc.options(__doc__.splitlines()[0])
    dist.init_process_group("gloo")
    pd = parallel_dims(dist.get_world_size())
    fc.run_sizes(args, run_size, pd)


if __name__ == "__main__":
    main()
