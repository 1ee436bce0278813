"""A plain DDP training script with the three scout-ckpt lines, for `torchrun --max-restarts`.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 3 --max-restarts 2 \
        examples/train_ddp.py /tmp/run --steps 30 --save-every 5

`--crash-rank R --crash-step S` SIGKILLs rank R at step S in the first attempt only (torchrun's
TORCHELASTIC_RESTART_COUNT), to show the restart resuming from the newest certified checkpoint. With
`--record` rank 0 also keeps a copy of each saved model state (to prove the resumed state is exactly it).
"""

import argparse
import datetime
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scout_ckpt import Checkpointer, ModelOptimizerState


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--crash-rank", type=int, default=-1)
    ap.add_argument("--crash-step", type=int, default=-1)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    ckpt = Checkpointer(args.root, model=model, optimizer=opt)
    state = {"app": ModelOptimizerState(model, opt)}
    start = ckpt.load_latest_clean(state) or 0
    if rank == 0 and args.record:
        with open(Path(args.root) / f"resumed-attempt{attempt}.json", "w") as f:
            json.dump({"attempt": attempt, "resumed_from": start}, f)
        if start:
            torch.save(model.state_dict(), Path(args.root) / f"loaded-{start}.pt")

    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(start + 1, args.steps + 1):
        x = torch.randn(16, 32, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step(step)
        if attempt == 0 and rank == args.crash_rank and step == args.crash_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step % args.save_every == 0:
            ckpt.save(step, state)
            if rank == 0 and args.record:
                torch.save(model.state_dict(), Path(args.root) / f"saved-{step}.pt")
    ckpt.close()
    dist.barrier()  # TORCH-NOTES: without it destroy_process_group can hang at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
