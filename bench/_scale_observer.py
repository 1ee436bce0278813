"""The observer's hierarchy at a simulated size: the real aggregator, leader and root code over real summaries in a
real c10d TCPStore (scout_ckpt/observer/hierarchy.py), for bench/scale.py.

    measure_judge(ranks, ranks_per_node, repeats) -> {"judge_round_s", "hottest_reader_reads_per_round", ...}

What it builds: `ranks` / `ranks_per_node` nodes (the last one may be short). Every rank's status row is what its
observer writes (observer/daemon.py `_status`), in a hang: every rank stalled waiting in collective #9000 of step
120, except one rank of the last node that never got there (the laggard the verdict must name). One node's rows
are real JSON status files in a node-local directory, read and summarized each round by the real aggregator code;
every node's summary is built by the same code (node_summary.summarize) and set in a TCPStore this process
hosts; each group leader's merge is built by `hierarchy.leader_round` over the store. Timed: the root's round
(`hierarchy.root_round` reading the store, then `node_summary.judge`), a leader's round and an aggregator's round,
each the median of `repeats` rounds (CPU time: the machine may be shared); `judge_round_s` is the root process's
whole round (its own node's aggregation, its group's merge, the job's judge). The root's verdict is checked
against the laggard's rank, which the bench placed itself. `hottest_reader_reads_per_round`: the items (status
files and store keys) the busiest process reads per round, from the plan the code follows
(hierarchy.reads_per_round); `root_store_reads_per_round` is the count the store client itself made.

Runs standalone: `python bench/_scale_observer.py [--ranks 1024,100000] [--per-node 8]`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scout_ckpt.observer import hierarchy as hier  # noqa: E402
from scout_ckpt.observer import node_summary as ns  # noqa: E402
from scout_ckpt.observer.channel import read_json  # noqa: E402
from scout_ckpt.observer.store_transport import StoreTransport  # noqa: E402

STALL_S = 60.0


def status_row(rank: int, laggard: int, host: str) -> dict:
    """One rank's status as its observer writes it (daemon.Daemon._status), in the simulated hang."""
    behind = rank == laggard
    return {
        "rank": rank,
        "observer_pid": 1,
        "pid": 2,
        "beat": 7,
        "state": "running",
        "step": 120,
        "phase": "forward" if behind else "backward",
        "seq": 8999 if behind else 9000,
        "fp": "0123456789abcdef",
        "seq_left": 8999,
        "in_coll": 0 if behind else 1,
        "in_side": 0,
        "error": 0,
        "hb": [3, 5000],
        "cseq": 4999 if behind else 5000,
        "pos": 0,
        "off_watch": 0,
        "counted": 1,
        "t_cseq": 1.0,
        "arrivals": [[s, 1.0 + s] for s in range(89, 121)],
        "stamps": [[s, 1.0, 1.1, 0.0] for s in range(89, 121)],
        "age_s": STALL_S + 1,
        "t_update": 1.0,
        "n_steps": 120,
        "busy_sum": 10.0,
        "dur_sum": 12.0,
        "last_dur": 0.1,
        "stacks": {"hb": [3, 5000], "span": [0, 100]} if behind else None,
        "wall": 1.0,
        "torch_imported": False,
        "gone_at": None,
        "host": host,
        "t_start": 0.0,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_median(fn, repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(max(3, repeats)):
        c = time.process_time()
        fn()
        out.append(time.process_time() - c)
    return statistics.median(out)


def measure_judge(ranks: int, ranks_per_node: int, repeats: int) -> dict:
    nodes = -(-ranks // ranks_per_node)
    groups = hier.groups_of(nodes)
    laggard = ranks - 1
    first = lambda n: n * ranks_per_node  # noqa: E731
    last = lambda n: min(ranks, (n + 1) * ranks_per_node) - 1  # noqa: E731
    store = StoreTransport("127.0.0.1", _free_port(), serve=True)
    # every node's summary, as its aggregator builds it
    summaries = {}
    for n in range(nodes):
        rows = {r: dict(status_row(r, laggard, f"node{n:05d}"), live=True) for r in range(first(n), last(n) + 1)}
        summaries[hier.node_key(n)] = ns.summarize(n, f"node{n:05d}", first(n), last(n), 7, rows, STALL_S)
    keys = list(summaries)
    for i in range(0, len(keys), 1000):
        store.store.multi_set(keys[i : i + 1000], [json.dumps(summaries[k]) for k in keys[i : i + 1000]])
    # each leader's merge, as the leaders publish it
    now = time.monotonic()
    if len(groups) > 1:
        for g, members in enumerate(groups):
            store.publish(hier.group_key(g), hier.leader_round(members, store.read, hier.Beats(10.0), now, 7))

    # the aggregator of the last node: reads its ranks' status files, summarizes, publishes
    local = Path(tempfile.mkdtemp(prefix="scout-bench-node-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    n_last = nodes - 1
    try:
        for r in range(first(n_last), last(n_last) + 1):
            (local / f"status-{r}.json").write_text(json.dumps(status_row(r, laggard, "nodeX")))

        def aggregator():
            rows = {}
            for r in range(first(n_last), last(n_last) + 1):
                row = read_json(local / f"status-{r}.json")
                if row is not None:
                    rows[r] = dict(row, live=True)
            s = ns.summarize(n_last, "nodeX", first(n_last), last(n_last), 8, rows, STALL_S)
            store.publish(hier.node_key(n_last), s)
            store.claims()

        agg_s = _cpu_median(aggregator, repeats)
    finally:
        shutil.rmtree(local, ignore_errors=True)

    beats = hier.Beats(10.0)
    verdicts = []

    def root():
        job = hier.root_round(groups, store.read, beats, time.monotonic())
        verdicts.append(ns.judge(job, ranks, STALL_S))

    store.reads = 0
    root_s = _cpu_median(root, repeats)
    rounds = len(verdicts)
    root_reads = store.reads // rounds
    v = verdicts[-1]
    if v is None or v["ranks"] != [laggard] or v["kind"] != "hang":
        raise AssertionError(f"the root's verdict does not name the laggard {laggard}: {v}")

    leader_s = 0.0
    if len(groups) > 1:
        big = max(groups, key=len)
        leader_s = _cpu_median(
            lambda: hier.leader_round(big, store.read, hier.Beats(10.0), time.monotonic(), 8), repeats
        )
    plan = hier.reads_per_round(nodes, ranks_per_node)
    wire = max(len(json.dumps(s)) for s in summaries.values())
    return {
        # the root's process also aggregates node 0 and leads group 0 each round: its whole round is the sum
        "judge_round_s": root_s + leader_s + agg_s,
        "root_judge_s": root_s,
        "hottest_reader_reads_per_round": max(plan.values()),
        "root_store_reads_per_round": root_reads,
        "leader_round_s": leader_s,
        "aggregator_round_s": agg_s,
        "reads_per_round": plan,
        "nodes": nodes,
        "groups": len(groups),
        "ranks_per_node": ranks_per_node,
        "node_summary_bytes_max": wire,
        "verdict": {"kind": v["kind"], "ranks": v["ranks"], "attribution": v["attribution"]},
        "assumptions": f"{ranks_per_node} ranks per node, groups of {max(len(g) for g in groups)} nodes, "
        f"one store key per node and per group, a hang with one laggard",
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="1024,100000")
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    out = {int(r): measure_judge(int(r), a.per_node, a.repeats) for r in a.ranks.split(",")}
    if a.json:
        print(json.dumps(out))
    else:
        for r, m in out.items():
            print(
                f"{r:>7} ranks  judge round {m['judge_round_s'] * 1e3:7.2f} ms (root's judge {m['root_judge_s'] * 1e3:6.2f}) leader {m['leader_round_s'] * 1e3:6.2f} ms"
                f"  aggregator {m['aggregator_round_s'] * 1e3:6.2f} ms  hottest reader {m['hottest_reader_reads_per_round']}"
                f" items/round  ({m['nodes']} nodes, {m['groups']} groups)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
