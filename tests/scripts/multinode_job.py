"""A user's DDP job for multi-node torchrun (tests/test_multinode.py): the observer on, saves every N steps.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id job1 \
        --max-restarts 2 tests/scripts/multinode_job.py ROOT --fault crash --fault-node 1 --fault-step 7

The fault fires once per job (a marker file in ROOT, since TORCHELASTIC_RESTART_COUNT grows only on the failing
node): at --fault-step the worker with GROUP_RANK == --fault-node and LOCAL_RANK == --fault-local SIGKILLs itself
(`crash`), blocks for ever before its next collective (`hang`), issues an all_reduce the others never issue
(`desync`), or adds 1.0 to one weight of its replica after that step's optimizer step and replay, before its save
(`diverge`: only the save's consensus can see it); `slow` makes it compute slower from then on (--fault-local -1:
every rank of the node). It writes ROOT/fault.json first: the rank, node and host the test expects the ledger to
name (an oracle independent of scout-ckpt).

Rank 0 prints `MN-JOB {json}` lines: at every save the digest of the model and optimizer state it just saved, and
after loading the step and the digest of what it loaded, so a resume is judged by the job's own digests.
"""

import argparse
import datetime
import json
import os
import signal
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from job_common import digest, train_step  # noqa: E402 (beside this script: torchrun puts its folder on sys.path)
from torch.nn.parallel import DistributedDataParallel as DDP

from scout_ckpt import Checkpointer, ModelOptimizerState, ObserverOptions


def say(**kw) -> None:
    print("MN-JOB " + json.dumps(kw) + "\n", end="", flush=True)  # one write: the ranks share stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--fault", choices=["none", "crash", "hang", "slow", "diverge", "desync"], default="none")
    ap.add_argument("--fault-node", type=int, default=1)
    ap.add_argument("--fault-local", type=int, default=0, help="the local rank of the fault; -1: slow, every one")
    ap.add_argument("--fault-step", type=int, default=7)
    ap.add_argument("--stall-s", type=float, default=4.0)
    ap.add_argument("--pg-timeout", type=float, default=120.0)
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--slow-s", type=float, default=0.25, help="slow: the extra compute per step of the slow rank")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    node, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    root = Path(args.root)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = Checkpointer(
        root,
        model=model,
        optimizer=opt,
        timeout_s=args.pg_timeout,
        observer=ObserverOptions(
            stall_s=args.stall_s, action="abort" if args.fault in ("hang", "desync") else "report"
        ),
    )
    state = {"app": ModelOptimizerState(model, opt)}
    start = ckpt.load_latest_clean(state) or 0
    if rank == 0:
        say(event="loaded", run_id=ckpt.run_id, step=start, digest=digest(model, opt), world=dist.get_world_size())

    marker = root / "fault.json"
    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(start + 1, args.steps + 1):
        train_step(model, opt, g)
        ckpt.step(step)
        time.sleep(args.step_sleep)
        mine = node == args.fault_node and args.fault_local in (local, -1)  # -1: every rank of the node
        if args.fault == "slow" and mine and step >= args.fault_step:
            time.sleep(args.slow_s)  # a straggler: slower compute from the fault step on (fault.json at that step)
        if (
            args.fault != "none"
            and step == args.fault_step
            and node == args.fault_node
            and local == max(args.fault_local, 0)
            and not marker.exists()
        ):
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(
                json.dumps(
                    {
                        "kind": args.fault,
                        "rank": rank,
                        "node_rank": node,
                        "local_rank": local,
                        "host": socket.gethostname(),
                        "step": step,
                        "run_id": ckpt.run_id,
                        "time": time.time(),
                    }
                )
            )
            os.replace(tmp, marker)
            if args.fault == "slow":
                pass
            elif args.fault == "desync":
                dist.all_reduce(torch.ones(3))  # a rank-dependent branch: the others never issue it
            elif args.fault == "diverge":
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] += 1.0
            elif args.fault == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                while True:  # hang: never reach the next collective
                    time.sleep(1)
        if step % args.save_every == 0:
            ckpt.save(step, state)  # a live fault (diverge) raises LiveStateCorrupt: torchrun restarts the job
            if rank == 0:
                say(event="saved", run_id=ckpt.run_id, step=step, digest=digest(model, opt))
    ckpt.close()
    dist.barrier()  # without it destroy_process_group can hang at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
