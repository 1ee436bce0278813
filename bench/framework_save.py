"""What a framework user's save costs: each scout-ckpt drop-in against the framework's own save, same state, same run.

A user of DeepSpeed, Megatron-Core, TorchTitan, Lightning or Accelerate feels scout-ckpt as the time its drop-in
adds to the save they already make. Per framework, a user-shaped training script (`bench/_framework_<fw>.py`)
runs under torchrun on 2 CPU/gloo ranks and, every few optimizer steps, saves the same state twice: with the
framework's own save and with the drop-in as its docs page gives it, with the defaults; the order alternates round
by round, so load from other processes hits both alike. A save's time is the slowest rank's, from a barrier to its
return.

  deepspeed   ZeRO-1, `engine.save_checkpoint(dir)` with DeepSpeed's own checkpoint engine, and the same call after
              `install(engine, save_dir)`
  megatron    TP=1 DP=2, a GPTModel in Megatron's DistributedDataParallel and a torch AdamW, their sharded state:
              `dist_checkpointing.save` plus Megatron-LM's tracker, and `MegatronCheckpointer(save_dir,
              model=[model]).save(iteration, sd)` (replay on, as by default)
  torchtitan  FSDP2 on TorchTitan's ParallelDims: its DCP `CheckpointManager` and `ScoutCheckpointManager`
  lightning   DDP: what `trainer.save_checkpoint` does under `DDPStrategy`, and the same call under
              `ScoutDDPStrategy`
  accelerate  DDP, GPT-2: `accelerator.save_state(dir)`, and `ScoutCheckpointing(accelerator, root).save(step)`

Two sizes: `tiny` (each framework's smallest sensible model: the one its integration test trains) and `large`
(at least 100 MB of parameters and optimizer state per rank: a transformer of --width/--layers where each rank holds
the model, of --sharded-width/--sharded-layers under FSDP2). Figures per framework: `ratios.save_vs_framework_<fw>_large`
(the drop-in's median save time over the framework's own, large; goal <= 1.3) and `fixed_overhead_s_<fw>` (the
median over rounds of the drop-in's save minus the framework's own in the same round, tiny; goal <= 0.05 s), with
the medians, spreads and samples behind them, the state bytes per rank, the bytes each save wrote, the CPU seconds
of a save, the scout verdicts, and the versions. A framework whose packages are not installed is reported as
`"skipped"` with the reason; one whose job fails is reported as `"failed"` (and the bench exits 1 after printing).

    python bench/framework_save.py [--json] [--smoke] [--frameworks deepspeed,megatron,torchtitan,lightning,accelerate]
        [--sizes tiny,large] [--rounds 4] [--tiny-rounds 8] [--warmup 1] [--steps-per-save 2] [--width 512]
        [--layers 4] [--sharded-width 768] [--sharded-layers 3] [--timeout-s 600] [--profile DIR]

--smoke: both sizes at a tiny model, one save each, every framework: proves each job runs and prints its keys.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import BENCH_DIR, REPO, emit, log, parse_args, parser  # noqa: E402

GOAL = 1.3
FIXED_GOAL_S = 0.05
LARGE_MIN_BYTES = 100 * 10**6
# framework -> (modules its job imports, distributions whose versions are reported, the scout-ckpt extra)
FRAMEWORKS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "deepspeed": (("deepspeed",), ("deepspeed",), "deepspeed"),
    "megatron": (("megatron.core", "psutil"), ("megatron-core",), "megatron"),
    "torchtitan": (("torchtitan",), ("torchtitan",), "torchtitan"),
    "lightning": (("lightning",), ("lightning",), "lightning"),
    "accelerate": (("accelerate", "transformers"), ("accelerate", "transformers"), "transformers"),
}
JOB_OPTIONS = (
    "sizes",
    "rounds",
    "tiny_rounds",
    "warmup",
    "steps_per_save",
    "width",
    "layers",
    "sharded_width",
    "sharded_layers",
)


def missing(fw: str) -> str | None:
    """Why `fw` cannot run here (a module its job imports is not installed), or None."""
    for module in FRAMEWORKS[fw][0]:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package of a dotted name is absent
            found = False
        if not found:
            return f"{module} is not installed (pip install 'scout-ckpt[{FRAMEWORKS[fw][2]}]')"
    return None


def versions(fw: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for d in ("torch", *FRAMEWORKS[fw][1]):
        try:
            out[d] = importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            out[d] = None
    return out


def run_job(fw: str, args, work: str) -> dict:
    """The framework's job under torchrun (2 ranks); its result per size, or {"failed": reason}."""
    out = os.path.join(work, "result.json")
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in JOB_OPTIONS]
    if args.profile:
        os.makedirs(os.path.abspath(args.profile), exist_ok=True)
        flags.append(f"--profile={os.path.abspath(args.profile)}")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.5",
        str(BENCH_DIR / f"_framework_{fw}.py"),
        f"--out={out}",
        *flags,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # restarts aside, a fresh rendezvous per job (docs/integrate.md)
        "OMP_NUM_THREADS": "1",
    }
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s, cwd=work)
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {args.timeout_s:.0f} s"}
    if p.returncode != 0 or not os.path.exists(out):
        tail = [ln for ln in (p.stderr or p.stdout).strip().splitlines() if ln.strip()][-12:]
        log(f"{fw}: exit {p.returncode}\n  " + "\n  ".join(tail))
        return {"failed": f"exit {p.returncode}: " + (tail[-1] if tail else "no output")}
    with open(out) as f:
        return json.load(f)


