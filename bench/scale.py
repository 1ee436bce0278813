"""Cost at scale, by simulation: a ledger of many checkpoints written by many ranks, and what readers pay.

For each rank count R the bench builds a ledger the way a long run of R ranks leaves it: N checkpoints (mostly
certified, some rejected or awaiting evidence, the older half deleted by retention, rows kept), each with one
files row per rank (every rank writes and hashes its own `__R_0.distcp`) plus `.metadata`, four evidence rows,
its verdict history, a hang or crash event now and then, and the run's rank placement. Then it times what restart
tooling and operators run, in process (the command's own work; a CLI process adds a constant start-up, printed
with --cli):

  ls        views.list_checkpoints   (`scout-ckpt ls --json`)
  resume    recovery.latest_clean(verify=False)   (`scout-ckpt resume --latest-clean --no-verify`)
  explain   operator.explain of the newest step   (`scout-ckpt explain`)

Latencies are CPU seconds of this process (median; wall-clock beside them as *_wall): on a shared machine the
wall clock measures the neighbours.

and the observer's side channel (observer_round): the judge's CPU per round over every rank's status file
and the files host 0 reads per second. And sizes: the ledger file, the bytes the coordinator gathers per save (the pickled per-rank file lists of
Committer.finish) and the manifest it writes. `ratios` hold each figure at the largest R over the smallest (with
R itself growing `rank_growth` times): linear growth gives `rank_growth`, flat gives 1.

Default: the reduced size `make bench` runs in seconds (R = 16, 64; 300 checkpoints). The issue's size:
`--ranks 64,256,1024 --checkpoints 10000` (about 1 GB of ledger at 1,024 ranks; minutes to build).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from resume_latency import state_of  # noqa: E402  (the same long run's mix of states)

from scout_ckpt.format import manifest  # noqa: E402
from scout_ckpt.format.layout import DCP_METADATA, LEDGER_NAME, step_dirname  # noqa: E402
from scout_ckpt.ledger import Ledger  # noqa: E402

KINDS = ("bytes", "consensus", "replay", "invariants")
POLICY = {"require": list(KINDS), "allow_not_applicable": []}
RUN = "scale-run"
EVERY = 10


def rank_files(rank: int, step: int) -> list[dict]:
    """What one rank reports at a save's gather: its own shard file (rank 0 also `.metadata`)."""
    out = [
        {
            "path": f"__{rank}_0.distcp",
            "size": 50_000_000 + rank,
            "digest": f"{(step * 1_000_003 + rank):032x}",
            "rank": rank,
        }
    ]
    if rank == 0:
        out.append({"path": DCP_METADATA, "size": 1_000_000, "digest": f"{step:032x}", "rank": 0})
    return out


def build(root: Path, ranks: int, n: int) -> dict:
    """The ledger described in the module docstring; returns the timing of its parts."""
    t0 = time.perf_counter()
    with Ledger.open(root, create=True) as lg:
        lg.conn.execute("PRAGMA synchronous=OFF")  # a simulation: building it need not wait for the disk
        lg.begin_run(RUN, world_size=ranks, topology={"mode": "ddp", "world_size": ranks}, policy=POLICY)
        lg.record_ranks(
            RUN,
            [
                {"rank": r, "host": f"node{r // 8:04d}", "node_rank": r // 8, "local_rank": r % 8, "pid": 1000 + r}
                for r in range(ranks)
            ],
        )
        c = lg.conn
        base = time.time() - n * 60
        with lg.write():
            for i in range(n):
                s = EVERY * (i + 1)
                st = state_of(i, n)
                when = base + i * 60
                reasons = (
                    [{"code": "consensus_attributed", "ranks": [i % ranks]}]
                    if st == "rejected"
                    else [{"code": "replay_coverage_incomplete"}]
                    if st == "committed"
                    else []
                )
                c.execute(
                    "INSERT INTO checkpoints(step, run_id, state, path, bytes, attempt, started, committed, "
                    "updated, manifest_digest, reasons) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        s,
                        RUN,
                        st,
                        step_dirname(s),
                        50_000_000 * ranks,
                        f"a{s}",
                        when,
                        when + 1,
                        when + 1,
                        f"m{s}",
                        json.dumps(reasons),
                    ),
                )
                c.executemany(
                    "INSERT INTO files(step, path, size, digest, rank) VALUES (?,?,?,?,?)",
                    [(s, f["path"], f["size"], f["digest"], f["rank"]) for r in range(ranks) for f in rank_files(r, s)],
                )
                c.executemany(
                    "INSERT INTO evidence(step, kind, status, detail, source, recorded) VALUES (?,?,?,?,?,?)",
                    [
                        (
                            s,
                            k,
                            "fail"
                            if st == "rejected" and k == "consensus"
                            else "missing"
                            if st == "committed" and k == "replay"
                            else "pass",
                            "{}",
                            "save",
                            when + 1,
                        )
                        for k in KINDS
                    ],
                )
                hist = [("writing", when), (st if st != "deleted" else "certified", when + 1)]
                if st == "deleted":
                    hist.append(("deleted", when + 3600))
                c.executemany(
                    "INSERT INTO certifications(step, time, source, state, reasons, attempt, outcome) "
                    "VALUES (?,?,?,?,?,?,?)",
                    [(s, t, "save", h, "[]", f"a{s}", "applied") for h, t in hist],
                )
                if i % 50 == 25:
                    c.execute(
                        "INSERT INTO events(time, run_id, kind, step, ranks, detail) VALUES (?,?,?,?,?,?)",
                        (
                            when + 30,
                            RUN,
                            "hang" if i % 100 == 25 else "straggler",
                            s,
                            json.dumps([i % ranks]),
                            json.dumps({"nodes": {str(i % ranks): "node 0"}}),
                        ),
                    )
    return {"build_s": time.perf_counter() - t0, "newest": EVERY * n}


