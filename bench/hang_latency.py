"""How fast the observer reports a hang, and what it costs while training is healthy.

Runs N 4-rank gloo jobs in which rank 2 blocks forever before an all_reduce (observers in `abort` mode, so every
job ends by itself), and measures the time from the moment the rank blocked to the ledger's `hang` event, as a
multiple of the stall threshold (target: at most threshold + 2 s). Then a healthy job measures each observer's
CPU seconds per wall second, and a 1-rank job measures the collective tracer's cost per call.

    python bench/hang_latency.py [--runs 5] [--stall-s 2.0] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT_DIR))  # the rank functions live in tests/workers_observer.py

from scout_ckpt.ledger import Ledger  # noqa: E402
from scout_ckpt.observer.daemon import channel_dir  # noqa: E402
from scout_ckpt.observer.stacks import proc_state  # noqa: E402
from scout_ckpt.testing.launch import run_ranks  # noqa: E402
from tests import workers_observer as W  # noqa: E402

WORLD = 4
POLL_S = 0.25  # Observer.start's default


def _wait_observers(root: Path, run_id: str, timeout: float = 20.0) -> None:
    pids = []
    for r in range(WORLD):
        p = channel_dir(root, run_id) / f"status-{r}.json"
        if p.exists():
            pids.append(json.loads(p.read_text())["observer_pid"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(proc_state(p) not in (None, "Z") for p in pids):
        time.sleep(0.1)
    for p in pids:
        if proc_state(p) not in (None, "Z"):
            os.kill(p, signal.SIGKILL)


def one_hang(base: Path, i: int, stall_s: float) -> float:
    root = base / f"hang-{i}"
    root.mkdir()
    Ledger.open(root, create=True).close()
    run_id = f"bench-hang-{i}"
    run_ranks(
        W.train,
        WORLD,
        str(root),
        run_id,
        "hang",
        {"steps": 10, "fault_step": 4, "stall_s": stall_s, "action": "abort", "poll_s": POLL_S},
        timeout=60 + 4 * stall_s,
        allow_failures=True,
    )
    _wait_observers(root, run_id)
    with Ledger.open(root, readonly=True) as ledger:
        hangs = [e for e in ledger.events() if e["kind"] == "hang" and e["ranks"] == [2]]
    if not hangs:
        raise SystemExit(f"run {i}: no hang event for rank 2 (see {root}/reports)")
    started = float((root / "hang-start-2").read_text())
    return hangs[0]["time"] - started


def healthy_cpu(base: Path, steps: int, compute_s: float) -> dict:
    root = base / "healthy"
    root.mkdir()
    Ledger.open(root, create=True).close()
    out = run_ranks(
        W.train,
        WORLD,
        str(root),
        "bench-healthy",
        "healthy",
        {"steps": steps, "compute_s": compute_s, "cpu_window": True, "stall_s": 2.0, "poll_s": POLL_S},
        timeout=300,
    )
    _wait_observers(root, "bench-healthy")
    with Ledger.open(root, readonly=True) as ledger:
        n_events = len(ledger.events())
    fractions = [o.result["observer_cpu_s"] / o.result["wall_s"] for o in out]
    return {
        "cpu_fraction_max": max(fractions),
        "cpu_fraction_median": statistics.median(fractions),
        "wall_s": statistics.median(o.result["wall_s"] for o in out),
        "events": n_events,
    }


def tracer_cost(rank: int, world_size: int, n: int = 20000, blocks: int = 7) -> dict:
    """CPU ns per call: the tracer's own work (around a no-op collective), and a real 1-element all_reduce with
    and without it (alternating blocks, medians)."""
    import torch
    import torch.distributed as dist

    from scout_ckpt.observer.fingerprints import SPECS, CollectiveTracer
    from scout_ckpt.observer.heartbeat import Heartbeat

    hb = Heartbeat.create(f"/dev/shm/scout-bench-tracer-{os.getpid()}")
    t = torch.ones(1)

    def per_call(f, *args):  # CPU ns of this thread: robust to other processes sharing the cores
        t0 = time.thread_time_ns()
        for _ in range(n):
            f(*args)
        return (time.thread_time_ns() - t0) / n

    def noop(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return None

    tracer = CollectiveTracer(hb)
    wrapped_noop = tracer._wrap("all_reduce", noop, SPECS["all_reduce"])
    own = statistics.median(per_call(wrapped_noop, t) - per_call(noop, t) for _ in range(blocks))
    plain, traced = [], []
    orig = dist.all_reduce
    for _ in range(blocks):
        plain.append(per_call(orig, t))
        tracer = CollectiveTracer.install(hb)
        traced.append(per_call(dist.all_reduce, t))
        tracer.uninstall()
    hb.close()
    return {
        "tracer_own_ns": own,
        "all_reduce_ns": statistics.median(plain),
        "all_reduce_traced_ns": statistics.median(traced),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--stall-s", type=float, default=2.0)
    ap.add_argument("--healthy-steps", type=int, default=150)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny size that runs in seconds (make bench-smoke); its figures mean nothing",
    )
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.healthy_steps = 1, 10

    with tempfile.TemporaryDirectory(prefix="scout-hang-bench-") as tmp:
        base = Path(tmp)
        latencies = [one_hang(base, i, args.stall_s) for i in range(args.runs)]
        cpu = healthy_cpu(base, args.healthy_steps, 0.05)
    tracer = run_ranks(tracer_cost, 1, timeout=300)[0].result

    lat = sorted(latencies)
    p95 = lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))]
    med = statistics.median(lat)
    ratios = [x / args.stall_s for x in latencies]
    result = {
        "ratio": med / args.stall_s,
        "ratios": {
            "latency_median_over_threshold": med / args.stall_s,
            "latency_p95_over_threshold": p95 / args.stall_s,
            "latency_max_over_threshold": lat[-1] / args.stall_s,
            "observer_cpu_fraction": cpu["cpu_fraction_max"],
        },
        "per_run_ratios": ratios,
        "latency_s": latencies,
        "latency_median_s": med,
        "latency_p95_s": p95,
        "latency_max_s": lat[-1],
        "stall_s": args.stall_s,
        "runs": args.runs,
        "world_size": WORLD,
        "target_latency_s": args.stall_s + 2.0,
        "within_target": lat[-1] <= args.stall_s + 2.0,
        "healthy": cpu,
        **tracer,
    }
    if args.smoke:
        result["smoke"] = True
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"hang -> ledger event, {args.runs} runs of {WORLD} gloo ranks, stall threshold {args.stall_s:g}s")
    print(f"  {'':22}{'seconds':>10}{'x threshold':>14}")
    for name, v in (("median", med), ("p95", p95), ("max", lat[-1])):
        print(f"  {name:22}{v:>10.2f}{v / args.stall_s:>14.2f}")
    print(f"  target: threshold + 2 s = {args.stall_s + 2:.1f}s -> {'met' if result['within_target'] else 'MISSED'}")
    print(
        f"observer CPU while healthy ({cpu['wall_s']:.1f}s window, {cpu['events']} events): "
        f"max {100 * cpu['cpu_fraction_max']:.3f}% of a core, median {100 * cpu['cpu_fraction_median']:.3f}%"
    )
    print(
        f"tracer: {tracer['tracer_own_ns']:.0f} CPU ns of its own per call; 1-element all_reduce on 1 rank "
        f"{tracer['all_reduce_ns'] / 1000:.1f} us plain, {tracer['all_reduce_traced_ns'] / 1000:.1f} us traced"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
