"""A user's DDP or FSDP2 training script with scout-ckpt's observer, for real `torchrun --max-restarts`, with
one injected fault in the first generation only (torchrun's TORCHELASTIC_RESTART_COUNT == 0).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \
        --nproc-per-node 3 --max-restarts 1 tests/scripts/observed_job.py /tmp/run --model ddp \
        --fault hang-before-backward --fault-rank 2 --fault-step 8 --stall-s 3 --action abort --pg-timeout 90

Faults: hang-before-backward, hang-in-optimizer, straggler (this rank's step, from its forward to the end of its
optimizer step, takes --slow-factor times as long: it then sleeps factor - 1 times what the step took),
extra-collective (this rank issues one all_reduce the others do not), kill (SIGKILL). `--faults` gives one
fault per generation, "ATTEMPT:FAULT:RANK:STEP,...", so one torchrun job goes through several (each abort or
crash ends a generation and torchrun starts the next). Rank 0 appends one JSON line per step to
ROOT/progress.jsonl ({"attempt", "step", "time"}) so a test can measure the time from the fault to training again;
the faulty rank writes ROOT/fault-ATTEMPT.json when the fault happens.
"""

import argparse
import datetime
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from scout_ckpt import Checkpointer, ModelOptimizerState, ObserverOptions


def injected_hang_before_backward(root: str, rank: int, step: int) -> None:
    _mark(root, "hang-before-backward", rank, step)
    threading.Event().wait()


def injected_hang_in_optimizer(root: str, rank: int, step: int) -> None:
    _mark(root, "hang-in-optimizer", rank, step)
    threading.Event().wait()


def _mark(root: str, fault: str, rank: int, step: int) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    Path(root, f"fault-{attempt}.json").write_text(
        json.dumps({"fault": fault, "rank": rank, "step": step, "attempt": attempt, "time": time.time()})
    )


def build(kind: str, rank: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--model", choices=("ddp", "fsdp"), default="ddp")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--fault-rank", type=int, default=2)
    ap.add_argument("--fault-step", type=int, default=8)
    ap.add_argument("--faults", default="", help="ATTEMPT:FAULT:RANK:STEP,... (one fault per generation)")
    ap.add_argument("--compute-s", type=float, default=0.0)
    ap.add_argument("--slow-factor", type=float, default=3.0)
    ap.add_argument("--stall-s", type=float, default=3.0)
    ap.add_argument("--action", default="abort")
    ap.add_argument("--pg-timeout", type=float, default=90.0)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model, opt = build(args.model, rank)
    # pure FSDP shards have no replica to compare: the finite check vouches for them, so saves can be certified
    # the observer as a user configures it: the stall and the action (which the docs leave to the user); the
    # straggler rule, the poll and exchange intervals and the count sampling are the product's defaults
    observer = ObserverOptions(stall_s=args.stall_s, action=args.action)
    ckpt = Checkpointer(
        args.root,
        model=model,
        optimizer=opt,
        timeout_s=args.pg_timeout,
        invariants=["finite"] if args.model == "fsdp" else None,
        observer=observer,
    )
    state = {"app": ModelOptimizerState(model, opt)}
    start = ckpt.load_latest_clean(state) or 0
    if rank == 0:
        with open(Path(args.root) / "attempts.jsonl", "a") as f:
            f.write(
                json.dumps(
                    {"attempt": attempt, "resumed_from": start, "attached": ckpt.observer.attached, "time": time.time()}
                )
                + "\n"
            )
    plan = {0: (args.fault, args.fault_rank, args.fault_step)}
    for item in filter(None, args.faults.split(",")):
        a, fault, r, st = item.split(":")
        plan[int(a)] = (fault, int(r), int(st))
    fault_kind, fault_rank, fault_step = plan.get(attempt, ("none", -1, -1))
    args.fault = fault_kind
    faulty = rank == fault_rank
    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(start + 1, args.steps + 1):
        fault_now = faulty and step == fault_step
        x = torch.randn(16, 32, generator=g)
        with ckpt.phase("forward"):
            slow = faulty and args.fault == "straggler"
            if slow and step == start + 1:
                _mark(args.root, "straggler", rank, step)
            t_step = time.perf_counter()
            if args.compute_s:
                time.sleep(args.compute_s)
            loss = model(x).pow(2).mean()
        if fault_now and args.fault == "kill":
            _mark(args.root, "kill", rank, step)
            os.kill(os.getpid(), signal.SIGKILL)
        if fault_now and args.fault == "hang-before-backward":
            injected_hang_before_backward(args.root, rank, step)
        if fault_now and args.fault == "extra-collective":
            _mark(args.root, "extra-collective", rank, step)
            dist.all_reduce(torch.ones(3))  # a rank-dependent branch: the others never issue it
        opt.zero_grad()
        with ckpt.phase("backward"):
            loss.backward()
        with ckpt.phase("optimizer"):
            if fault_now and args.fault == "hang-in-optimizer":
                injected_hang_in_optimizer(args.root, rank, step)
            opt.step()
        if slow:  # --slow-factor times this rank's whole step (the sleep, the model, its own collectives)
            time.sleep((args.slow_factor - 1.0) * (time.perf_counter() - t_step))
        ckpt.step(step)
        if rank == 0:
            with open(Path(args.root) / "progress.jsonl", "a") as f:
                f.write(json.dumps({"attempt": attempt, "step": step, "time": time.time()}) + "\n")
        if step % args.save_every == 0:
            ckpt.save(step, state)
    ckpt.close()
    dist.barrier()  # without it destroy_process_group can hang at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
