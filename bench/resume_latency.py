"""How long restart tooling waits for `scout-ckpt resume ROOT --latest-clean`, against what it waits anyway.

A restart script runs `resume` once per restart, in a fresh process. The yardsticks are the two things such a
script already pays: `import torch` (the trainer it is about to start pays it; 1.35 s here) and TorchTitan's
own way of finding the newest checkpoint (list `step-N` dirs, keep those with a `.metadata`, take the max).
The ROOT holds a ledger of 10,000 checkpoints and 10,000 step directories; the newest certified checkpoint has
real files with their digests, so `resume` re-reads and re-hashes real bytes before answering.

Target: resume under a quarter of `import torch`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from scout_ckpt.format import manifest  # noqa: E402
from scout_ckpt.format.digests import file_digest  # noqa: E402
from scout_ckpt.format.layout import DCP_METADATA, step_dirname  # noqa: E402
from scout_ckpt.ledger import Ledger  # noqa: E402

TARGET = 0.25
EVIDENCE_KINDS = ("bytes", "consensus", "replay", "invariants")
POLICY = {"require": list(EVIDENCE_KINDS), "allow_not_applicable": []}

# TorchTitan's CheckpointManager._find_load_step, as a restart script would run it.
TITAN_SCAN = """
import os, re, sys
folder = sys.argv[1]
steps = []
for name in os.listdir(folder):
    m = re.search(r"step-(\\d+)", name)
    if m and os.path.isfile(os.path.join(folder, name, ".metadata")):
        steps.append(int(m.group(1)))
print(max(steps) if steps else -1)
"""


def state_of(i: int, n: int) -> str:
    """A long run's mix: mostly certified, some rejected, older ones deleted by retention; newest certified."""
    if i == n - 1:
        return "certified"
    if i % 97 == 5:
        return "rejected"
    if i % 13 == 7:
        return "committed"
    return "deleted" if i < n // 2 else "certified"


def build_root(root: Path, n: int, every: int, file_mib: float) -> int:
    """The ROOT described above; returns the step `resume` must answer."""
    steps = [every * (i + 1) for i in range(n)]
    newest = steps[-1]
    run_id = "bench-run"
    t0 = time.time() - n * 60

    # every step dir carries a .metadata (what a TorchTitan-style scan looks for)
    for s in steps[:-1]:
        d = root / step_dirname(s)
        d.mkdir()
        (d / DCP_METADATA).write_bytes(b"m")

    # the newest: real DCP-shaped files, their digests, and a manifest
    d = root / step_dirname(newest)
    d.mkdir()
    rng = os.urandom
    size = int(file_mib * (1 << 20))
    (d / "__0_0.distcp").write_bytes(rng(size))
    (d / "__1_0.distcp").write_bytes(rng(size))
    (d / DCP_METADATA).write_bytes(rng(4096))
    files = []
    for rank, name in ((0, "__0_0.distcp"), (1, "__1_0.distcp"), (0, DCP_METADATA)):
        fsize, digest = file_digest(d / name)
        files.append({"path": name, "size": fsize, "digest": digest, "rank": rank})
    evidence = {k: {"status": "pass", "reasons": []} for k in EVIDENCE_KINDS}
    man = manifest.build(
        step=newest,
        run_id=run_id,
        attempt="bench",
        world_size=2,
        topology={"mode": "ddp"},
        policy=POLICY,
        files=files,
        evidence=evidence,
        verdict={"state": "certified", "reasons": []},
    )
    manifest_digest = manifest.write(d, man)

    with Ledger.open(root, create=True) as lg:
        lg.begin_run(run_id, world_size=2, topology={"mode": "ddp"}, policy=POLICY)
        with lg.write():
            rows, ev_rows = [], []
            for i, s in enumerate(steps):
                state = state_of(i, n)
                reasons = (
                    [{"code": "consensus_attributed", "ranks": [1]}]
                    if state == "rejected"
                    else ([{"code": "replay_missing", "kind": "replay"}] if state == "committed" else [])
                )
                when = t0 + i * 60
                rows.append(
                    {
                        "step": s,
                        "run_id": run_id,
                        "state": state,
                        "path": step_dirname(s),
                        "bytes": 2 * size + 4096,
                        "attempt": f"a{s}",
                        "started": when,
                        "committed": when + 1,
                        "updated": when + 1,
                        "manifest_digest": manifest_digest if s == newest else f"m{s}",
                        "reasons": json.dumps(reasons),
                    }
                )
                for k in EVIDENCE_KINDS:
                    status = (
                        "fail"
                        if (state == "rejected" and k == "consensus")
                        else ("missing" if (state == "committed" and k == "replay") else "pass")
                    )
                    ev_rows.append(
                        {"step": s, "kind": k, "status": status, "detail": "{}", "source": "save", "recorded": when + 1}
                    )
            lg.db["checkpoints"].insert_all(rows, batch_size=2000)
            lg.db["evidence"].insert_all(ev_rows, batch_size=2000)
            lg.db["files"].insert_all([{"step": newest, **f} for f in files])
    return newest