def spread(xs: list[float]) -> dict:
    return {"min": min(xs), "max": max(xs), "mad": statistics.median(abs(x - statistics.median(xs)) for x in xs)}


def summarize(size_result: dict) -> dict:
    """One size of one framework: the medians, spreads and the paired difference behind its figures."""
    s = size_result["samples_s"]
    fw_s, scout_s = statistics.median(s["framework"]), statistics.median(s["scout"])
    beyond = [a - b for a, b in zip(s["scout"], s["framework"])]
    return {
        **size_result,
        "framework_s": fw_s,
        "scout_s": scout_s,
        "ratio": scout_s / fw_s,
        "beyond_framework_s": statistics.median(beyond),
        "spread_s": {"framework": spread(s["framework"]), "scout": spread(s["scout"]), "beyond": spread(beyond)},
        "cpu_vs_framework": size_result["cpu_s"]["scout"] / size_result["cpu_s"]["framework"],
    }


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated: " + ", ".join(FRAMEWORKS))
    ap.add_argument("--sizes", default="tiny,large", help="tiny, large (comma-separated)")
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds at the large size")
    ap.add_argument("--tiny-rounds", type=int, default=8, help="timed rounds at the tiny size")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds before them")
    ap.add_argument("--steps-per-save", type=int, default=2, help="optimizer steps between rounds")
    ap.add_argument("--width", type=int, default=512, help="large: the replicated transformer's width")
    ap.add_argument("--layers", type=int, default=4, help="large: the replicated transformer's blocks")
    ap.add_argument("--sharded-width", type=int, default=768, help="large: the FSDP2 transformer's width")
    ap.add_argument("--sharded-layers", type=int, default=3, help="large: the FSDP2 transformer's blocks")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per framework")
    ap.add_argument(
        "--profile", metavar="DIR", help="cProfile of the drop-in's timed saves: DIR/<fw>-<size>-rankR.prof"
    )
    smoke = {
        "rounds": 1,
        "tiny_rounds": 1,
        "warmup": 0,
        "steps_per_save": 1,
        "width": 32,
        "layers": 1,
        "sharded_width": 32,
        "sharded_layers": 1,
    }
    args = parse_args(ap, smoke)
    wanted = [f for f in args.frameworks.split(",") if f]
    unknown = sorted(set(wanted) - set(FRAMEWORKS))
    if unknown:
        print(f"error: unknown framework {', '.join(unknown)} (known: {', '.join(FRAMEWORKS)})", file=sys.stderr)
        raise SystemExit(2)
    for name in ("rounds", "tiny_rounds", "steps_per_save", "width", "layers", "sharded_width", "sharded_layers"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            raise SystemExit(2)
    if args.warmup < 0:
        print("error: --warmup must be at least 0", file=sys.stderr)
        raise SystemExit(2)
    sizes = args.sizes.split(",")
    if not sizes or set(sizes) - {"tiny", "large"}:
        print(f"error: --sizes takes tiny, large (got {args.sizes!r})", file=sys.stderr)
        raise SystemExit(2)

    load_start, started = os.getloadavg(), time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    frameworks: dict[str, dict] = {}
    ratios: dict[str, float] = {}
    fixed: dict[str, float] = {}
    met: dict[str, bool] = {}
    rows = []
    for fw in wanted:
        entry: dict = {"versions": versions(fw)}
        frameworks[fw] = entry
        why = missing(fw)
        if why:
            entry["skipped"] = why
            log(f"{fw}: skipped: {why}")
            continue
        work = tempfile.mkdtemp(prefix=f"scout-bench-fw-{fw}-")
        t0 = time.perf_counter()
        log(f"{fw}: sizes {args.sizes}, 2 ranks under torchrun ...")
        try:
            res = run_job(fw, args, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        entry["wall_s"] = round(time.perf_counter() - t0, 1)
        if "failed" in res:
            entry["failed"] = res["failed"]
            continue
        for size in sizes:
            r = entry[size] = summarize(res[size])
            if size == "large":
                key = f"save_vs_framework_{fw}_large"
                ratios[key] = r["ratio"]
                met[key] = r["ratio"] <= GOAL and r["state_bytes_per_rank"] >= LARGE_MIN_BYTES
            else:
                ratios[f"save_vs_framework_{fw}"] = r["ratio"]
                fixed[fw] = r["beyond_framework_s"]
                met[f"fixed_overhead_s_{fw}"] = r["beyond_framework_s"] <= FIXED_GOAL_S
            rows.append(
                (
                    fw,
                    size,
                    f"{r['state_bytes_per_rank'] / 1e6:.1f}",
                    f"{r['framework_s']:.3f}",
                    f"{r['scout_s']:.3f}",
                    f"{r['ratio']:.2f}",
                    f"{r['beyond_framework_s']:.3f}",
                    f"{r['spread_s']['framework']['min']:.3f}-{r['spread_s']['framework']['max']:.3f}",
                    f"{r['spread_s']['scout']['min']:.3f}-{r['spread_s']['scout']['max']:.3f}",
                    f"{r['cpu_s']['framework']:.3f} / {r['cpu_s']['scout']:.3f}",
                    ",".join(sorted({str(v) for v in r["verdicts"]})),
                )
            )
    not_run = {
        fw: e.get("skipped") or e.get("failed") for fw, e in frameworks.items() if "skipped" in e or "failed" in e
    }
    large = [e["large"] for e in frameworks.values() if "large" in e]
    result = {
        "ratio": max((v for k, v in ratios.items() if k.endswith("_large")), default=None),
        "ratios": ratios,
        **{f"fixed_overhead_s_{fw}": v for fw, v in fixed.items()},
        "frameworks": frameworks,
        "skipped": {fw: e["skipped"] for fw, e in frameworks.items() if "skipped" in e},
        "failed": {fw: e["failed"] for fw, e in frameworks.items() if "failed" in e},
        "targets_met": met,
        "target": f"save_vs_framework_<fw>_large <= {GOAL} at >= 100 MB per rank, fixed_overhead_s_<fw> <= "
        f"{FIXED_GOAL_S} s, every framework measured",
        "target_met": bool(met) and all(met.values()) and not not_run,
        "large_state_at_least_100mb": bool(large) and all(r["state_bytes_per_rank"] >= LARGE_MIN_BYTES for r in large),
        "ranks": 2,
        "sizes": sizes,
        "rounds": args.rounds,
        "tiny_rounds": args.tiny_rounds,
        "warmup": args.warmup,
        "steps_per_save": args.steps_per_save,
        "width": args.width,
        "layers": args.layers,
        "sharded_width": args.sharded_width,
        "sharded_layers": args.sharded_layers,
        "torch": importlib.metadata.version("torch"),
        "started": started,
        "ended": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "cores": os.cpu_count() or 1,
        "command": " ".join(["python", "bench/framework_save.py", *sys.argv[1:]]),
    }
    emit(
        result,
        args,
        rows,
        [
            "framework",
            "size",
            "state MB/rank",
            "own save s",
            "scout save s",
            "ratio",
            "beyond s",
            "own min-max",
            "scout min-max",
            "CPU s own / scout",
            "verdicts",
        ],
        title="a framework user's save (2 ranks): the scout-ckpt drop-in (defaults) over the framework's own save",
    )
    if not args.json:
        for fw, v in fixed.items():
            print(f"fixed_overhead_s_{fw}: {v:.3f} (goal <= {FIXED_GOAL_S})")
        for fw, why in not_run.items():
            print(f"{fw}: {'skipped' if 'skipped' in frameworks[fw] else 'failed'}: {why}")
    if result["failed"]:
        print(f"error: failed: {', '.join(result['failed'])}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
