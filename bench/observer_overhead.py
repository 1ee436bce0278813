"""What the observer costs a training step: DDP steps with and without it, side by side in one run.

    python bench/observer_overhead.py [--ranks 2] [--width 512] [--depth 4] [--batch 32,256] [--rounds 12] [--json]

Each rank holds identical DDP models (an MLP of `depth` width x width layers) and trains them in alternating
blocks of steps, the block order rotated every round so that machine load hits all alike:
  plain     DDP as torch builds it: the reducer all-reduces in C++, no observer;
  ref_hook  torch's reference `allreduce_hook` (untraced): what any Python comm hook costs;
  observed  the observer's default: no hook, DDP's all-reduces counted natively (the sampling thread at
            25 Hz, observer/counts.py), the step stamps (observer/stamps.py: two forward hooks on the model, a
            step pre-hook on its optimizer), the heartbeat, `step()`, the observer process polling beside it;
  traced    the opt-in `ddp_comm_hook="traced"`: the observer's comm hook through the collective tracer, plus
            everything `observed` has;
  plain2    a second plain model: the two plain models' difference is the noise floor.
The sampling thread runs only during the observed and traced blocks (it is per process, not per model).
Times are the rank's process CPU time (all its threads: gloo's completion callbacks are counted) and wall time;
the ratio is the median over rounds of observed / plain block times (paired within a round), slowest rank.
The observer process's own CPU is reported apart (bench/hang_latency.py measures it while training).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT_DIR))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402 (after the sys.path entry above)

MODES = ("plain", "ref_hook", "observed", "traced", "plain2")


def _rank(rank: int, world: int, root: str, width: int, depth: int, batch: int, block: int, rounds: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from scout_ckpt.observer import Observer

    torch.set_num_threads(1)
    untraced = dist.all_reduce

    def ref_hook(group, bucket):  # torch's reference allreduce_hook, on the untraced call
        t = bucket.buffer()
        t.div_(group.size())
        return untraced(t, group=group, async_op=True).get_future().then(lambda f: f.value()[0])

    def make():
        torch.manual_seed(0)
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        m = DDP(nn.Sequential(*layers))
        return m, torch.optim.SGD(m.parameters(), lr=1e-4)

    models = {name: make() for name in MODES}
    models["ref_hook"][0].register_comm_hook(dist.group.WORLD, ref_hook)
    obs = Observer.start(root, rank=rank, world_size=world, run_id=f"overhead-{batch}", stall_s=600.0, poll_s=0.25)
    attached = obs.attach(*models["observed"])  # the model and its optimizer, as the Checkpointer does
    from scout_ckpt.observer.ddp import attach as attach_hook

    traced_attached = attach_hook(models["traced"][0], tracer=obs.tracer)
    obs.counter.stop()  # sampled only while an observed model trains
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank))
    n = [0]

    def run(name: str, steps: int) -> None:
        model, opt = models[name]
        for _ in range(steps):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if name in ("observed", "traced"):
                n[0] += 1
                obs.step(n[0])

    for name in MODES:  # warm-up: DDP rebuilds its buckets after the first iteration
        run(name, 5)
    counted0 = obs.counter.count()
    sampler_cpu0, sampled_wall = obs.counter.cpu_s, [0.0]
    # the default's per-step work on the training thread, alone: heartbeat.step + the count at the boundary
    t0 = time.perf_counter()
    for i in range(2000):
        obs.step(10_000 + i)
    step_call_s = (time.perf_counter() - t0) / 2000
    stamp_hooks_s = _stamp_hooks_cost(obs)
    cpu = {m: [] for m in MODES}
    wall = {m: [] for m in MODES}
    from scout_ckpt.observer.stacks import cpu_seconds

    ocpu0, owall0 = cpu_seconds(obs.pid), time.monotonic()
    seq0 = obs.tracer.seq
    for r in range(rounds):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        for name in order:
            dist.barrier()
            sampled = name in ("observed", "traced")
            c0, w0 = time.process_time(), time.perf_counter()
            if sampled:
                obs.counter.start()
            run(name, block)
            if sampled:
                obs.counter.stop()
                sampled_wall[0] += time.perf_counter() - w0
            cpu[name].append((time.process_time() - c0) / block)
            wall[name].append((time.perf_counter() - w0) / block)
    observer_cpu = (cpu_seconds(obs.pid) - ocpu0) / (time.monotonic() - owall0)
    traced = obs.tracer.seq - seq0
    counted = obs.counter.count() - counted0
    sampler_cpu_per_s = (obs.counter.cpu_s - sampler_cpu0) / max(sampled_wall[0], 1e-9)
    obs.stop()
    dist.barrier()
    return {
        "cpu": cpu,
        "wall": wall,
        "attached": attached,
        "traced_attached": traced_attached,
        "traced_per_step": traced / (rounds * block),
        "counted_per_step": counted / (rounds * block * len(MODES)),
        "sampler_cpu_per_s": sampler_cpu_per_s,
        "step_call_s": step_call_s,
        "stamp_hooks_s": stamp_hooks_s,
        "observer_process_cpu": observer_cpu,
    }


def _stamp_hooks_cost(obs, n: int = 200, repeats: int = 30) -> float:
    """Seconds per step the step stamps add on the training thread, through torch's own hook dispatch: a
    1-parameter module's forward and its optimizer's step, in blocks of n with the stamp hooks registered and
    without, alternating; the difference of the two fastest blocks' times per step (this thread's CPU; the
    machine's load only ever adds, and a 1% question cannot be resolved from paired step times here)."""
    import torch
    import torch.nn as nn

    from scout_ckpt.observer.stamps import StepStamps

    m = nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    x = torch.zeros(1, 1)
    best = {False: float("inf"), True: float("inf")}
    with torch.no_grad():
        for _ in range(repeats):
            for hooked in (False, True):
                stamps = StepStamps(obs.heartbeat, obs.counter, m, opt) if hooked else None
                t0 = time.thread_time()
                for _i in range(n):
                    opt.step()
                    m(x)
                    obs.heartbeat._step += 1  # a new step each time, so that every stamp is written
                best[hooked] = min(best[hooked], (time.thread_time() - t0) / n)
                if stamps is not None:
                    stamps.remove()
    return max(0.0, best[True] - best[False])