def resume_command() -> list[str]:
    """The console script as installed; `python -m scout_ckpt.cli` if the script is missing."""
    if importlib.util.find_spec("scout_ckpt.cli") is None:
        C.fail(
            "the `resume` command does not exist yet (scout_ckpt/cli.py is missing); "
            "this bench measures `scout-ckpt resume ROOT --latest-clean`"
        )
    script = Path(sys.executable).parent / "scout-ckpt"
    if script.exists():
        return [str(script)]
    found = shutil.which("scout-ckpt")
    return [found] if found else [sys.executable, "-m", "scout_ckpt.cli"]


def main() -> None:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--checkpoints", type=int, default=10_000, help="ledger rows and step dirs (default 10000)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per command (default 7)")
    p.add_argument("--file-mib", type=float, default=1.0, help="size of each of the 2 real files (default 1 MiB)")
    p.add_argument("--keep", action="store_true", help="keep the ROOT (its path goes to stderr)")
    args = C.parse_args(p, {"checkpoints": 20, "repeats": 1, "file_mib": 0.0625})
    if args.checkpoints < 1 or args.repeats < 1:
        C.fail("--checkpoints and --repeats must be at least 1")

    scout = resume_command()
    root = Path(tempfile.mkdtemp(prefix="scout-bench-resume-"))
    try:
        C.log(f"building {root} with {args.checkpoints} checkpoints ...")
        t = time.perf_counter()
        expected = build_root(root, args.checkpoints, every=10, file_mib=args.file_mib)
        build_s = time.perf_counter() - t

        resume = scout + ["resume", str(root), "--latest-clean"]
        # correctness first: resume must name the newest certified step, and the scan must find it too
        res = C.run_checked(resume + ["--json"], "scout-ckpt resume --json")
        try:
            answer = json.loads(res.stdout)
        except json.JSONDecodeError:
            C.fail(f"scout-ckpt resume --json printed no JSON object: {res.stdout[:200]!r}")
        if answer.get("step") != expected or not answer.get("verified"):
            C.fail(f"scout-ckpt resume answered {answer}, expected step {expected} verified")
        scan = [sys.executable, "-c", TITAN_SCAN, str(root)]
        found = C.run_checked(scan, "TorchTitan-style scan").stdout.strip()
        if found != str(expected):
            C.fail(f"the TorchTitan-style scan found {found}, expected {expected}")

        commands = {
            "resume": resume,
            "resume_no_verify": resume + ["--no-verify"],
            "import_torch": [sys.executable, "-c", "import torch"],
            "dir_scan": scan,
            "python_startup": [sys.executable, "-c", "pass"],
        }
        C.log(f"timing {len(commands)} commands, {args.repeats} interleaved rounds ...")
        load_before = C.load_note()
        samples = C.interleaved_times(
            {name: (lambda cmd=cmd, name=name: C.run_checked(cmd, name)) for name, cmd in commands.items()},
            args.repeats,
        )
        load_after = C.load_note()
        if load_before["busy"] or load_after["busy"]:
            C.log(
                f"warning: the machine was busy (load {load_before['loadavg_1m']} -> {load_after['loadavg_1m']} "
                f"on {load_after['cores']} cores); absolute times are inflated, ratios less so"
            )
        medians = {k: statistics.median(v) for k, v in samples.items()}
        ratios = {
            "vs_import_torch": medians["resume"] / medians["import_torch"],
            "vs_dir_scan": medians["resume"] / medians["dir_scan"],
        }
        result = {
            "bench": "resume_latency",
            "ratios": ratios,
            "target": f"vs_import_torch < {TARGET}",
            "target_met": ratios["vs_import_torch"] < TARGET,
            "medians_s": medians,
            "samples_s": samples,
            "checkpoints": args.checkpoints,
            "repeats": args.repeats,
            "file_mib": args.file_mib,
            "resume_step": expected,
            "build_s": build_s,
            "load": {"before": load_before, "after": load_after},
            "command": " ".join(["scout-ckpt", "resume", "ROOT", "--latest-clean"]),
        }
        rows = [
            (name, medians[name], min(samples[name]), max(samples[name]), medians[name] / medians["import_torch"])
            for name in commands
        ]
        C.emit(
            result,
            args,
            rows,
            ["process", "median_s", "min_s", "max_s", "x import torch"],
            title=f"resume latency: {args.checkpoints} checkpoints, {args.repeats} runs each, "
            f"newest certified = step {expected}\n",
        )
    finally:
        if args.keep:
            C.log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
