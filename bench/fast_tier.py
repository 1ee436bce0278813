"""The fast tier against the durable tier alone: time from a fault to training again, and how long a save blocks.

One user-shaped DDP job (tests/scripts/fast_tier_job.py, torchrun, 2 ranks, gloo on CPU, --step-sleep standing in
for each step's compute) runs twice on the same machine, each time SIGKILLed once at --fault-step and restarted by
torchrun: with the fast tier (local saves every --local-every steps to a node-local directory, plus the same async
durable saves every --save-every) and without it (the durable saves alone). Measured from the job's own lines:

  restart_fast_vs_durable       (fault -> the job is again at the step it had reached when it died, i.e. making
                                new progress: restart, load and the lost steps redone) with the fast tier, over
                                the same without it. Goal <= 0.5.
  save_blocking_local_vs_async  median time `ckpt.step(step, state)` blocks on a local save (serialize, digest,
                                write, peer copy, the evidence and the commit) over the median time an async
                                durable `save()` blocks. Goal <= 1.0.
  lost steps                    steps redone after the restart (the fault step less the step loaded), per tier.

The durable tier here is a local POSIX directory, not a shared store: on a real shared filesystem or object store
its restart is slower, so the restart ratio here is the fast tier's least favourable case.

    python bench/fast_tier.py [--json] [--steps 60] [--save-every 30] [--local-every 2] [--fault-step 59]
                              [--step-sleep 1.0] [--width 32768] [--ranks 2]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO, emit, load_note, log, parser, run_checked  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "fast_tier_job.py"
GOALS = {"restart_fast_vs_durable": 0.5, "save_blocking_local_vs_async": 1.0}


def _lines(out: str) -> list[dict]:
    dec = json.JSONDecoder()
    return [dec.raw_decode(chunk)[0] for chunk in out.split("FT-JOB ")[1:]]


def _run(work: Path, fast: bool, args) -> dict:
    root, local = work / ("fast" if fast else "durable"), work / "local"
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--max-restarts",
           "1", "--monitor-interval", "0.2", str(SCRIPT), str(root), "--local-dir", str(local),
           "--steps", str(args.steps), "--save-every", str(args.save_every), "--local-every", str(args.local_every),
           "--fault", "crash", "--fault-node", "0", "--fault-local", str(args.ranks - 1),
           "--fault-step", str(args.fault_step), "--step-sleep", str(args.step_sleep), "--width", str(args.width),
           "--async-save"] + ([] if fast else ["--no-local"])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    res = run_checked(cmd, f"the {'fast-tier' if fast else 'durable-only'} job", timeout=900, env=env)
    lines = [e for e in _lines(res.stdout) if e.get("rank") == 0]
    fault = json.loads((root / "fault.json").read_text())
    loads = [i for i, e in enumerate(lines) if e["event"] == "loaded"]
    if len(loads) != 2:
        raise SystemExit(f"error: expected one restart, saw {len(loads) - 1}")
    after = lines[loads[1]:]
    loaded = after[0]
    back = next(e for e in after if e["event"] == "at" and e["step"] == args.fault_step)
    first = next(e for e in after if e["event"] == "at")
    return {
        "recovered_s": back["time"] - fault["time"],
        "first_step_s": first["time"] - fault["time"],
        "loaded_step": loaded["step"], "tier": loaded["tier"],
        "lost_steps": args.fault_step - loaded["step"],
        "local_blocking_s": [e["blocking_s"] for e in lines if e["event"] == "local_saved"],
        "durable_blocking_s": [e["blocking_s"] for e in lines if e["event"] == "saved"],
        "phases": [e["phases"] for e in lines if e["event"] == "local_saved" and e.get("phases")],
    }


def _median_of(runs: list[dict]) -> dict:
    """The runs' medians (times), their lists pooled (blocking times, phases), the rest from the first run."""
    out = dict(runs[0])
    for k in ("recovered_s", "first_step_s", "lost_steps"):
        out[k] = statistics.median(r[k] for r in runs)
    for k in ("local_blocking_s", "durable_blocking_s", "phases"):
        out[k] = [x for r in runs for x in r[k]]
    out["runs_recovered_s"] = [r["recovered_s"] for r in runs]
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=30)
    p.add_argument("--local-every", type=int, default=2)
    p.add_argument("--fault-step", type=int, default=59)
    p.add_argument("--step-sleep", type=float, default=1.0)
    p.add_argument("--width", type=int, default=32768, help="hidden width of the job's MLP (state size)")
    p.add_argument("--repeats", type=int, default=2, help="pairs of runs, interleaved; medians are reported")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fast-tier-bench-"))
    fasts, durables = [], []
    try:
        for i in range(args.repeats):   # interleaved: a burst of load from other processes hits both alike
            log(f"round {i + 1}/{args.repeats}: fast tier run ...")
            fasts.append(_run(work, True, args))
            log(f"round {i + 1}/{args.repeats}: durable-only run ...")
            durables.append(_run(work, False, args))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fast, durable = _median_of(fasts), _median_of(durables)
    async_blocking = statistics.median(fast["durable_blocking_s"] + durable["durable_blocking_s"])
    local_blocking = statistics.median(fast["local_blocking_s"])
    ratios = {"restart_fast_vs_durable": fast["recovered_s"] / durable["recovered_s"],
              "save_blocking_local_vs_async": local_blocking / async_blocking,
              "first_step_fast_vs_durable": fast["first_step_s"] / durable["first_step_s"]}
    met = {k: ratios[k] <= g for k, g in GOALS.items()}
    params = {k: getattr(args, k) for k in ("ranks", "steps", "save_every", "local_every", "fault_step",
                                            "step_sleep", "width", "repeats")}
    state_mb = (32 * args.width + args.width + args.width * 8 + 8) * 4 * 3 / 2**20   # params + AdamW moments
    result = {"ratios": ratios, "goals": GOALS, "met": met, "params": {**params, "state_mb_per_rank": state_mb},
              "fast": {k: v for k, v in fast.items() if not k.endswith("blocking_s") and k != "phases"},
              "durable": {k: v for k, v in durable.items() if not k.endswith("blocking_s") and k != "phases"},
              "local_save_phases_s_median": {k: statistics.median(p[k] for p in fast["phases"])
                                             for k in (fast["phases"][0] if fast["phases"] else {})},
              "local_save_blocking_s_median": local_blocking, "async_save_blocking_s_median": async_blocking,
              "lost_steps": {"fast": fast["lost_steps"], "durable": durable["lost_steps"]}, "load": load_note()}
    rows = [["fault -> back at the fault step (s)", fast["recovered_s"], durable["recovered_s"]],
            ["fault -> first step (s)", fast["first_step_s"], durable["first_step_s"]],
            ["loaded step (tier)", f"{fast['loaded_step']} ({fast['tier']})",
             f"{durable['loaded_step']} ({durable['tier']})"],
            ["lost steps (redone)", fast["lost_steps"], durable["lost_steps"]],
            ["save blocks (s, median)", f"{local_blocking:.4f} (local)", f"{async_blocking:.4f} (async durable)"]]
    emit(result, args, rows, ["", "fast tier", "durable only"], title="fast tier vs durable tier")
    if not args.json:
        for k, g in GOALS.items():
            print(f"goal {k} <= {g}: {'met' if met[k] else 'missed'}")


if __name__ == "__main__":
    main()
