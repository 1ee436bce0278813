"""A user's training script with the defaults (replay is on at every topology), run under torchrun, into which a
fault of the live step is injected the way a test can: a forward hook on ONE rank that adds 1e-3 to one channel of a module's
output, in the live forward of one step only (an intermittent fault: the replays of that step do not repeat it)
or at every call from one step on (a persistent one, which that rank's replays repeat).

Three user shapes: `--model mlp`, a plain DDP MLP (Linear, three residual blocks with dropout, Linear); `--model
fsdp`, the same MLP under FSDP2 (`fully_shard` per block and at the root) with frozen parameters beside trainable
ones (the input layer, and blocks.0's bias); `--model gpt2`, a tiny GPT-2 built from `transformers.GPT2Config`
and prepared by `accelerate` (DDP on gloo). All keep dropout on.

`--fault-kind` says where the fault strikes: `forward` (the module's output, above), `grad-input` (a full
backward hook on the module adds 1e-3 to one channel of the gradient it passes to its input: the live backward
only, the forward untouched), `grad-param` (a hook on the module's weight adds 1e-3 to its gradient before the
optimizer sees it) or `optimizer` (after the optimizer's step, one element of the module's weight -- of this
rank's shard under FSDP2 -- is 1e-3 off: a wrong update on one rank).

Its own oracle, computed without scout-ckpt: each rank prints the loss of every step and, at every save, the
sha256 of its model and optimizer state. One JSON record per rank (a `LIVE-FAULT-JOB {...}` line, and
OUT/rank<R>.json with --out): the verdict `save()`
returned at each step, whether a save raised LiveStateCorrupt (the generation ended), the losses, the digests,
and, after LiveStateCorrupt, the step `load_latest_clean` loaded and the digest of the state it loaded.

    torchrun --standalone --nproc-per-node 2 tests/scripts/live_fault_job.py ROOT --model gpt2 \
        --fault-rank 1 --fault-step 10 --fault-module transformer.h.1 [--persistent]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from scout_ckpt import Checkpointer, ModelOptimizerState
from scout_ckpt.errors import LiveStateCorrupt

try:
    from tests.scripts.job_common import digest as _digest
except ImportError:  # run as a file: its folder is on sys.path
    from job_common import digest as _digest


def digest(model, opt) -> str:
    """job_common.digest of this rank's state: under FSDP2 its local shards (a DTensor's bytes are its shard's)."""

    class Local:
        def __init__(self, sd):
            self._sd = sd

        def state_dict(self):
            return self._sd

    def local(v):
        return v.to_local() if hasattr(v, "to_local") else v

    osd = opt.state_dict()
    o = Local({"state": {pid: {k: local(v) for k, v in st.items()} for pid, st in osd["state"].items()}})
    return _digest(Local({k: local(v) for k, v in model.state_dict().items()}), o)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc, self.act, self.drop = nn.Linear(d, d), nn.GELU(), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.act(self.fc(x)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList(Block(64) for _ in range(3))
        self.out = nn.Linear(64, 8)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--model", choices=("mlp", "fsdp", "gpt2"), default="mlp")
    ap.add_argument("--fault-kind", choices=("forward", "grad-input", "grad-param", "optimizer"), default="forward")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--fault-rank", type=int, default=-1)
    ap.add_argument("--fault-step", type=int, default=0)
    ap.add_argument("--fault-module", default="")
    ap.add_argument("--persistent", action="store_true", help="from --fault-step on, not at that step only")
    ap.add_argument(
        "--math-hook",
        action="store_true",
        help="every rank scales one block's output by a forward hook (part of the model's math)",
    )
    ap.add_argument("--mixed-precision", default="no", help="accelerate's mixed_precision (gpt2): no, bf16")
    ap.add_argument(
        "--out",
        default="",
        help="write each rank's record to OUT/rank<R>.json too (whole, unlike "
        "lines of several ranks on one pipe, which can interleave)",
    )
    ap.add_argument("--grad-ckpt", action="store_true", help="gpt2: gradient_checkpointing_enable()")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    if args.model == "gpt2":
        from accelerate import Accelerator
        from transformers import GPT2Config, GPT2LMHeadModel

        accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision)
        cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)  # dropout 0.1 by default
        model = GPT2LMHeadModel(cfg)
        if args.grad_ckpt:
            model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = accelerator.prepare(model, opt)
        rank = accelerator.process_index

        def loss_of(g):
            ids = torch.randint(0, 128, (4, 16), generator=g)
            return model(input_ids=ids, labels=ids).loss

        def backward(loss):
            accelerator.backward(loss)
    else:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        if args.model == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            model = MLP()
            model.inp.requires_grad_(False)  # frozen beside trainable, in the root's group
            model.blocks[0].fc.bias.requires_grad_(False)  # and inside a block's group
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for b in model.blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            model = nn.parallel.DistributedDataParallel(MLP())
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

        def loss_of(g):
            return model(torch.randn(16, 32, generator=g)).pow(2).mean()

        def backward(loss):
            loss.backward()

    inner = model.module if hasattr(model, "module") else model
    step_now = [0]
    if args.fault_rank == rank and args.fault_module:
        fired: set = set()

        def record(step):  # ROOT/fault.json: when it first struck (a campaign's latency starts there)
            if not fired:
                with open(os.path.join(args.root, "fault.json"), "w") as f:
                    json.dump(
                        {
                            "rank": rank,
                            "step": step,
                            "module": args.fault_module,
                            "kind": args.fault_kind,
                            "time": time.time(),
                        },
                        f,
                    )
            fired.add(step)

        def grad_fault(step):
            return (args.persistent and step >= args.fault_step) or step == args.fault_step

        def grad_input_fault(mod, grad_input, grad_output):  # the live backward only
            if not grad_fault(step_now[0]) or grad_input[0] is None:
                return None
            record(step_now[0])
            g = grad_input[0].clone()
            g[..., 3] += 1e-3
            return (g,) + tuple(grad_input[1:])

        def grad_param_fault(grad):
            if not grad_fault(step_now[0]):
                return None
            record(step_now[0])
            return grad + 1e-3

        def fault(mod, inputs, out):
            # one channel of the output 1e-3 off: persistent, at every call from the step on (the replays of that
            # rank included, as failing hardware); or intermittent, at the step's first call only (its live forward)
            step = step_now[0]
            if (args.persistent and step >= args.fault_step) or (step == args.fault_step and step not in fired):
                record(step)
                out = out.clone()
                out[..., 3] += 1e-3
                return out
            return None

        def optimizer_fault(optimizer, a, kw):  # after the update: one element of the module's weight off
            if not grad_fault(step_now[0]):
                return
            record(step_now[0])
            with torch.no_grad():
                w = target.weight
                local = w.to_local() if hasattr(w, "to_local") else w
                if local.numel():
                    local.view(-1)[0] += 1e-3

        target = inner.get_submodule(args.fault_module)
        if args.fault_kind == "optimizer":
            (opt.optimizer if hasattr(opt, "optimizer") else opt).register_step_post_hook(optimizer_fault)
        elif args.fault_kind == "forward":
            target.register_forward_hook(fault)
        elif args.fault_kind == "grad-input":
            target.register_full_backward_hook(grad_input_fault)
        else:
            target.weight.register_hook(grad_param_fault)
    if args.math_hook:  # on every rank: a hook that is part of the model's math (healthy)
        name = "transformer.h.0" if args.model == "gpt2" else "blocks.0"
        inner.get_submodule(name).register_forward_hook(lambda mod, inputs, out: out * 0.5)

    state = {"app": ModelOptimizerState(model, opt)}
    ckpt = Checkpointer(args.root, model=model, optimizer=opt)  # the defaults: replay on at every topology
    g = torch.Generator().manual_seed(1000 + rank)
    rec: dict = {
        "rank": rank,
        "world": dist.get_world_size(),
        "losses": {},
        "verdicts": {},
        "digests": {},
        "live_state_corrupt": None,
        "resumed_step": None,
        "resumed_digest": None,
        "targets": [t[1] for t in ckpt.replay.targets()] if ckpt.replay else [],
    }
    try:
        for step in range(1, args.steps + 1):
            step_now[0] = step
            loss = loss_of(g)
            backward(loss)
            opt.step()
            opt.zero_grad()
            rec["losses"][step] = loss.item()
            ckpt.step(step)
            if step % args.save_every == 0:
                rec["digests"][step] = digest(inner, opt.optimizer if hasattr(opt, "optimizer") else opt)
                v = ckpt.save(step, state)
                rec["verdicts"][step] = v
    except LiveStateCorrupt as e:
        rec["live_state_corrupt"] = e.step
        # what a user does next (here, or after torchrun's restart): load the newest certified state; its digest
        # is judged against the one this job printed when it saved that step
        rec["resumed_step"] = ckpt.load_latest_clean(state)
        rec["resumed_digest"] = digest(inner, opt.optimizer if hasattr(opt, "optimizer") else opt)
    finally:
        ckpt.close()
        line = json.dumps(rec, default=str)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
                f.write(line)
        print("LIVE-FAULT-JOB " + line, flush=True)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
