"""Losing node 0 loses the root (observer/root_lost.py): what the surviving aggregator records, over hand-written
rows of its own node (the rows' shape as tests/test_observer.py's rule tables). Node 0's ranks are named only
when everything the survivor sees waits for them or died of them and they are the only others; otherwise
nobody is blamed and the loss of the root is recorded without ranks."""

from __future__ import annotations

import os
from types import SimpleNamespace

from scout_ckpt.observer import node_summary as ns
from scout_ckpt.observer import root_lost
from scout_ckpt.observer.aggregator import NodeRole
from tests import test_observer as flat

STALL = 2.0


def own(rows: dict[int, dict], node: int = 1) -> dict:
    ranks = sorted(rows)
    live = {r: {**row, "live": True, "cseq": 0, "pos": 0} for r, row in rows.items()}
    return ns.summarize(node, f"host{node}", ranks[0], ranks[-1], 5, live, STALL)


def test_survivors_waiting_in_a_collective_name_node_0_as_a_hang():
    got = root_lost.judge(own({2: flat._row(7, 30), 3: flat._row(7, 30)}), (0, 1), 3.0, 4, STALL)
    assert (got["kind"], got["ranks"], got["step"]) == ("hang", [0, 1], 7)
    d = got["detail"]
    assert (d["attribution"], d["nodes_silent"], d["node_rank"], d["root_lost"], d["judged_by_node"]) == (
        "node_silent",
        [0],
        0,
        True,
        1,
    )


def test_survivors_that_died_of_the_failed_collective_name_node_0_as_a_crash():
    dead = flat._row(7, 30, state="gone", error=True, age=0.0)
    got = root_lost.judge(own({2: dead, 3: dead}), (0, 1), 3.0, 4, STALL)
    assert (got["kind"], got["ranks"], got["detail"]["attribution"]) == ("crash", [0, 1], "node_silent")


def test_survivors_training_on_blame_nobody():
    going = flat._row(9, 40, in_coll=False, age=0.0)
    got = root_lost.judge(own({2: going, 3: going}), (0, 1), 3.0, 4, STALL)
    assert (got["kind"], got["ranks"], got["detail"]["what"]) == ("health", [], root_lost.WHAT)


def test_with_other_nodes_unheard_nobody_is_blamed():
    # six ranks on three nodes: node 1 waits, but node 2's state is unknown without the store
    got = root_lost.judge(own({2: flat._row(7, 30), 3: flat._row(7, 30)}), (0, 1), 3.0, 6, STALL)
    assert (got["kind"], got["ranks"]) == ("health", [])


def _aggregator_of_node_1(tmp_path, port: int):
    """Node 1's aggregator (rank 2 of 2 nodes of 2) over a stand-in daemon that sees no rows: only its store
    calls run."""
    daemon = SimpleNamespace(
        rank=2, world=4, live_timeout_s=2.0, cfg={"straggler": {}}, host="host1", beat=1, stall_s=STALL,
        read_row=lambda r, now, path: None,
    )  # fmt: skip
    hier = {"node": 1, "first": 2, "last": 3, "nodes": 2, "local": str(tmp_path), "addr": "127.0.0.1", "port": port}
    return NodeRole(daemon, hier)


def _wait_stopped(pid: int) -> None:
    """Until every thread of `pid` is stopped (each thread's /proc/TID/stat, read as the observer reads a pid's)."""
    import time
    from pathlib import Path

    from scout_ckpt.observer.stacks import proc_state

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = [proc_state(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()]
        if states and all(st in ("T", "t") for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop: thread states {states}")


def test_a_root_that_never_answers_fails_the_round_within_the_store_timeout_and_blames_nobody(tmp_path):
    """The root down before this aggregator ever reached it (nothing listens), or its host stuck before it could
    answer (it listens and never answers): each round fails as "could not check" within the aggregator's store
    timeout, so its loop (its trainer's watch, its exit) goes on, and nothing is recorded: a root never heard
    cannot be lost. The bound is torch's default store timeout (30 s), which a round used to block for at each
    try; the mute root blocked it for good."""
    import socket
    import time

    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)  # accepts (the kernel's backlog) and never answers, as a SIGSTOPped root would
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]  # nothing listens here once the with ends
        for port in (closed, mute.getsockname()[1]):
            role = _aggregator_of_node_1(tmp_path, port)
            for now in (100.0, 101.0):
                t0 = time.monotonic()
                role.round(now)
                took = time.monotonic() - t0
                assert role._failing and role.lost_since == 100.0 and not role.lost_pending(), port
                assert took < 30.0 - 5.0, (port, took)


def test_a_root_whose_host_stops_is_recorded_lost_and_the_survivors_loop_goes_on(tmp_path):
    """A real root store (its own process, as node 0's observer hosts it), heard by node 1's aggregator, then
    SIGSTOPped (node 0's host stuck): torch's store calls block on it far past their timeout, but the survivor's
    rounds fail within its store timeout, and once the silence lasted its live timeout the loss is recorded
    (observer/root_lost.py: its rows are unknown, so nobody is blamed)."""
    import signal
    import subprocess
    import sys
    import time

    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import datetime, time\n"
            "from torch.distributed import TCPStore\n"
            "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False,"
            " timeout=datetime.timedelta(seconds=30))\n"
            "print(s.port, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        role = _aggregator_of_node_1(tmp_path, int(server.stdout.readline()))
        published = []
        role.d.incidents = SimpleNamespace(publish=lambda *a: published.append(a) or True)
        role.round(100.0)
        assert role.heard_root and not role._failing
        os.kill(server.pid, signal.SIGSTOP)
        _wait_stopped(server.pid)  # every thread: a store thread still running would answer one more call
        for now in (101.0, 102.0, 103.5):
            t0 = time.monotonic()
            role.round(now)
            assert time.monotonic() - t0 < 30.0 - 5.0, now
            assert role._failing and role.lost_since == 101.0, now
        assert [(kind, ranks) for kind, ranks, *_ in published] == [("health", [])], published
        assert published[0][3]["what"] == root_lost.WHAT
    finally:
        server.kill()
        server.wait()
