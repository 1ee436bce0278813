"""A plain DDP training script with the three scout-ckpt lines, for `torchrun --max-restarts`.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 3 --max-restarts 2 \
        examples/train_ddp.py /tmp/run --steps 30 --save-every 5

`--crash-rank R --crash-step S` SIGKILLs rank R at step S in the first attempt only (torchrun's
TORCHELASTIC_RESTART_COUNT), to show the restart resuming from the newest certified checkpoint: after the
optimizer step by default, or, with `--crash-point POINT`, inside the save of step S at that point of the
Checkpointer's fault hook (`during_write`: in the middle of writing its file; `before_rename`: the coordinator,
rank 0, with every file written, before the checkpoint is published). The killed rank first prints
`SCOUT-EXAMPLE {"event": "crash", ...}`. `--async` saves with `async_save=True` (the write, and so the crash
point, runs in the Checkpointer's commit thread while training goes on). With
`--record` rank 0 also keeps a copy of each saved model state (to prove the resumed state is exactly it) and
prints one line `SCOUT-EXAMPLE {json}` with a digest of the model and optimizer state at each save and after
loading: the script's own sha256 of every model tensor and every optimizer state tensor (and scalar), computed
without scout-ckpt.
`--corrupt-load S` flips one bit of a weight right after checkpoint S is loaded, in every attempt (as a loader
bug would): load verification must reject S and resume from the checkpoint before it.
"""

import argparse
import datetime
import hashlib
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scout_ckpt import Checkpointer, ModelOptimizerState
from scout_ckpt.testing.faults import fault_points


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--crash-rank", type=int, default=-1)
    ap.add_argument("--crash-step", type=int, default=-1)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--corrupt-load", type=int, default=-1)
    ap.add_argument("--crash-point", default=None, help="a save fault point (during_write, before_rename, ...)")
    ap.add_argument("--async", dest="async_save", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def faults(point, step):
        if point == "after_load" and step == args.corrupt_load:
            with torch.no_grad():
                bits = next(model.parameters()).view(-1).view(torch.int32)
                bits[0] ^= 1
        if point == args.crash_point and step == args.crash_step and rank == args.crash_rank and attempt == 0:
            crash(attempt, step, point)

    with fault_points(faults):
        ckpt = Checkpointer(args.root, model=model, optimizer=opt, async_save=args.async_save)
    state = {"app": ModelOptimizerState(model, opt)}
    start = ckpt.load_latest_clean(state) or 0
    if rank == 0 and args.record:
        with open(Path(args.root) / f"resumed-attempt{attempt}.json", "w") as f:
            json.dump({"attempt": attempt, "resumed_from": start}, f)
        if start:
            torch.save(model.state_dict(), Path(args.root) / f"loaded-{start}.pt")
        report("loaded", attempt, start, model, opt)

    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(start + 1, args.steps + 1):
        x = torch.randn(16, 32, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step(step)
        if attempt == 0 and rank == args.crash_rank and step == args.crash_step and args.crash_point is None:
            crash(attempt, step, "after_optimizer_step")
        if step % args.save_every == 0:
            ckpt.save(step, state)
            if rank == 0 and args.record:
                torch.save(model.state_dict(), Path(args.root) / f"saved-{step}.pt")
                report("saved", attempt, step, model, opt)
    ckpt.close()
    dist.barrier()  # without it destroy_process_group can hang at exit (docs/pytorch-facts.md)
    dist.destroy_process_group()


def crash(attempt: int, step: int, point: str) -> None:
    """SIGKILL this rank (no cleanup, no atexit: as a lost host or the OOM killer would), saying where first."""
    print(
        "SCOUT-EXAMPLE "
        + json.dumps({"event": "crash", "attempt": attempt, "step": step, "point": point, "rank": dist.get_rank()})
        + "\n",
        end="",
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGKILL)


def report(event: str, attempt: int, step: int, model, opt) -> None:
    """One `SCOUT-EXAMPLE` line: sha256 over the model's tensors and the optimizer's state (AdamW's step,
    exp_avg, exp_avg_sq per parameter) and its param groups' hyperparameters, in name order."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    osd = opt.state_dict()
    for pid, st in sorted(osd["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"optim.{pid}.{k}".encode())
            if torch.is_tensor(v):
                h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(v).encode())
    for i, group in enumerate(osd["param_groups"]):
        h.update(f"optim.param_groups.{i}={sorted(group.items())!r}".encode())
    print(
        "SCOUT-EXAMPLE "
        + json.dumps({"event": event, "attempt": attempt, "step": step, "digest": h.hexdigest()})
        + "\n",
        end="",
        flush=True,
    )


if __name__ == "__main__":
    main()
