"""The fast tier against the durable tier alone: time from a fault to training again, and how long a save blocks.

One user-shaped DDP job (tests/scripts/fast_tier_job.py, torchrun, 2 ranks, gloo on CPU, --step-sleep standing in
for each step's compute) runs twice on the same machine, each time SIGKILLed once at --fault-step and restarted by
torchrun: with the fast tier (local saves every --local-every steps to a node-local directory, plus the same async
durable saves every --save-every) and without it (the durable saves alone). Measured from the job's own lines:

  restart_fast_vs_durable       (fault -> the job is again at the step it had reached when it died, i.e. making
                                new progress: restart, load and the lost steps redone) with the fast tier, over
                                the same without it. Goal <= 0.5.
  save_blocking_local_vs_async  median time `ckpt.step(step, state)` blocks on a local save (the staging copy and
                                the live evidence; serialize, digest, write, peer copy and commit run in the tier's
                                commit thread) over the median time an async durable `save()` blocks. Goal <= 1.0.
                                (`save_blocking_local_own_vs_async`: the same with LocalTier.save's own time, i.e.
                                without the per-step hook's other work, for comparison.)
  lost steps                    steps redone after the restart (the fault step less the step loaded), per tier.

Each pair runs with the durable tier in two places (--durable both, the default): a local POSIX directory
(`restart_fast_vs_durable`, the fast tier's least favourable case: no shared store is as near), and an S3 bucket
on moto's standalone S3 server started here, as the S3 tests start it (`restart_fast_vs_durable_s3`: the durable
tier as a shared store would be, the ledger in a local ledger_dir; an HTTP server on the same host, so still
nearer and faster than a real object store).

    python bench/fast_tier.py [--json] [--steps 60] [--save-every 30] [--local-every 2] [--fault-step 59]
                              [--step-sleep 1.0] [--width 32768] [--ranks 2] [--durable both|posix|s3]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO, emit, load_note, log, parse_args, parser, run_checked  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "fast_tier_job.py"
GOALS = {"restart_fast_vs_durable": 0.5, "restart_fast_vs_durable_s3": 0.5, "save_blocking_local_vs_async": 1.0}
BUCKET = "scout-bench"
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    """moto's standalone S3 server on 127.0.0.1, in this process (as tests/test_s3.py starts it), one bucket."""

    def __enter__(self) -> "S3Server":
        import logging

        import moto.server as moto_server
        import s3fs

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise, on stderr
        os.environ.update(CREDS)
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        s3fs.S3FileSystem(client_kwargs={"endpoint_url": self.endpoint}, skip_instance_cache=True).mkdir(BUCKET)
        return self

    def uri(self) -> str:
        return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"

    def __exit__(self, *exc) -> None:
        self.server.stop()


def _lines(out: str) -> list[dict]:
    dec = json.JSONDecoder()
    return [dec.raw_decode(chunk)[0] for chunk in out.split("FT-JOB ")[1:]]


def _run(work: Path, fast: bool, args, s3: S3Server | None = None) -> dict:
    """One job, SIGKILLed once and restarted by torchrun; with `s3` its durable tier is a fresh prefix there
    (ROOT then holds only the ledger)."""
    root, local = work / ("fast" if fast else "durable"), work / "local"
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(args.ranks),
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.2",
        str(SCRIPT),
        str(root),
        "--local-dir",
        str(local),
        "--steps",
        str(args.steps),
        "--save-every",
        str(args.save_every),
        "--local-every",
        str(args.local_every),
        "--fault",
        "crash",
        "--fault-node",
        "0",
        "--fault-local",
        str(args.ranks - 1),
        "--fault-step",
        str(args.fault_step),
        "--step-sleep",
        str(args.step_sleep),
        "--width",
        str(args.width),
        "--async-save",
    ] + ([] if fast else ["--no-local"])
    if s3 is not None:
        cmd += ["--uri", s3.uri(), "--endpoint", s3.endpoint]
    env = {
        **os.environ,
        **CREDS,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    res = run_checked(
        cmd, f"the {'fast-tier' if fast else 'durable-only'} job{' (S3)' if s3 else ''}", timeout=900, env=env
    )
    lines = [e for e in _lines(res.stdout) if e.get("rank") == 0]
    fault = json.loads((root / "fault.json").read_text())
    loads = [i for i, e in enumerate(lines) if e["event"] == "loaded"]
    if len(loads) != 2:
        raise SystemExit(f"error: expected one restart, saw {len(loads) - 1}")
    after = lines[loads[1] :]
    loaded = after[0]
    back = next(e for e in after if e["event"] == "at" and e["step"] == args.fault_step)
    first = next(e for e in after if e["event"] == "at")
    return {
        "recovered_s": back["time"] - fault["time"],
        "first_step_s": first["time"] - fault["time"],
        # fault -> the Checkpointer's start-up begins (torchrun's respawn, imports, the process group), -> it
        # ends, -> the load has ended
        "began_s": loaded["began"] - fault["time"],
        "ready_s": loaded["ready"] - fault["time"],
        "loaded_s": loaded["time"] - fault["time"],
        "loaded_step": loaded["step"],
        "tier": loaded["tier"],
        "lost_steps": args.fault_step - loaded["step"],
        "local_blocking_s": [e["blocking_s"] for e in lines if e["event"] == "local_saved"],
        # LocalTier.save's own time (from its wait for the previous commit to the commit thread's start): step()
        # less the per-step hook's other work
        "local_own_blocking_s": [e["own_s"] for e in lines if e["event"] == "local_saved" and e.get("own_s")],
        "durable_blocking_s": [e["blocking_s"] for e in lines if e["event"] == "saved"],
        "phases": [e["phases"] for e in lines if e["event"] == "local_saved" and e.get("phases")],
    }


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc) -> None:
        return None


