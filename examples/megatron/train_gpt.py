"""A tiny Megatron-Core GPTModel trained on a GPU with certified `dist_checkpointing` saves (scout-ckpt's
Megatron-Core integration): the prepared script for a machine with CUDA. The lines marked "scout-ckpt" are all a
user adds; the rest is plain megatron-core (parallel_state, GPTModel, a torch optimizer, dist_checkpointing).

    torchrun --nproc-per-node 2 examples/megatron/train_gpt.py /tmp/mg-gpt --tp 2 --iters 20 --save-every 5
    torchrun --nproc-per-node 2 examples/megatron/train_gpt.py /tmp/mg-gpt --tp 2 --iters 30 --save-every 5  # resumes

Each rank prints, when it saves and after it loads, sha256 of its model tensors (the checkpoint holds the model
and the iteration; a real job adds the optimizer's sharded_state_dict), so a resume can be
checked against the save without scout-ckpt. Needs CUDA and NCCL: GPTModel's forward uses the CUDA RNG tracker
(`model_parallel_cuda_manual_seed`), which has no CPU path in megatron-core 0.16.1; without CUDA the script says so
and exits 2. On CPU, tests/test_integration_megatron.py saves a GPTModel's sharded_state_dict (no forward).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch
import torch.distributed as dist


def state_digest(model) -> str:
    """sha256 of this rank's model tensors (the optimizer is not in this example's checkpoint)."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        if isinstance(v, torch.Tensor):
            h.update(k.encode())
            h.update(v.detach().float().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("save_dir")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--async-save", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("train_gpt.py needs CUDA: GPTModel's forward uses megatron-core's CUDA RNG tracker", file=sys.stderr)
        return 2

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from scout_ckpt.integrations.megatron import MegatronCheckpointer  # scout-ckpt

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    model_parallel_cuda_manual_seed(0)
    rank = dist.get_rank()
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True, pipeline_dtype=torch.float32
    )
    vocab, seq = 128, 32
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=seq
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def sharded(iteration):
        return {"model": model.sharded_state_dict(prefix=""), "iteration": iteration}

    ckpt = MegatronCheckpointer(args.save_dir, model=model)  # scout-ckpt: TP shards are single-owner: committed,
    # MegatronCheckpointer(args.save_dir, accept_single_owner=True) certifies them on bytes + finite checks
    it = 0
    found = ckpt.load_latest_clean(sharded(0))  # scout-ckpt
    if found is not None:
        it, loaded = found
        model.load_state_dict(loaded["model"], strict=False)
        print(f"rank {rank} resumed iteration {it} model digest {state_digest(model)}", flush=True)

    queue = None
    if args.async_save:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        queue = AsyncCallsQueue()
    g = torch.Generator(device="cuda").manual_seed(1234)
    while it < args.iters:
        it += 1
        tokens = torch.randint(0, vocab, (4, seq), device="cuda", generator=g)
        position_ids = torch.arange(seq, device="cuda").unsqueeze(0).expand(4, -1)
        mask = torch.tril(torch.ones(seq, seq, device="cuda")).view(1, 1, seq, seq) < 0.5
        loss = model(tokens, position_ids, mask, labels=torch.roll(tokens, -1, dims=1)).float().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step(it, loss.item())  # scout-ckpt: replay's rotation (on at TP = 1 with 2+ ranks)
        if it % args.save_every == 0:
            if queue is not None:
                queue.schedule_async_request(ckpt.save(it, sharded(it), async_save=True))  # scout-ckpt
                queue.maybe_finalize_async_calls(blocking=False)
            else:
                ckpt.save(it, sharded(it))  # scout-ckpt: was dist_checkpointing.save(sd, iter_dir)
                print(
                    f"rank {rank} saved iteration {it} ({ckpt.last_verdict['state']}) digest "
                    f"{state_digest(model)} loss {float(loss):.6f}",
                    flush=True,
                )
    if queue is not None:
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
