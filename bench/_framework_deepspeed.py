"""bench/framework_save.py's DeepSpeed job (torchrun, 2 CPU/gloo ranks): a DeepSpeed training loop (ZeRO-1, AdamW,
WarmupLR, gradient clipping) whose saves are `engine.save_checkpoint(save_dir)`, once with DeepSpeed's own
checkpoint engine and once through scout-ckpt's drop-in (`install(engine, save_dir)`, defaults), the same engine and
state, the order alternating. tiny: tests/scripts/ds_job.py's MLP (16-32-8); large: the transformer LM at
--width/--layers. DeepSpeed's own save goes through the engine's class method with its TorchCheckpointEngine put
back for the call (what `engine.save_checkpoint` is without the drop-in), into another directory.
"""

from __future__ import annotations

import os

import _framework_common as fc
import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist

# DeepSpeed JIT-compiles its shm comm op with g++ at the first start on CPU; gloo does the same work (docs/integrations)
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

from scout_ckpt.integrations.deepspeed import install  # noqa: E402

STAGE = 1


def run_size(args, size: str, root: str) -> dict | None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    if size == "tiny":
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    else:
        model = fc.transformer(args.width, args.layers)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "zero_optimization": {"stage": STAGE},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    own = type(engine).save_checkpoint  # DeepSpeed's save_checkpoint, as it is without the drop-in
    scout_dir, plain_dir = os.path.join(root, "scout"), os.path.join(root, "deepspeed")
    scout = install(engine, scout_dir)  # scout-ckpt: the drop-in, defaults
    sizes: dict[str, int] = {}

    def train(n: int) -> None:
        for _ in range(n):
            step = engine.global_steps + 1
            if size == "tiny":
                x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
                loss = engine(x).pow(2).mean()
            else:
                loss = fc.lm_loss(engine, step, rank)
            engine.backward(loss)
            engine.step()

    def framework(i: int) -> None:
        swapped, engine.checkpoint_engine = engine.checkpoint_engine, scout.inner
        try:
            own(engine, plain_dir)
        finally:
            engine.checkpoint_engine = swapped

    def scout_save(i: int) -> dict | None:
        engine.save_checkpoint(scout_dir)  # scout-ckpt: unchanged call, certified by the drop-in
        return scout.last_verdict

    def after_framework(i: int) -> None:
        if rank == 0:
            tag = os.path.join(plain_dir, f"global_step{engine.global_steps}")
            sizes["framework"] = fc.du(tag)

    contest = fc.Contest(
        framework,
        scout_save,
        warmup=args.warmup,
        after_framework=after_framework,
        profile=args.profile and os.path.join(args.profile, f"deepspeed-{size}"),
    )
    for i in range(fc.rounds(args, size)):
        train(args.steps_per_save)
        contest.round(i)
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    held = fc.local_bytes(
        [
            *engine.module.parameters(),
            *(p for g in base.param_groups for p in g["params"]),
            *(t for st in base.state.values() for t in st.values()),
        ]
    )
    sizes["scout"] = fc.du(os.path.join(scout_dir, f"global_step{engine.global_steps}")) if rank == 0 else 0
    out = contest.result(held, sizes, zero_stage=STAGE)
    scout.close()
    return out


def main() -> None:
    args = fc.options(__doc__.splitlines()[0])
    deepspeed.init_distributed(dist_backend="gloo")
    fc.run_sizes(args, run_size)


if __name__ == "__main__":
    main()
