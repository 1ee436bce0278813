"""`make bench`: every bench script, one after another, each with --json; one summary table.
`make bench-smoke` (`--smoke`): every bench at a tiny size, to prove each still runs and prints its JSON.

Benches run sequentially (they time processes; running two at once on 2 cores would measure the scheduler).
Each gets its share of a total time budget, so `make bench` ends within 55 minutes even when one hangs (about 47
when none does: replay's cost over save intervals of 100 and 200 steps about 19 of them, the fast tier's eight
paced runs about 12, the framework bench 2.5).
Each bench runs in a session of its own: one that runs out of time is killed with every process it started (its
torchrun or multiprocessing workers), so that none of them loads the machine under the benches after it. A bench
that fails, prints no JSON, or runs out of time is reported as failed with its stderr tail, and run_all then
exits 1. Writes bench/results/summary.json and bench/results/summary.md, and prints the markdown: one line with
the commit measured, the dates and the load average over the run, then per bench its headline beside its target,
met or missed (the bench's own judgement, `target_met`), the load when it started, the date and the command.

`--smoke` runs every bench, the campaign and the torture included, with its `--smoke` flag (bench/replay_cost.py:
its `--quick`), a tiny size each, one after another. A bench fails the smoke run when it exits non-zero, prints
no JSON object, or leaves out a key CONTRACT_KEYS names for it (keys that readers of the JSON rely on); a missed
target never fails it (a smoke run's figures mean nothing: targets are `make bench`'s). The campaign's extension
modules (bench/campaign_*.py) are not run alone: the campaign imports every one of them and runs one incident.
Writes bench/results/smoke.json and smoke.md instead of the summary, and the campaign's and torture's own
results to a temporary directory, so that a smoke run never overwrites the figures of a real one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from scout_ckpt.format.layout import atomic_write_bytes  # noqa: E402

# Size flags that keep the whole run under the budget.
FLAGS: dict[str, list[str]] = {
    "consensus_overhead.py": ["--saves", "3", "--rounds", "3"],
}
# The fault campaign and the crash torture are `make campaign`, not `make bench` (--smoke runs them at a tiny size).
SEPARATE = {"campaign.py", "torture.py"}
# The campaign's extension modules (campaign_*.py): the campaign imports and runs them; none is a bench of its own.
EXTENSION_PREFIX = "campaign_"
# Targets of benches that do not state their own (a bench's "target" key wins).
TARGETS: dict[str, str] = {
    "resume_latency.py": "vs_import_torch < 0.25",
    "campaign.py": "recall 1.0 and bad_resumes 0",
}
PER_BENCH_CAP_S = 300.0
# --smoke: the flag each bench shrinks itself with (default --smoke). Each bench may take SMOKE_CAP_S (a guard
# against a hang, not a share of a budget: on a loaded machine a smoke run is slower, not wrong).
SMOKE_FLAGS: dict[str, list[str]] = {"replay_cost.py": ["--quick"]}
SMOKE_CAP_S = 300.0
# Benches with a cap of their own, instead of PER_BENCH_CAP_S and their share of the budget (make bench) or
# SMOKE_CAP_S (--smoke), still within what is left: bench/framework_save.py starts a torchrun job per framework (five),
# each importing its framework and starting its drop-in on 2 ranks before the first save.
# bench/replay_cost.py trains (intervals + 2) x 300 steps per shape and contender (three shapes; 13 minutes with
# --intervals 2 at load 2.4-2.8); bench/fast_tier.py runs eight jobs paced at 1 s a step (60 steps each: fast tier
# and durable only, on POSIX and on a moto S3 server, twice), more than 600 s.
OWN_CAP_S: dict[str, float] = {"framework_save.py": 600.0, "replay_cost.py": 1500.0, "fast_tier.py": 1080.0}
SMOKE_OWN_CAP_S: dict[str, float] = {"framework_save.py": 600.0}
# The framework drop-ins bench/framework_save.py measures (each must report its two figures).
FRAMEWORKS = ("deepspeed", "megatron", "torchtitan", "lightning", "accelerate")
# Keys of a bench's JSON that others read (the documented ratio keys): --smoke fails a bench that leaves one out.
# A dotted path descends into objects; "*" stands for every value of an object (at least one).
CONTRACT_KEYS: dict[str, list[str]] = {
    "save_overhead.py": ["ratios.scout_full_vs_dcp", "ratios.scout_bytes_vs_dcp", "ratios.async_blocking_vs_dcp_async"],
    "certify_throughput.py": ["ratios.vs_xxh3_read", "ratios.vs_serial_sha256"],
    "consensus_overhead.py": ["ratio", "ratios.consensus_vs_save", "ratios.replay_interval_1"],
    "fast_tier.py": ["ratios.restart_fast_vs_durable", "ratios.save_blocking_local_vs_async"],
    "whole_save.py": [
        "ratios.whole_save_vs_dcp_fsdp",
        "ratios.whole_save_vs_dcp_ddp",
        "ratios.whole_save_vs_dcp_fsdp_large",
        "ratios.whole_save_vs_dcp_ddp_large",
        "fixed_overhead_s",
    ],
    "framework_save.py": [
        *(f"ratios.save_vs_framework_{fw}_large" for fw in FRAMEWORKS),
        *(f"fixed_overhead_s_{fw}" for fw in FRAMEWORKS),
    ],
    "replay_cost.py": [
        f"ratios.{k}_{shape}" for shape in ("ddp", "fsdp", "gpt2") for k in ("amortized_share", "save_blocking_steps")
    ],
    "campaign.py": [
        "bad_resumes",
        "kinds.*.recall",
        "kinds.*.precision",
        "kinds.*.false_positives",
        "kinds.*.latency_s_median",
    ],
    "torture.py": ["n_violations"],
    "scale.py": [
        "at_max.judge_round_s",
        "at_max.hottest_reader_reads_per_round",
        "at_max.gather_bytes_per_save",
        "at_max.ledger_bytes_per_checkpoint",
        "at_max.resume_s",
        "growth.*",
        "model.ranks_per_node",
        "model.files_per_rank",
        "model.checkpoints",
    ],
}


def bench_scripts(smoke: bool = False) -> list[Path]:
    """The benches `make bench` runs; with `smoke`, the campaign and the torture too (not the campaign's
    extension modules: the campaign imports them)."""
    me = Path(__file__).resolve()
    skip = set() if smoke else SEPARATE
    return sorted(
        p
        for p in C.BENCH_DIR.glob("*.py")
        if not p.name.startswith(("_", EXTENSION_PREFIX)) and p.resolve() != me and p.name not in skip
    )


def headline(result: dict) -> str:
    """The figure a reader looks for first: the ratio(s), or for the campaign its detection record."""
    if "ratio" in result:
        return f"ratio {C.fmt(result['ratio'])}"
    if isinstance(result.get("ratios"), dict):
        return ", ".join(f"{k} {C.fmt(v)}" for k, v in result["ratios"].items())
    kinds = result.get("kinds")
    if isinstance(kinds, dict) and kinds:
        recall = min(
            (k.get("recall") for k in kinds.values() if isinstance(k.get("recall"), (int, float))), default=None
        )
        precision = min(
            (k.get("precision") for k in kinds.values() if isinstance(k.get("precision"), (int, float))), default=None
        )
        return (
            f"min recall {C.fmt(recall)}, min precision {C.fmt(precision)}, "
            f"bad_resumes {result.get('bad_resumes', '-')}"
        )
    return "-"


def tail(text: str, lines: int = 40) -> str:
    return "\n".join((text or "").strip().splitlines()[-lines:])


def missing_keys(result: dict, paths: list[str]) -> list[str]:
    """The dotted paths (CONTRACT_KEYS) that `result` does not hold."""

    def has(obj, parts: list[str]) -> bool:
        if not parts:
            return True
        if not isinstance(obj, dict):
            return False
        if parts[0] == "*":
            return bool(obj) and all(has(v, parts[1:]) for v in obj.values())
        return parts[0] in obj and has(obj[parts[0]], parts[1:])

    return [p for p in paths if not has(result, p.split("."))]


def run_in_session(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run `cmd` in a new session and wait for it (not for the end of its output: a worker it left behind may hold
    the same stdout). Then, or past `timeout`, kill its whole process group (the workers it started: torchrun's,
    a multiprocessing forkserver's). Past `timeout`, raise TimeoutExpired with the output so far."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=C.REPO, stdout=out, stderr=err, text=True, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_one(script: Path, timeout: float, smoke_flags: list[str] | None = None) -> dict:
    """One bench with --json; `smoke_flags` (a smoke run): those instead of its size flags, and no target judged."""
    flags = FLAGS.get(script.name, []) if smoke_flags is None else smoke_flags
    cmd = [sys.executable, str(script.relative_to(C.REPO)), *flags, "--json"]
    shown = " ".join(["python", *cmd[1:]])
    entry = {
        "bench": script.name,
        "command": shown,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "target": TARGETS.get(script.name, "-"),
        "loadavg_1m": C.load_note()["loadavg_1m"],
    }
    C.log(f"== {shown} (limit {timeout:.0f} s)")
    t0 = time.perf_counter()
    try:
        res = run_in_session(cmd, timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {
            **entry,
            "status": "failed",
            "error": f"timed out after {timeout:.0f} s",
            "stderr_tail": tail(err),
            "duration_s": time.perf_counter() - t0,
        }
    entry["duration_s"] = time.perf_counter() - t0
    if res.returncode != 0:
        return {
            **entry,
            "status": "failed",
            "error": f"exit code {res.returncode}",
            "stderr_tail": tail(res.stderr or res.stdout),
        }
    try:
        result = json.loads(res.stdout)
        if not isinstance(result, dict):
            raise ValueError("not an object")
    except ValueError:
        return {
            **entry,
            "status": "failed",
            "error": "stdout is not one JSON object",
            "stderr_tail": tail(res.stderr) or tail(res.stdout),
        }
    if smoke_flags is not None:
        missing = missing_keys(result, CONTRACT_KEYS.get(script.name, []))
        if missing:
            return {
                **entry,
                "status": "failed",
                "error": f"JSON without {', '.join(missing)}",
                "stderr_tail": tail(res.stdout, 3),
            }
        return {**entry, "status": "ok", "headline": headline(result), "keys": sorted(result)}
    met = overall_met(result.get("target_met"))
    return {
        **entry,
        "status": "ok" if met is not False else "target missed",
        "result": result,
        "headline": headline(result),
        "target": result.get("target", entry["target"]),
        "target_met": met,
    }


def overall_met(met):
    """A bench's judgement of its targets as one word's worth: True, False or None (states none). A bench with
    several targets may give `{"name": bool, ...}`: met when every one is (its JSON keeps the detail)."""
    if isinstance(met, dict):
        return all(v is True for v in met.values()) if met else None
    return met if met in (True, False, None) else bool(met)


def commit() -> str:
    """The commit measured, `+dirty` when the working tree differs from it (then the figures are of no commit)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=C.REPO, capture_output=True, text=True, timeout=30
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=C.REPO,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (head or "unknown") + ("+dirty" if head and dirty else "")


