"""A Megatron-Core user's training job (CPU/gloo ranks under torchrun, TP = PP = 1, DP = world): a tiny GPTModel
(local spec) wrapped in Megatron's DistributedDataParallel, Adam stepping the reduced `main_grad` (as Megatron's
FP32Optimizer does), a next-token loss on seeded
batches, saving `model.sharded_state_dict()` every --save-every iterations through MegatronCheckpointer with its
defaults. For tests/test_integration_megatron_replay.py.

Its own oracle: sha256 of every rank's parameters, joined in rank order, computed here without scout-ckpt and
written to --events at each save, after a load and at the end; the test compares those, not scout-ckpt's verdicts.

--fault-at I: from iteration I on, rank 1's second transformer layer computes wrongly on every forward (one channel
of its output off by 1e-3: failing hardware), so every replica trains on the averaged, poisoned gradient.
--fault-in forward|backward: where the fault falls (the layer's output, or the input gradient its MLP's backward
sends on, inside the layer).

Test-only CUDA shims (megatron-core 0.16.1 on a CPU-only torch): torch.cuda.synchronize/current_device (its
torch_dist writer) and the CUDA RNG state that megatron-core's RNG tracker forks around attention (mapped onto the
CPU generator; the model has no dropout, so no random number is drawn). docs/integrations/megatron.md, "On CPU".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist

torch.cuda.synchronize = lambda *a, **k: None  # test-only CUDA shims (see the module docstring)
torch.cuda.current_device = lambda: "cpu"
torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
torch.cuda.manual_seed = lambda seed: None
import megatron.core.tensor_parallel.random as mg_random  # noqa: E402

mg_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
mg_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from scout_ckpt.errors import LiveStateCorrupt  # noqa: E402
from scout_ckpt.integrations.megatron import MegatronCheckpointer  # noqa: E402  scout-ckpt

VOCAB, SEQ, BATCH = 64, 16, 4


def digest(model) -> str:
    h = hashlib.sha256()
    for k, p in sorted(model.named_parameters()):
        h.update(k.encode())
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, h.hexdigest())
    return ":".join(x[:16] for x in every)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("save_dir")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--fault-at", type=int, default=None)
    ap.add_argument("--fault-in", choices=["forward", "backward"], default="forward")
    ap.add_argument("--events", required=True)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    mg_random.model_parallel_cuda_manual_seed(1234)
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_dtype=torch.float32,
    )
    gpt = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ
    )
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), gpt)
    # Megatron's FP32Optimizer on CPU: its constructor allocates a CUDA tensor, so the job does what its step does
    # (the reduced `main_grad` handed to torch's Adam as `grad`)
    params = [p for p in gpt.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-3)

    def record(**row):
        if rank == 0:
            with open(args.events, "a") as f:
                f.write(json.dumps({"attempt": attempt, **row}) + "\n")

    ckpt = MegatronCheckpointer(args.save_dir, model=[model])  # scout-ckpt
    it = 0
    found = ckpt.load_latest_clean({"model": gpt.sharded_state_dict(prefix=""), "iteration": 0})  # scout-ckpt
    if found is not None:
        it, loaded = found
        gpt.load_state_dict(loaded["model"], strict=False)
        record(event="resumed", step=it, digest=digest(gpt))

    def wrong_output(module, inputs, output):  # the layer's forward: one channel of its output off by 1e-3
        hidden = output[0].clone() if isinstance(output, tuple) else output.clone()
        hidden[..., 0] += 1e-3
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    def wrong_grad(module, grad_input, grad_output):  # the layer's backward: its MLP's input gradient off by 1e-3
        return tuple(None if g is None else g + 1e-3 for g in grad_input)

    faulty = None
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    while it < args.iters:
        it += 1
        if args.fault_at is not None and it == args.fault_at and rank == 1 and faulty is None:
            layer = gpt.decoder.layers[1]
            if args.fault_in == "forward":
                faulty = layer.register_forward_hook(wrong_output)
            else:
                faulty = layer.mlp.register_full_backward_hook(wrong_grad)
        g = torch.Generator().manual_seed(1000 * it + rank)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], pos, mask, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        model.finish_grad_sync()
        for p in params:
            p.grad = p.main_grad
        optimizer.step()
        ckpt.step(it, loss.item())  # scout-ckpt: after each optimizer step
        if it % args.save_every == 0:
            try:
                verdict = ckpt.save(it, {"model": gpt.sharded_state_dict(prefix=""), "iteration": it})  # scout-ckpt
            except LiveStateCorrupt as e:
                codes = sorted({r["code"] for r in e.verdict["reasons"]})
                record(event="live_fault", step=it, verdict=e.verdict["state"], codes=codes)
                raise
            record(event="saved", step=it, digest=digest(gpt), verdict=verdict["state"])
    record(event="final", step=it, digest=digest(gpt))
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