def _paired(samples: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(samples[a], samples[b]))


def measure(ranks: int, width: int, depth: int, batch: int, block: int, rounds: int) -> dict:
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.testing.launch import run_ranks

    with tempfile.TemporaryDirectory(prefix="scout-obs-overhead-") as tmp:
        Ledger.open(tmp, create=True).close()
        outs = [o.result for o in run_ranks(_rank, ranks, tmp, width, depth, batch, block, rounds, timeout=1800)]
    per_rank = []
    for res in outs:
        per_rank.append(
            {kind: {f"{m}_vs_plain": _paired(res[kind], m, "plain") for m in MODES[1:]} for kind in ("cpu", "wall")}
        )
    worst = {kind: {k: max(p[kind][k] for p in per_rank) for k in per_rank[0][kind]} for kind in ("cpu", "wall")}
    step_ms = statistics.median(statistics.median(r["cpu"]["plain"]) for r in outs) * 1e3
    # The default's cost from its parts, measured directly (immune to the machine's load, which swamps a 1%
    # difference of paired step times here): the sampling thread's CPU per second of training times the step's
    # wall time, plus the per-step calls and the step-stamp hooks, over the plain step's CPU time; the slowest rank.
    parts = max(
        (r["sampler_cpu_per_s"] * statistics.median(r["wall"]["plain"]) + r["step_call_s"] + r["stamp_hooks_s"])
        / statistics.median(r["cpu"]["plain"])
        for r in outs
    )
    return {
        "batch": batch,
        "step_cpu_ms_plain": round(step_ms, 3),
        "worst_rank": worst,
        "per_rank": per_rank,
        "observed_parts_vs_plain_cpu": round(1 + parts, 5),
        "sampler_cpu_per_s": max(r["sampler_cpu_per_s"] for r in outs),
        "step_call_us": round(max(r["step_call_s"] for r in outs) * 1e6, 2),
        "stamp_hooks_us": round(max(r["stamp_hooks_s"] for r in outs) * 1e6, 2),
        "attached": outs[0]["attached"],
        "traced_attached": outs[0]["traced_attached"],
        "traced_per_step": outs[0]["traced_per_step"],
        "counted_per_step": outs[0]["counted_per_step"],
        "observer_process_cpu": max(r["observer_process_cpu"] for r in outs),
    }


def main() -> int:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", default="32,256", help="comma-separated batch sizes; the first is the headline")
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--rounds", type=int, default=12)
    args = C.parse_args(p, {"width": 32, "depth": 1, "batch": "4", "block": 2, "rounds": 1})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    configs = [
        measure(args.ranks, args.width, args.depth, int(b), args.block, args.rounds) for b in args.batch.split(",")
    ]
    ratios = {}
    for c in configs:
        for kind in ("cpu", "wall"):
            for k, v in c["worst_rank"][kind].items():
                ratios[f"{k}_{kind}_b{c['batch']}"] = round(v, 4)
    for c in configs:
        ratios[f"observed_parts_vs_plain_cpu_b{c['batch']}"] = c["observed_parts_vs_plain_cpu"]
    head = configs[0]["worst_rank"]["cpu"]["observed_vs_plain"]
    result = {
        "ratio": round(head, 4),
        "ratios": ratios,
        "target": "observed_vs_plain_cpu <= 1.01 (cost per step < 1%)",
        "target_met": head <= 1.01,
        # the paired ratio is within the noise floor (plain2_vs_plain) on a loaded machine; the cost from its
        # measured parts (the sampling thread's CPU, the per-step calls, the stamp hooks) is the resolvable figure
        "target_met_by_parts": all(c["observed_parts_vs_plain_cpu"] <= 1.01 for c in configs),
        "configs": configs,
        "params": {
            "ranks": args.ranks,
            "width": args.width,
            "depth": args.depth,
            "block": args.block,
            "rounds": args.rounds,
            **C.load_note(),
        },
    }
    rows = [
        [
            c["batch"],
            c["step_cpu_ms_plain"],
            *(
                round(100 * (c["worst_rank"][kind][f"{m}_vs_plain"] - 1), 2)
                for kind in ("cpu", "wall")
                for m in ("ref_hook", "observed", "traced", "plain2")
            ),
        ]
        for c in configs
    ]
    C.emit(
        result,
        args,
        rows,
        [
            "batch",
            "step_cpu_ms",
            "ref_hook_cpu_%",
            "observed_cpu_%",
            "traced_cpu_%",
            "noise_cpu_%",
            "ref_hook_wall_%",
            "observed_wall_%",
            "traced_wall_%",
            "noise_wall_%",
        ],
        title=f"observer cost per DDP step, {args.ranks} gloo ranks, MLP {args.depth}x{args.width} "
        f"(% over plain DDP, median of {args.rounds} paired rounds, slowest rank)",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
