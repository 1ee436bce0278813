"""bench/framework_save.py's Megatron-Core job (torchrun, 2 CPU/gloo ranks, TP=1 DP=2): a GPTModel wrapped in
Megatron's DistributedDataParallel, trained on seeded next-token batches by a torch AdamW stepping the reduced
`main_grad` (as Megatron's FP32Optimizer does; tests/scripts/mg_train_job.py), saved as Megatron-LM saves it, a
sharded state dict of the model's `sharded_state_dict()` and the optimizer's state made sharded with megatron-core's
own `optim_state_to_sharding_state` (as its FP32 optimizer does), into `iter_NNNNNNN`: once with
`dist_checkpointing.save` plus the tracker Megatron-LM writes after it, once with the drop-in
`MegatronCheckpointer(save_dir, model=[model]).save(iteration, sd)` as docs/integrations/megatron.md gives it
(defaults: SDC replay on at DP >= 2, `ckpt.step(iteration, loss)` after each optimizer step), the same state, the
order alternating. tiny: tests/scripts/mg_job.py's GPTModel (2 layers, hidden 16); large: --layers layers, hidden
--width.

CPU shims (megatron-core 0.16.1 on a CPU-only torch; docs/integrations/megatron.md, "On CPU"): its torch_dist
writer calls torch.cuda.synchronize/current_device, and its RNG tracker forks the CUDA RNG state around attention
(mapped onto the CPU generator; no dropout, so no random number is drawn). They are set here at import, because the
writer starts a spawn-context process that re-imports this script (hence also the `__main__` guard).
"""

from __future__ import annotations

import os
from itertools import chain

import torch
import torch.distributed as dist

torch.cuda.synchronize = lambda *a, **k: None  # the CPU shims (see the module docstring)
torch.cuda.current_device = lambda: "cpu"
torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
torch.cuda.manual_seed = lambda seed: None
import megatron.core.tensor_parallel.random as mg_random  # noqa: E402

mg_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
mg_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()

import _framework_common as fc  # noqa: E402
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.optimizer import (  # noqa: E402
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)

from scout_ckpt.integrations.megatron import MegatronCheckpointer  # noqa: E402

SEQ, BATCH = 16, 4


def gpt(layers: int, hidden: int, heads: int, vocab: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_dtype=torch.float32,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=32
    )
    return config, model


def run_size(args, size: str, root: str) -> dict | None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    rank = dist.get_rank()
    vocab = 64 if size == "tiny" else fc.VOCAB
    config, model = gpt(2, 16, 2, vocab) if size == "tiny" else gpt(args.layers, args.width, 4, vocab)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    scout_dir, plain_dir = os.path.join(root, "scout"), os.path.join(root, "megatron")
    ckpt = MegatronCheckpointer(scout_dir, model=[ddp])  # scout-ckpt: the drop-in, defaults
    it = 0
    sizes: dict[str, int] = {}
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)

    def train(n: int) -> None:
        nonlocal it
        for _ in range(n):
            it += 1
            tokens = torch.randint(
                0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 * it + rank)
            )
            ddp.zero_grad_buffer()
            opt.zero_grad()
            loss = ddp(tokens[:, :-1], pos, mask, labels=tokens[:, 1:]).float().mean()
            loss.backward()
            ddp.finish_grad_sync()
            for p in params:
                p.grad = p.main_grad
            opt.step()
            ckpt.step(it, loss.item())  # scout-ckpt: after each optimizer step

    def sharded() -> dict:
        """What Megatron-LM's save_checkpoint builds: the model's and the optimizer's sharded state, the iteration."""
        model_sd = model.sharded_state_dict(prefix="")
        optim_sd = opt.state_dict()
        step = next(iter(optim_sd["state"].values()))["step"]
        id_map = get_param_id_to_sharded_param_map(model_sd, chain.from_iterable(g["params"] for g in opt.param_groups))
        optim_state_to_sharding_state(optim_sd, id_map, exclude_keys=("step",))
        optim_sd["state"]["common_step"] = step
        return {"model": model_sd, "optimizer": optim_sd, "iteration": it}

    def framework(i: int) -> None:
        iter_dir = os.path.join(plain_dir, f"iter_{it:07d}")
        if rank == 0:
            os.makedirs(iter_dir, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(sharded(), iter_dir)
        if rank == 0:  # Megatron-LM's tracker, after the save (training/checkpointing.py)
            with open(os.path.join(plain_dir, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(it))
        dist.barrier()

    def scout_save(i: int) -> dict:
        return ckpt.save(it, sharded())  # scout-ckpt: was dist_checkpointing.save(sd, iter_dir)

    def after_framework(i: int) -> None:
        if rank == 0:
            iter_dir = os.path.join(plain_dir, f"iter_{it:07d}")
            sizes["framework"] = fc.du(iter_dir)

    contest = fc.Contest(
        framework,
        scout_save,
        warmup=args.warmup,
        after_framework=after_framework,
        profile=args.profile and os.path.join(args.profile, f"megatron-{size}"),
    )
    for i in range(fc.rounds(args, size)):
        train(args.steps_per_save)
        contest.round(i)
    held = fc.local_bytes([*params, *(t for st in opt.state.values() for t in st.values())])
    sizes["scout"] = fc.du(os.path.join(scout_dir, f"iter_{it:07d}")) if rank == 0 else 0
    out = contest.result(held, sizes, tp=1, dp=dist.get_world_size())
    ckpt.close()
    return out


def main() -> None:
    args = fc.options(__doc__.splitlines()[0])
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    mg_random.model_parallel_cuda_manual_seed(1234)
    fc.run_sizes(args, run_size)


if __name__ == "__main__":
    main()
