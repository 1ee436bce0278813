"""A plain FSDP2 training script with the scout-ckpt lines and nothing configured, for `torchrun --max-restarts`.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 --max-restarts 1 \
        examples/train_fsdp.py /tmp/run --steps 30 --save-every 5

`fully_shard` on every Linear and on the root, AdamW, `Checkpointer(ROOT, model=model, optimizer=opt)` with the
defaults: no invariant, no replay or shard-evidence option. With 4 ranks and `--hsdp` the mesh is 2x2
(replicate, shard): HSDP.

The job's own oracle, independent of scout-ckpt: at every save and right after loading, it gathers its full state
(`get_state_dict(..., full_state_dict=True)`: every parameter and every optimizer tensor, unsharded) and rank 0
prints one line `SCOUT-FSDP {json}` with the sha256 of those bytes. A resume is exact when the digest printed after
loading step S equals the one printed when S was saved.

Fault injection (first torchrun attempt only, TORCHELASTIC_RESTART_COUNT == 0; each prints a `fault` line):
  --crash-rank R --crash-step S     SIGKILL rank R after the optimizer step of step S (before any save of S)
  --flip RANK:STEP:PARAM:INDEX:BIT  after the optimizer step of STEP, flip bit BIT (0 = the lowest mantissa bit)
                                    of element INDEX of RANK's local shard of PARAM (a bit flipped in memory)
  --update-fault RANK:STEP:PARAM:INDEX  from STEP on, RANK's live optimizer update of that element of its
                                    shard lands one ulp off (a faulty ALU: persistent while the process lives)
  (an INDEX with a decimal point is a fraction of the local shard's size: 0.5 is its middle element)
  --kill-after-fault N              SIGKILL the faulty rank N steps after the fault fired (torchrun restarts)
"""

import argparse
import datetime
import hashlib
import json
import os
import signal
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from scout_ckpt import Checkpointer, LiveStateCorrupt, ModelOptimizerState


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int, blocks: int, vocab: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def full_state_digest(model, opt) -> str | None:
    """sha256 of the full (unsharded) model and optimizer state, on rank 0 (None elsewhere). Collective."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    h = hashlib.sha256()

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(f"{prefix}/{k}", obj[k])
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)
        elif isinstance(obj, torch.Tensor):
            h.update(prefix.encode())
            h.update(obj.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix}={obj!r}".encode())

    walk("model", msd)
    walk("optim", osd.get("state", {}))
    return h.hexdigest()


def say(event: str, **kw) -> None:
    # the line and its newline in one write: the ranks share torchrun's stdout, and print's separate write of
    # the newline lets another rank's line land between them
    print("SCOUT-FSDP " + json.dumps({"event": event, "t": round(time.time(), 3), **kw}) + "\n", end="", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--hsdp", action="store_true", help="2-D mesh (replicate=2, shard=world/2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-evidence", choices=("default", "on", "off"), default="default")
    ap.add_argument("--crash-rank", type=int, default=-1)
    ap.add_argument("--crash-step", type=int, default=-1)
    ap.add_argument("--flip", default=None)
    ap.add_argument("--update-fault", default=None)
    ap.add_argument("--kill-after-fault", type=int, default=-1)
    ap.add_argument("--final-digest", action="store_true", help="print the full-state digest at the end too")
    ap.add_argument(
        "--on-live-fault",
        choices=("raise", "continue"),
        default="raise",
        help="the Checkpointer's on_live_fault (default: its own default)",
    )
    args = ap.parse_args()

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # our outputs are never modified in place
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(args.seed)
    model = Net(args.d_model, args.blocks, args.vocab)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    flip = args.flip.split(":") if args.flip and attempt == 0 else None
    upd = args.update_fault.split(":") if args.update_fault and attempt == 0 else None
    fault = {"step": None, "current": 0}

    def local(name):
        return dict(model.named_parameters())[name].to_local().detach().view(-1)

    def index(name, spec):
        return int(float(spec) * local(name).numel()) if "." in spec else int(spec)

    if upd and int(upd[0]) == rank:

        def faulty_update(o, a, k):  # registered before the Checkpointer's hooks: runs first, inside step()
            if fault["current"] >= int(upd[1]):
                with torch.no_grad():
                    t = local(upd[2])
                    i = index(upd[2], upd[3])
                    t[i] = torch.nextafter(t[i], torch.tensor(float("inf")))
                if fault["step"] is None:
                    fault["step"] = fault["current"]
                    say(
                        "fault", kind="update", rank=rank, step=fault["current"], param=upd[2], index=i, attempt=attempt
                    )

        opt.register_step_post_hook(faulty_update)

    kw = {} if args.shard_evidence == "default" else {"shard_evidence": args.shard_evidence == "on"}
    if args.on_live_fault != "raise":
        kw["on_live_fault"] = args.on_live_fault
    ckpt = Checkpointer(args.root, model=model, optimizer=opt, **kw)
    state = {"app": ModelOptimizerState(model, opt)}
    start = ckpt.load_latest_clean(state) or 0
    digest = full_state_digest(model, opt)
    if rank == 0:
        say("loaded", attempt=attempt, step=start, digest=digest if start else None)

    for step in range(start + 1, args.steps + 1):
        fault["current"] = step
        g = torch.Generator().manual_seed(args.seed * 100_003 + step * 131 + rank)
        tokens = torch.randint(0, args.vocab, (4, 17), generator=g)
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if flip and int(flip[0]) == rank and int(flip[1]) == step:
            with torch.no_grad():
                bits = local(flip[2]).view(torch.int32)
                i = index(flip[2], flip[3])
                bits[i] ^= 1 << int(flip[4])  # int32 view: bit 31 is the sign, 30..23 the exponent
            fault["step"] = step
            say("fault", kind="flip", rank=rank, step=step, param=flip[2], index=i, bit=int(flip[4]), attempt=attempt)
        ckpt.step(step)
        if attempt == 0 and rank == args.crash_rank and step == args.crash_step:
            say("crash", rank=rank, step=step, attempt=attempt)
            os.kill(os.getpid(), signal.SIGKILL)
        if fault["step"] is not None and args.kill_after_fault >= 0 and step >= fault["step"] + args.kill_after_fault:
            say("crash", rank=rank, step=step, attempt=attempt)
            os.kill(os.getpid(), signal.SIGKILL)
        if step % args.save_every == 0:
            try:
                verdict = ckpt.save(step, state)
            except LiveStateCorrupt as e:  # every rank: the generation ends, torchrun restarts from a clean step
                if rank == 0:
                    say(
                        "saved",
                        attempt=attempt,
                        step=step,
                        digest=None,
                        state=e.verdict["state"],
                        reasons=e.verdict["reasons"],
                        live_fault=e.verdict.get("live_fault"),
                    )
                raise
            digest = full_state_digest(model, opt)
            if rank == 0:
                say(
                    "saved",
                    attempt=attempt,
                    step=step,
                    digest=digest,
                    state=(verdict or {}).get("state"),
                    reasons=(verdict or {}).get("reasons"),
                )
    ckpt.close()
    if args.final_digest:
        digest = full_state_digest(model, opt)
        if rank == 0:
            say("final", attempt=attempt, step=args.steps, digest=digest)
    dist.barrier()  # without it destroy_process_group can hang at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
