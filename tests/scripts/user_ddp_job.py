"""A user's plain DDP training script (an MLP, AdamW, a synthetic data loader) with scout-ckpt's twelve lines and
the observer's defaults, for real torchrun: one rank made slow or hung where a user's job would be.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 3 tests/scripts/user_ddp_job.py /tmp/run \
        --slow-rank 2 --slow-where data --slow-factor 3

Nothing of the project's harness: no phases, no tuned straggler rule; `--observer` is the JSON of the observer
option exactly as a user writes it (default {"stall_s": 30, "action": "report"}, otherwise the defaults).

Faults (first generation only, TORCHELASTIC_RESTART_COUNT == 0):
  --slow-rank R --slow-where data|forward|backward|after-step --slow-factor F: rank R spends F times as long as
      the others at that place every step (a slow data loader; a slow layer in forward; a slow layer's
      backward; host work after the optimizer step). Every rank spends --work-s there (the bulk of its step:
      the model itself takes a few ms); R spends F * work-s.
  --hang-rank R --hang-where before-forward|in-forward|before-backward|in-optimizer --hang-how event|sleep
      --hang-step S: rank R blocks forever (threading.Event().wait() or time.sleep) at that place of step S.
The faulty rank writes ROOT/fault.json ({"kind", "rank", "where", "step", "time"}) when its fault first strikes,
so a test judges the observer's events by what the job did.
"""

import argparse
import datetime
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scout_ckpt import Checkpointer, ModelOptimizerState, ObserverOptions


class Pause(nn.Module):
    """A layer that takes `forward_s` in forward and `backward_s` in backward (a user's slow layer)."""

    def __init__(self):
        super().__init__()
        self.forward_s = self.backward_s = 0.0

    def forward(self, x):
        if self.forward_s:
            time.sleep(self.forward_s)
        return _SlowBackward.apply(x, self) if self.backward_s else x


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.layer.backward_s)
        return g, None


def block(how: str) -> None:
    if how == "sleep":
        time.sleep(10**6)
    threading.Event().wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--observer", default='{"stall_s": 30, "action": "report"}')
    ap.add_argument("--work-s", type=float, default=0.05, help="every rank's time at --slow-where, per step")
    ap.add_argument("--base-s", type=float, default=0.0, help="every rank's other host work per step (a sleep)")
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-where", default="data", choices=("data", "forward", "backward", "after-step"))
    ap.add_argument("--slow-factor", type=float, default=3.0)
    ap.add_argument("--hang-rank", type=int, default=-1)
    ap.add_argument(
        "--hang-where",
        default="before-backward",
        choices=("before-forward", "in-forward", "before-backward", "in-optimizer"),
    )
    ap.add_argument("--hang-how", default="event", choices=("event", "sleep"))
    ap.add_argument("--hang-step", type=int, default=8)
    ap.add_argument("--pg-timeout", type=float, default=300.0)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    first = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    torch.manual_seed(0)
    pause = Pause()
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), pause, nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = Checkpointer(
        args.root, model=model, optimizer=opt, observer=ObserverOptions.from_dict(json.loads(args.observer))
    )
    state = {"app": ModelOptimizerState(model, opt)}
    start = ckpt.load_latest_clean(state) or 0

    slow = first and rank == args.slow_rank
    hang = first and rank == args.hang_rank
    work = {w: 0.0 for w in ("data", "forward", "backward", "after-step")}
    work[args.slow_where] = args.work_s * (args.slow_factor if slow else 1.0)
    pause.forward_s, pause.backward_s = work["forward"], work["backward"]
    if slow:
        _mark(args.root, "straggler", rank, args.slow_where, start + 1)
    g = torch.Generator().manual_seed(1000 + rank)

    def at(where: str, step: int) -> None:
        if hang and step == args.hang_step and where == args.hang_where:
            _mark(args.root, "hang", rank, where, step)
            block(args.hang_how)

    for step in range(start + 1, args.steps + 1):
        at("before-forward", step)
        time.sleep(work["data"])  # the data loader
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        if hang and step == args.hang_step and args.hang_where == "in-forward":
            pause.forward_s = 0.0
            pause.register_forward_pre_hook(lambda *_, s=step: at("in-forward", s))
        loss = nn.functional.cross_entropy(model(x), y)
        at("before-backward", step)
        opt.zero_grad()
        loss.backward()
        if hang and step == args.hang_step and args.hang_where == "in-optimizer":
            opt.register_step_pre_hook(lambda *_, s=step: at("in-optimizer", s))
        opt.step()
        time.sleep(work["after-step"] + args.base_s)  # host work after the step (logging, metrics)
        ckpt.step(step)
        if step % args.save_every == 0:
            ckpt.save(step, state)
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


def _mark(root: str, kind: str, rank: int, where: str, step: int) -> None:
    path = Path(root, "fault.json")
    if not path.exists():
        path.write_text(json.dumps({"kind": kind, "rank": rank, "where": where, "step": step, "time": time.time()}))


if __name__ == "__main__":
    main()
