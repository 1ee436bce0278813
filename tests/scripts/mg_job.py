"""A small Megatron-Core job (2 CPU/gloo ranks under torchrun) saving with `dist_checkpointing` (torch_dist) through
scout_ckpt.integrations.megatron, for tests/test_integration_megatron.py. Its own oracle: sha256 of every rank's
tensors (the ranks' digests joined in rank order), computed here without scout-ckpt and written to --events when it
saves, when it has loaded a checkpoint, and at the end; the test compares those, not scout-ckpt's verdicts.

The state is a sharded state dict as Megatron's modules build it: `w` split over tensor-parallel ranks (axis 0) and
replicated over data-parallel ranks (`replica_id` = DP rank), `b` replicated over all ranks (`replica_id` =
(0, TP rank, DP rank), as Megatron's layer norms), and `iteration` in common.pt. Each iteration applies a
deterministic update (the same on replicas). The user's lines are those marked "scout-ckpt"; the rest is plain
parallel_state + dist_checkpointing.

Test-only: the CUDA shim below (megatron-core 0.16.1 calls torch.cuda.synchronize()/current_device()
unconditionally in its torch_dist writer; see docs/pytorch-facts.md, "Megatron-Core 0.16.1"); --crash-at I makes rank 1
SIGKILL itself after its files of iteration I are written and before the finalize, on the first attempt
(TORCHELASTIC_RESTART_COUNT 0); --diverge-at I makes rank 1's copy of `b` (with --gpt: the final layer norm's weight) differ by one ulp before
that save;
--gpt makes the state a tiny GPTModel's `sharded_state_dict()` instead (built on CPU; no forward).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal

import torch
import torch.distributed as dist

torch.cuda.synchronize = lambda *a, **k: None  # test-only CUDA shim (see the module docstring)
torch.cuda.current_device = lambda: "cpu"

from megatron.core import parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402

from scout_ckpt.errors import LiveStateCorrupt  # noqa: E402
from scout_ckpt.integrations.megatron import MegatronCheckpointer  # noqa: E402  scout-ckpt


def digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, h.hexdigest())
    return ":".join(x[:16] for x in every)


def gpt_model():
    """A tiny GPTModel (local spec, no Transformer Engine) built on CPU; its sharded_state_dict is what Megatron-LM
    saves. Its forward needs CUDA (megatron-core's RNG tracker), so this job updates the parameters directly."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("save_dir")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--accept-single-owner", action="store_true")
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--crash-at", type=int, default=None)
    ap.add_argument("--diverge-at", type=int, default=None)
    ap.add_argument("--drop-in", action="store_true", help="save with the drop-in for dist_checkpointing.save")
    ap.add_argument("--gpt", action="store_true", help="the state is a tiny GPTModel's sharded_state_dict")
    ap.add_argument("--events", required=True)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    rank = dist.get_rank()
    tp, tp_rank = args.tp, parallel_state.get_tensor_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    full_w = torch.randn(8, 16)
    state = {"w": full_w.chunk(tp, dim=0)[tp_rank].clone(), "b": torch.zeros(16)}
    model = gpt_model() if args.gpt else None
    if model is not None:  # the state is the model's parameters (no forward on CPU: see the module docstring)
        state = {k: p.data for k, p in model.named_parameters()}

    def sharded():
        if model is not None:
            return {"model": model.sharded_state_dict(prefix=""), "iteration": it}
        return {
            "w": ShardedTensor.from_rank_offsets("w", state["w"], (0, tp_rank, tp), replica_id=dp_rank),
            "b": ShardedTensor.from_rank_offsets("b", state["b"], replica_id=(0, tp_rank, dp_rank)),
            "iteration": it,
        }

    def record(**row):
        if rank == 0:
            with open(args.events, "a") as f:
                f.write(json.dumps({"attempt": attempt, **row}) + "\n")

    ckpt = MegatronCheckpointer(args.save_dir, accept_single_owner=args.accept_single_owner)  # scout-ckpt
    it = 0
    found = ckpt.load_latest_clean(sharded())  # scout-ckpt: the newest certified iteration, or None
    if found is not None:
        it, loaded = found
        assert loaded["iteration"] == it
        if model is not None:
            model.load_state_dict(loaded["model"], strict=False)
        else:
            state["w"].copy_(loaded["w"])
            state["b"].copy_(loaded["b"])
        record(event="resumed", step=it, digest=digest(state))

    if args.crash_at is not None and attempt == 0 and rank == 1:
        finalize = ckpt.finalize

        def die_then_finalize(iteration, *a, **k):
            if iteration == args.crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return finalize(iteration, *a, **k)

        ckpt.finalize = die_then_finalize

    queue = None
    if args.async_save:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        queue = AsyncCallsQueue()
    while it < args.iters:
        it += 1
        g = torch.Generator().manual_seed(1000 * it + tp_rank)
        if model is not None:  # a deterministic update of every parameter, the same on its replicas: a
            # tensor-parallel shard's update depends on the TP rank, a TP-replicated one's (layer norms) does not
            params = dict(model.named_parameters())
            for i, k in enumerate(sorted(state)):
                sharded_tp = getattr(params[k], "tensor_model_parallel", False)
                gk = torch.Generator().manual_seed(100000 * it + 100 * i + (tp_rank if sharded_tp else 0))
                state[k].mul_(0.99).add_(torch.randn(state[k].shape, generator=gk) * 0.01)
        else:
            state["w"].mul_(0.9).add_(torch.randn(state["w"].shape, generator=g) * 0.1)
            state["b"].add_(torch.randn(16, generator=torch.Generator().manual_seed(it)) * 0.01)
        if it == args.diverge_at and rank == 1:
            k = "decoder.final_layernorm.weight" if model is not None else "b"  # replicated over TP and DP
            state[k][0] = torch.nextafter(state[k][0], torch.tensor(float("inf")))
        if it % args.save_every == 0:
            try:
                if queue is not None:
                    request = ckpt.save(it, sharded(), async_save=True)  # scout-ckpt
                    queue.schedule_async_request(request)
                    queue.maybe_finalize_async_calls(blocking=True)
                elif args.drop_in:  # scout-ckpt: the same save, with dist_checkpointing.save's signature
                    from scout_ckpt.integrations import megatron as scout_megatron

                    scout_megatron.save(sharded(), os.path.join(args.save_dir, f"iter_{it:07d}"))
                else:
                    ckpt.save(it, sharded())  # scout-ckpt: was dist_checkpointing.save(sd, iter_dir)
            except LiveStateCorrupt as e:
                record(
                    event="live_fault",
                    step=it,
                    verdict=e.verdict["state"],
                    codes=sorted({r["code"] for r in e.verdict["reasons"]}),
                )
                raise
            tracker = os.path.join(args.save_dir, "latest_checkpointed_iteration.txt")
            record(
                event="saved",
                step=it,
                digest=digest(state),
                verdict=ckpt.last_verdict["state"],
                tracker=open(tracker).read() if os.path.exists(tracker) else None,
            )
    record(event="final", step=it, digest=digest(state))
    if queue is not None:
        queue.close()
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