def verdict(e: dict) -> str:
    """met / missed where the bench judged its target, "-" where it states none."""
    return {True: "met", False: "missed"}.get(e.get("target_met"), "-") if e["status"] != "failed" else "-"


def markdown(entries: list[dict], run: dict) -> str:
    lines = [
        f"`{run['command']}` at `{run['commit']}`, {run['started']} - {run['ended']} UTC, load average "
        f"{run['load_start']} - {run['load_end']} on {run['cores']} cores, {run['wall_s']:.0f} s.",
        "",
        "| bench | status | headline | target | met/missed | load | seconds | date | command |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        status = e["status"] if e["status"] != "failed" else f"**failed**: {e['error']}"
        cells = [
            e["bench"],
            status,
            e.get("headline", "-"),
            e.get("target", "-"),
            verdict(e),
            e.get("loadavg_1m", "-"),
            f"{e['duration_s']:.0f}" if "duration_s" in e else "-",
            e["date"],
            f"`{e['command']}`",
        ]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    for e in entries:
        if e["status"] == "failed":
            lines += [
                "",
                f"### {e['bench']} failed ({e['error']})",
                "",
                "```",
                e.get("stderr_tail") or "(no output)",
                "```",
            ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", metavar="NAME", help="run only these benches (file names or stems)")
    p.add_argument(
        "--budget-s", type=float, default=None, help="time for all benches together (default 3300; --smoke 1800)"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="every bench at a tiny size (make bench-smoke): fails only "
        "on a bench that errs, prints no JSON object or leaves out a documented key",
    )
    args = p.parse_args()
    if args.budget_s is None:
        # make bench: 1,047 s at load 1-3 before replay_cost had its own cap (it then timed out at 300 s)
        args.budget_s = 1800.0 if args.smoke else 3300.0

    scripts = bench_scripts(args.smoke)
    if args.only:
        wanted = {n if n.endswith(".py") else f"{n}.py" for n in args.only}
        unknown = wanted - {s.name for s in scripts}
        if unknown:
            C.fail(f"no such bench: {', '.join(sorted(unknown))}")
        scripts = [s for s in scripts if s.name in wanted]

    deadline = time.monotonic() + args.budget_s
    run = {
        "command": " ".join(["python bench/run_all.py", *sys.argv[1:]]),
        "commit": commit(),
        "started": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_start": C.load_note()["loadavg_1m"],
        "cores": C.load_note()["cores"],
    }
    entries = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="scout-bench-smoke-") as scratch:
        for i, script in enumerate(scripts):
            left = deadline - time.monotonic()
            if args.smoke:
                share = min(SMOKE_OWN_CAP_S.get(script.name, SMOKE_CAP_S), left)
            else:
                share = min(PER_BENCH_CAP_S, left / (len(scripts) - i) * 2, left)  # may borrow from later benches
                share = min(OWN_CAP_S[script.name], left) if script.name in OWN_CAP_S else share
            if share < 5:
                entries.append(
                    {
                        "bench": script.name,
                        "command": f"python bench/{script.name}",
                        "status": "failed",
                        "error": "time budget spent",
                        "date": time.strftime("%Y-%m-%d %H:%M"),
                        "target": TARGETS.get(script.name, "-"),
                    }
                )
                continue
            smoke_flags = None
            if args.smoke:
                smoke_flags = SMOKE_FLAGS.get(script.name, ["--smoke"])
                if script.name in ("campaign.py", "torture.py"):  # their result files: not over a real run's
                    smoke_flags = [*smoke_flags, "--out", str(Path(scratch, script.stem))]
            entries.append(run_one(script, share, smoke_flags))
    run["wall_s"] = round(time.monotonic() - t0, 1)

    run.update(ended=time.strftime("%Y-%m-%d %H:%M", time.gmtime()), load_end=C.load_note()["loadavg_1m"])
    out = C.results_dir()
    summary = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "python": sys.version.split()[0],
        "benches": entries,
        "run": run,
    }
    name = "smoke" if args.smoke else "summary"
    atomic_write_bytes(
        out / f"{name}.json", (json.dumps(summary, indent=1, sort_keys=True, default=str) + "\n").encode()
    )
    md = markdown(entries, run)  # after the JSON is on disk: a rendering fault never loses a run's figures
    atomic_write_bytes(out / f"{name}.md", md.encode())
    if args.json:
        print(json.dumps(summary, sort_keys=True, default=str))
    else:
        print(md, end="")
        print(f"\nwritten: {out / f'{name}.md'}, {out / f'{name}.json'}")
    failed = [e["bench"] for e in entries if e["status"] == "failed"]
    if failed:
        C.log(f"failed: {', '.join(failed)}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