def _median_of(runs: list[dict]) -> dict:
    """The runs' medians (times), their lists pooled (blocking times, phases), the rest from the first run."""
    out = dict(runs[0])
    for k in ("recovered_s", "first_step_s", "began_s", "ready_s", "loaded_s", "lost_steps"):
        out[k] = statistics.median(r[k] for r in runs)
    for k in ("local_blocking_s", "local_own_blocking_s", "durable_blocking_s", "phases"):
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
    p.add_argument(
        "--durable",
        choices=["both", "posix", "s3"],
        default="both",
        help="where the durable tier lives: a local directory, moto's S3 server, or each in turn",
    )
    args = parse_args(
        p,
        {
            "steps": 6,
            "save_every": 3,
            "local_every": 1,
            "fault_step": 5,
            "step_sleep": 0.01,
            "width": 64,
            "repeats": 1,
            "durable": "posix",
        },
    )
    work = Path(tempfile.mkdtemp(prefix="fast-tier-bench-"))
    places = ["posix", "s3"] if args.durable == "both" else [args.durable]
    runs: dict[tuple[str, bool], list[dict]] = {(pl, f): [] for pl in places for f in (True, False)}
    try:
        with S3Server() if "s3" in places else _Nothing() as s3:
            for i in range(args.repeats):  # interleaved: a burst of load from other processes hits all alike
                for pl in places:
                    for fast in (True, False):
                        log(
                            f"round {i + 1}/{args.repeats}: {'fast tier' if fast else 'durable-only'} run, "
                            f"durable tier on {pl} ..."
                        )
                        runs[(pl, fast)].append(_run(work, fast, args, s3 if pl == "s3" else None))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    params = {
        k: getattr(args, k)
        for k in (
            "ranks",
            "steps",
            "save_every",
            "local_every",
            "fault_step",
            "step_sleep",
            "width",
            "repeats",
            "durable",
        )
    }
    state_mb = (32 * args.width + args.width + args.width * 8 + 8) * 4 * 3 / 2**20  # params + AdamW moments
    result = {
        "ratios": {},
        "goals": {},
        "met": {},
        "params": {**params, "state_mb_per_rank": state_mb},
        "lost_steps": {},
        "load": load_note(),
    }
    rows = []
    for pl in places:
        fast, durable = _median_of(runs[(pl, True)]), _median_of(runs[(pl, False)])
        sfx = "" if pl == "posix" else "_s3"
        async_blocking = statistics.median(fast["durable_blocking_s"] + durable["durable_blocking_s"])
        local_blocking = statistics.median(fast["local_blocking_s"])
        own_blocking = statistics.median(fast["local_own_blocking_s"]) if fast["local_own_blocking_s"] else None
        result["ratios"].update(
            {
                f"restart_fast_vs_durable{sfx}": fast["recovered_s"] / durable["recovered_s"],
                f"save_blocking_local_vs_async{sfx}": local_blocking / async_blocking,
                f"first_step_fast_vs_durable{sfx}": fast["first_step_s"] / durable["first_step_s"],
                f"save_blocking_local_own_vs_async{sfx}": None
                if own_blocking is None
                else own_blocking / async_blocking,
            }
        )
        result[f"fast{sfx}"] = {k: v for k, v in fast.items() if not k.endswith("blocking_s") and k != "phases"}
        result[f"durable{sfx}"] = {k: v for k, v in durable.items() if not k.endswith("blocking_s") and k != "phases"}
        result[f"local_save_phases_s_median{sfx}"] = {
            k: statistics.median(p[k] for p in fast["phases"]) for k in (fast["phases"][0] if fast["phases"] else {})
        }
        result[f"local_save_blocking_s_median{sfx}"] = local_blocking
        result[f"local_save_own_blocking_s_median{sfx}"] = own_blocking
        result[f"async_save_blocking_s_median{sfx}"] = async_blocking
        result["lost_steps"][pl] = {"fast": fast["lost_steps"], "durable": durable["lost_steps"]}
        rows += [
            [f"[{pl}] fault -> back at the fault step (s)", fast["recovered_s"], durable["recovered_s"]],
            [f"[{pl}] fault -> first step (s)", fast["first_step_s"], durable["first_step_s"]],
            [
                f"[{pl}] loaded step (tier)",
                f"{fast['loaded_step']} ({fast['tier']})",
                f"{durable['loaded_step']} ({durable['tier']})",
            ],
            [f"[{pl}] lost steps (redone)", fast["lost_steps"], durable["lost_steps"]],
            [
                f"[{pl}] save blocks (s, median)",
                f"{local_blocking:.4f} (local)",
                f"{async_blocking:.4f} (async durable)",
            ],
        ]
    goals = {k: g for k, g in GOALS.items() if k in result["ratios"]}
    result["goals"] = goals
    result["met"] = {k: result["ratios"][k] <= g for k, g in goals.items()}
    met = result["met"]
    emit(result, args, rows, ["", "fast tier", "durable only"], title="fast tier vs durable tier")
    if not args.json:
        for k, g in goals.items():
            print(f"goal {k} <= {g}: {'met' if met[k] else 'missed'}")


if __name__ == "__main__":
    main()
