"""A user's DDP job whose hardware the fleet tests fault (tests/test_fleet_jobs.py).

    torchrun ... tests/scripts/fleet_job.py ROOT --fleet STORE [--fault KIND --fault-host H --fault-local L
        --fault-step K] [--steps 8 --save-every 4] [--loss]

The model has repeated blocks (replay's targets). The fault stands for hardware at one place, the host
(SCOUT_CKPT_HOST, set per torchrun agent: two agents stand for two hosts) and local rank given:

- persistent: block 1 adds 1e-3 to its output on every call on that rank, live and replayed, from the first step
  (failing hardware);
- transient: block 1's live forward on that rank is wrong at the first save step only (a one-off);
- numerics: block 1 adds noise from the operating system's entropy on every rank, every call (a layer that is not
  reproducible anywhere: no hardware to blame);
- loss-persistent: from step K on, the last block multiplies its output by 30 on that rank, live and replayed (the
  loss spikes at K);
- loss-transient: the last block's live forward on that rank multiplies its output by 30 at step K only;
- nan-data: that rank's batch of step K holds a NaN (bad data: its loss, then every replica's state, non-finite).

--loss passes each step's loss to ckpt.step (the loss triage).

It writes ROOT/fault.json first (where the fault is placed: the test's oracle, independent of scout-ckpt) and
runs with on_live_fault="continue" so that the job ends normally whatever its saves find.
"""

import argparse
import datetime
import json
import logging
import os
import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scout_ckpt import Checkpointer, FleetOptions, ModelOptimizerState
from scout_ckpt.replay.execute import replaying

FAULT = {"kind": "none", "here": False, "step": 0}
STEP = [0]
ENTROPY = random.SystemRandom()


class Block(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        out = torch.tanh(self.fc(x))
        if self.index == 1:
            kind = FAULT["kind"]
            if kind == "persistent" and FAULT["here"]:
                out = out + 1e-3
            elif kind == "transient" and FAULT["here"] and STEP[0] == FAULT["step"] and not replaying():
                out = out + 1e-3
            elif kind == "numerics":
                out = out + 1e-4 * ENTROPY.random()
        if self.index == 2 and FAULT["here"]:
            kind = FAULT["kind"]
            if (kind == "loss-persistent" and STEP[0] >= FAULT["step"]) or (
                kind == "loss-transient" and STEP[0] == FAULT["step"] and not replaying()
            ):
                out = out * 30
        return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block(i) for i in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return self.head(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--fleet", default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument(
        "--fault",
        choices=["none", "persistent", "transient", "numerics", "loss-persistent", "loss-transient", "nan-data"],
        default="none",
    )
    ap.add_argument("--fault-host", default="")
    ap.add_argument("--fault-local", type=int, default=0)
    ap.add_argument("--fault-step", type=int, default=None)
    ap.add_argument("--loss", action="store_true")
    ap.add_argument("--on-suspect", default="warn")
    args = ap.parse_args()

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    host = os.environ.get("SCOUT_CKPT_HOST", "")
    FAULT.update(
        kind=args.fault,
        here=(host == args.fault_host and local == args.fault_local),
        step=args.fault_step or args.save_every,
    )
    root = Path(args.root)
    if FAULT["here"] or (args.fault == "numerics" and rank == 0):
        root.mkdir(parents=True, exist_ok=True)
        (root / "fault.json").write_text(
            json.dumps({"kind": args.fault, "host": host, "local_rank": local, "rank": rank, "step": FAULT["step"]})
        )
    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    fleet = FleetOptions(path=args.fleet, on_suspect=args.on_suspect, interval_s=0.5) if args.fleet else False
    ckpt = Checkpointer(root, model=model, optimizer=opt, observer=False, on_live_fault="continue", fleet=fleet)
    state = {"app": ModelOptimizerState(model, opt)}
    start = ckpt.load_latest_clean(state) or 0
    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(start + 1, args.steps + 1):
        STEP[0] = step
        x = torch.randn(8, 16, generator=g)
        if FAULT["kind"] == "nan-data" and FAULT["here"] and step == FAULT["step"]:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step(step, loss=loss.item() if args.loss else None)
        if step % args.save_every == 0:
            verdict = ckpt.save(step, state)
            if rank == 0:
                print("FLEET-JOB " + json.dumps({"step": step, "state": verdict["state"]}), flush=True)
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
