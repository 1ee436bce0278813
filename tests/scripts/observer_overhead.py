"""What the observer costs a training step: DDP steps with and without it, interleaved, on one gloo rank.

    OMP_NUM_THREADS=1 PYTHONPATH=. python tests/scripts/observer_overhead.py [--width 256] [--steps 200]

Without the observer DDP's reducer all-reduces in C++ (no hook); with it ("full", the observer's default) the
same reducer, counted natively by the observer's sampling thread (no hook), the heartbeat writes, the
bookkeeping at each step and the observer process polling beside it; "hook-only" measures torch's reference
allreduce_hook alone. Blocks of steps alternate
between two identical models (one attached, one not) so machine load hits both alike; the fastest block of each is compared.
Step times are this process's CPU time (time.process_time, all its threads), which machine load disturbs less
than wall time; the observer process's own CPU share is reported apart. Also times one traced async all_reduce
against the plain call. Prints one JSON object.
"""

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def make(width: int, depth: int):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = DDP(nn.Sequential(*layers))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def step(model, opt, x, obs=None, n=0):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if obs is not None:
        obs.step(n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument(
        "--mode",
        choices=("full", "hook-only", "control"),
        default="full",
        help="control: nothing attached (the two models' difference is the noise floor); hook-only: "
        "the comm hook on the untraced all_reduce (what the hook alone costs)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="scout-overhead-")
    store = dist.FileStore(os.path.join(tmp, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.observer import Observer

    Ledger.open(tmp, create=True).close()
    plain, plain_opt = make(args.width, args.depth)
    seen, seen_opt = make(args.width, args.depth)
    obs = Observer.start(tmp, rank=0, world_size=1, run_id="overhead", stall_s=600.0, poll_s=0.25)
    if args.mode == "full":
        attached = obs.attach(seen)
    elif args.mode == "hook-only":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        obs.tracer.uninstall()
        obs.tracer = None
        seen.register_comm_hook(None, allreduce_hook)
        attached = "hook-only"
    else:
        attached = "control"
    x = torch.randn(32, args.width)
    for _ in range(5):  # warm-up: DDP rebuilds its buckets after the first iteration
        step(plain, plain_opt, x)
        step(seen, seen_opt, x, obs)
    t_plain, t_seen = [], []
    from scout_ckpt.observer.stacks import cpu_seconds

    cpu0, wall0 = cpu_seconds(obs.pid), time.monotonic()
    n = 0
    for _ in range(args.steps // args.block):
        for model, opt, o, out in ((plain, plain_opt, None, t_plain), (seen, seen_opt, obs, t_seen)):
            t0 = time.process_time()  # this process's CPU (all its threads): less hostage to machine load
            for _ in range(args.block):
                n += 1
                step(model, opt, x, o, n)
            out.append((time.process_time() - t0) / args.block)
    observer_cpu = cpu_seconds(obs.pid) - cpu0
    seq = obs.tracer.seq if obs.tracer else 0
    # one traced async all_reduce (wrapper + heartbeat + callback) against the untraced call
    t = torch.ones(1024)
    traced = dist.all_reduce
    original = getattr(traced, "__scout_original__", traced)
    per = {}
    for name, fn in (("plain", original), ("traced", traced)):
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(2000):
                fn(t, async_op=True).wait()
            best.append((time.perf_counter() - t0) / 2000)
        per[name] = min(best)
    obs.stop()
    dist.destroy_process_group()
    mp, ms = min(t_plain), min(t_seen)  # the least disturbed block of each
    print(
        json.dumps(
            {
                "attached": attached,
                "traced_collectives": seq,
                "width": args.width,
                "depth": args.depth,
                "step_ms_plain": round(mp * 1e3, 4),
                "step_ms_observed": round(ms * 1e3, 4),
                "overhead_pct": round(100 * (ms - mp) / mp, 3),
                "observer_process_cpu_pct": round(100 * observer_cpu / (time.monotonic() - wall0), 3),
                "allreduce_us_plain": round(per["plain"] * 1e6, 2),
                "allreduce_us_traced": round(per["traced"] * 1e6, 2),
                "per_collective_us": round((per["traced"] - per["plain"]) * 1e6, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