def gathered(ranks: int, step: int) -> dict:
    """Bytes of one save's gather at the coordinator (pickled like gather_object) and of its manifest."""
    per_rank = [{"rank": r, "files": rank_files(r, step), "finite_bad": []} for r in range(ranks)]
    gather_bytes = sum(len(pickle.dumps(x)) for x in per_rank)
    files = [f for x in per_rank for f in x["files"]]
    m = manifest.build(
        step=step,
        run_id=RUN,
        attempt="a",
        world_size=ranks,
        topology={"mode": "ddp"},
        policy=POLICY,
        files=files,
        evidence={k: {"status": "pass", "reasons": []} for k in KINDS},
        verdict={"state": "certified", "reasons": []},
    )
    return {"gather_bytes": gather_bytes, "manifest_bytes": len(manifest.encode(m))}


EXCHANGE_S = 0.5  # the observer's status period (observer/daemon.py)
RANKS_PER_HOST = 8


def observer_round(base: Path, ranks: int, repeats: int) -> dict:
    """The observer's side channel with `ranks` heartbeats: one status file per rank, replaced every EXCHANGE_S.
    Per round the judge (rank 0's observer) reads every rank's status, every other observer about one; so host 0
    reads ranks + RANKS_PER_HOST - 1 files per round and the job renames `ranks` files in one shared directory.
    Returns the judge's CPU seconds per round and those rates."""
    from scout_ckpt.observer.handle import read_json

    chan = base / f"chan-{ranks}"
    chan.mkdir()
    for r in range(ranks):
        row = {
            "rank": r,
            "observer_pid": 1,
            "pid": 2,
            "beat": 7,
            "state": "running",
            "step": 120,
            "phase": "fwd",
            "seq": 9000,
            "fp": "0123456789abcdef",
            "seq_left": 8999,
            "in_coll": 1,
            "in_side": 0,
            "error": 0,
            "hb": 3,
            "age_s": 0.01,
            "t_update": 1.0,
            "n_steps": 120,
            "busy_sum": 10.0,
            "dur_sum": 12.0,
            "last_dur": 0.1,
            "stacks": None,
            "wall": 1.0,
            "torch_imported": False,
            "gone_at": None,
            "host": f"node{r // RANKS_PER_HOST:04d}",
            "t_start": 0.0,
        }
        (chan / f"status-{r}.json").write_text(json.dumps(row, separators=(",", ":")))

    def judge():
        for r in range(ranks):
            read_json(chan / f"status-{r}.json")

    judge()
    cpu = []
    rounds = max(3, 4096 // ranks)  # a round is milliseconds: time a batch of rounds, report one
    for _ in range(max(3, repeats)):
        c = time.process_time()
        for _ in range(rounds):
            judge()
        cpu.append((time.process_time() - c) / rounds)
    shutil.rmtree(chan, ignore_errors=True)
    per_round = ranks + min(ranks, RANKS_PER_HOST) - 1
    return {
        "observer_judge_round_s": statistics.median(cpu),
        "observer_files_read_per_s_host0": per_round / EXCHANGE_S,
        "observer_status_renames_per_s_job": ranks / EXCHANGE_S,
    }


def measure(root: Path, newest: int, repeats: int) -> dict:
    from scout_ckpt.ops import operator, recovery, views

    def ls():
        rows, fallback = views.list_checkpoints(root)
        assert fallback is None and rows[-1]["step"] == newest

    def resume():
        assert recovery.latest_clean(root, verify=False)["step"] == newest

    def explain():
        assert operator.explain(root, newest)["state"] == "certified"

    fns = {"ls": ls, "resume": resume, "explain": explain}
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up: page cache, imports
    for _ in range(repeats):  # round-robin, like C.interleaved_times; CPU time too (the machine may be shared)
        for k, fn in fns.items():
            w, c = time.perf_counter(), time.process_time()
            fn()
            cpu[k].append(time.process_time() - c)
            wall[k].append(time.perf_counter() - w)
    return {
        **{k: statistics.median(v) for k, v in cpu.items()},
        **{f"{k}_wall": statistics.median(v) for k, v in wall.items()},
    }


def cli_times(root: Path, newest: int, repeats: int) -> dict:
    cli = [sys.executable, "-m", "scout_ckpt.cli"]
    cmds = {
        "ls_cli": cli + ["ls", str(root), "--json"],
        "resume_cli": cli + ["resume", str(root), "--latest-clean", "--no-verify"],
        "explain_cli": cli + ["explain", str(root), str(newest), "--json"],
    }
    samples = C.interleaved_times(
        {k: (lambda c=c, k=k: C.run_checked(c, k)) for k, c in cmds.items()}, repeats, warmup=0
    )
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--ranks", default="16,64", help="comma-separated rank counts (default 16,64; issue: 64,256,1024)")
    p.add_argument("--checkpoints", type=int, default=300, help="checkpoints in the ledger (default 300; issue: 10000)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cli", action="store_true", help="also time the CLI processes")
    p.add_argument("--keep", action="store_true", help="keep the ledgers (paths on stderr)")
    args = C.parse_args(p, {"ranks": "4,8", "checkpoints": 10, "repeats": 1})
    try:
        ranks = sorted({int(x) for x in args.ranks.split(",") if x.strip()})
    except ValueError:
        C.fail(f"--ranks {args.ranks!r}: expected comma-separated integers")
    if not ranks or ranks[0] < 1 or args.checkpoints < 2 or args.repeats < 1:
        C.fail("--ranks must be positive, --checkpoints at least 2, --repeats at least 1")

    base = Path(tempfile.mkdtemp(prefix="scout-bench-scale-"))
    per: dict[int, dict] = {}
    try:
        for r in ranks:
            root = base / f"r{r}"
            root.mkdir()
            C.log(f"R={r}: building {args.checkpoints} checkpoints x {r + 1} files rows ...")
            b = build(root, r, args.checkpoints)
            fig = {**b, "ledger_bytes": os.path.getsize(root / LEDGER_NAME), **gathered(r, b["newest"])}
            fig.update(measure(root, b["newest"], args.repeats))
            fig.update(observer_round(base, r, args.repeats))
            if args.cli:
                fig.update(cli_times(root, b["newest"], args.repeats))
            per[r] = fig
            C.log(f"R={r}: " + ", ".join(f"{k} {C.fmt(v)}" for k, v in fig.items()))
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    finally:
        if args.keep:
            C.log(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)

    lo, hi = per[ranks[0]], per[ranks[-1]]
    keys = [
        "ls",
        "resume",
        "explain",
        "ledger_bytes",
        "gather_bytes",
        "manifest_bytes",
        "observer_judge_round_s",
        "observer_files_read_per_s_host0",
    ] + (["ls_cli", "resume_cli", "explain_cli"] if args.cli else [])
    ratios = {f"{k}_growth": hi[k] / lo[k] for k in keys}
    ratios["rank_growth"] = ranks[-1] / ranks[0]
    # worse than linear: a figure growing faster than R itself (timings: with 50% slack for a shared machine)
    superlinear = [
        k
        for k in keys
        if hi[k] / lo[k]
        > ratios["rank_growth"] * (1.5 if k in ("ls", "resume", "explain", "observer_judge_round_s") else 1.05)
    ]
    result = {
        "bench": "scale",
        "ratios": ratios,
        "ranks": ranks,
        "checkpoints": args.checkpoints,
        "repeats": args.repeats,
        "per_ranks": {str(r): v for r, v in per.items()},
        "superlinear": superlinear,
        "target": "no figure grows faster than the rank count",
        "target_met": not superlinear,
        "load": C.load_note(),
    }
    headers = [
        "ranks",
        "ls_cpu_s",
        "resume_cpu_s",
        "explain_cpu_s",
        "ledger_MB",
        "gather_KB/save",
        "manifest_KB/save",
        "judge_round_cpu_s",
        "host0_files/s",
        "build_s",
    ]
    rows = [
        (
            r,
            v["ls"],
            v["resume"],
            v["explain"],
            v["ledger_bytes"] / 1e6,
            v["gather_bytes"] / 1e3,
            v["manifest_bytes"] / 1e3,
            v["observer_judge_round_s"],
            v["observer_files_read_per_s_host0"],
            v["build_s"],
        )
        for r, v in per.items()
    ]
    C.emit(
        result,
        args,
        rows,
        headers,
        title=f"scale: {args.checkpoints} checkpoints, ranks {ranks}, median of {args.repeats}\n",
    )


if __name__ == "__main__":
    main()
