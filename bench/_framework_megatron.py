"""bench/framework_save.py's Megatron-Core job (torchrun, 2 CPU/gloo ranks, TP=1 DP=2): a GPTModel and a torch
AdamW over its parameters, saved as Megatron-LM saves them, a sharded state dict of the model's
`sharded_state_dict()` and the optimizer's state made sharded with megatron-core's own
`optim_state_to_sharding_state` (as its FP32 optimizer does), into `iter_NNNNNNN`: once with
`dist_checkpointing.save` plus the tracker Megatron-LM writes after it, once with the drop-in
`MegatronCheckpointer(save_dir).save(iteration, sd)` (defaults), the same state, the order alternating. tiny:
tests/scripts/mg_job.py's GPTModel (2 layers, hidden 16); large: 4 layers, hidden 512.

On CPU a GPTModel's forward needs CUDA (its RNG tracker), so each step sets seeded gradients and steps the optimizer,
as tests/scripts/mg_job.py updates its parameters without a forward; and megatron-core 0.16.1's torch_dist writer
calls CUDA unconditionally: the two functions below are stubbed, here at import, because its writer starts a
spawn-context process that re-imports this script (hence also the `__main__` guard).
"""

from __future__ import annotations

import os
from itertools import chain

import torch
import torch.distributed as dist

torch.cuda.synchronize = lambda *a, **k: None  # the CPU shim (see the module docstring)
torch.cuda.current_device = lambda: "cpu"

import _framework_common as fc  # noqa: E402
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.optimizer import (  # noqa: E402
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)

from scout_ckpt.integrations.megatron import MegatronCheckpointer  # noqa: E402


def gpt(layers: int, hidden: int, heads: int, vocab: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, use_cpu_initialization=True
    )
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=32
    )


def run_size(args, size: str, root: str) -> dict | None:
    rank = dist.get_rank()
    model = gpt(2, 16, 2, 64) if size == "tiny" else gpt(args.layers, args.width, 4, fc.VOCAB)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    scout_dir, plain_dir = os.path.join(root, "scout"), os.path.join(root, "megatron")
    ckpt = MegatronCheckpointer(scout_dir)  # scout-ckpt: the drop-in, defaults
    it = 0
    sizes: dict[str, int] = {}

    def train(n: int) -> None:
        nonlocal it
        for _ in range(n):
            it += 1
            g = torch.Generator().manual_seed(it)  # the same gradients on the data-parallel replicas
            for p in params:
                p.grad = torch.randn(p.shape, generator=g) * 1e-3
            opt.step()
            opt.zero_grad()

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
    fc.run_sizes(args, run_size)


if __name__ == "__main__":
    main()
