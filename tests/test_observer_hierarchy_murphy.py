"""What the hierarchy adds to Murphy, on real processes: 4 gloo ranks as 2 nodes of 2 (LOCAL_WORLD_SIZE=2, so
the observers run the hierarchy: node 0's aggregator is the root and hosts the store, node 1's publishes its
summary), the observer tests' toy training loop (tests/workers_observer.py).

- a stuck host: node 1's trainers and observers are SIGSTOPped: the root names node 1's ranks (node_silent) and
  nobody on node 0;
- a node that dies: node 1's observers, then its trainers, are SIGKILLed (the aggregator dies with its node): the
  job-level verdict names node 1's ranks and never a rank of node 0, whose trainers died of the failed collective;
- a cut-off aggregator: only node 1's aggregator is SIGSTOPped (its summary stops), training goes on to its end:
  nobody is blamed;
- node 0 dies, and the root with it (its observers, then its trainers, SIGKILLed), or its host is stuck (all
  SIGSTOPped): the surviving aggregator, node 1's, records the loss (observer/root_lost.py) naming node 0's ranks
  and none of its own, whose trainers died of the failed collective or wait in it.

The oracle is the test's own choice of what to stop or kill, and the pids the observers published at start.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

from scout_ckpt.ledger import Ledger
from scout_ckpt.observer.stacks import proc_state
from scout_ckpt.testing.launch import run_ranks
from tests import test_observer as flat
from tests import workers_observer as W

# the observer's judgement of real processes, timed: `make stress` runs it too
pytestmark = [pytest.mark.scenario, pytest.mark.timing]

NODE1 = [2, 3]


class Job(flat.Job):
    """tests/test_observer.py's Job, its ranks told they are 2 nodes of 2."""

    def __init__(self, root: Path, scenario: str, **opts):
        super().__init__(root, scenario, **opts)
        # one id per job, as the Checkpointer gives every attempt: the node-local folders (/dev/shm) are named by
        # it, and a folder left by the file's previous test (its claims counter) would pass wait_hierarchy before
        # this job's aggregators ever spoke to their root
        self.run_id = f"test-hier-{scenario}-{uuid.uuid4().hex[:8]}"
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        self.outcomes = run_ranks(
            W.train,
            flat.WORLD,
            str(self.root),
            self.run_id,
            self.scenario,
            self.opts,
            timeout=150,
            allow_failures=True,
            env={"LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
        )

    def local(self, node: int) -> Path:
        base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(os.environ.get("TMPDIR", "/tmp"))
        return base / f"scout-obs-{self.run_id}-n{node}"

    def wait_hierarchy(self, timeout: float = 120.0) -> dict[int, dict]:
        """Until both aggregators have spoken with the root's store (each wrote its node's claims counter) and
        every rank trained a few steps; returns the statuses (pids)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.statuses()
            if (
                len(rows) == flat.WORLD
                and all((self.local(n) / "claims-gen").exists() for n in (0, 1))
                and self.outcomes is None
            ):
                return rows
            time.sleep(0.1)
        raise AssertionError(f"the hierarchy did not start within {timeout}s: {self.statuses()}")

    def incidents(self) -> list[dict]:
        return [e for e in self.events() if e["kind"] in ("hang", "crash", "desync")]

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:  # a SIGKILLed aggregator leaves its node's folder behind
            for n in (0, 1):
                shutil.rmtree(self.local(n), ignore_errors=True)


def _signal(pids, sig) -> None:
    for pid in pids:
        if proc_state(pid) not in (None, "Z"):
            os.kill(pid, sig)


def test_a_stuck_node_is_named_and_no_healthy_rank_is(tmp_path):
    with Job(tmp_path, "healthy", steps=100_000, compute_s=0.02, stall_s=1.5) as job:
        rows = job.wait_hierarchy()
        stopped = [rows[r]["observer_pid"] for r in NODE1] + [rows[r]["pid"] for r in NODE1]
        _signal(stopped, signal.SIGSTOP)
        try:
            events = job.wait_event("hang")
        finally:
            _signal(stopped, signal.SIGCONT)
        hangs = [e for e in events if e["kind"] == "hang"]
        assert len(hangs) == 1 and hangs[0]["ranks"] == NODE1, events
        assert hangs[0]["detail"]["attribution"] == "node_silent", hangs[0]
        assert hangs[0]["detail"]["nodes_silent"] == [1], hangs[0]
        assert not [e for e in job.incidents() if set(e["ranks"]) - set(NODE1)], job.incidents()


def test_a_node_that_dies_with_its_aggregator_is_named_and_no_healthy_rank_is(tmp_path):
    with Job(tmp_path, "healthy", steps=100_000, compute_s=0.02, stall_s=1.5) as job:
        rows = job.wait_hierarchy()
        _signal([rows[r]["observer_pid"] for r in NODE1], signal.SIGKILL)  # the aggregator dies with its node
        _signal([rows[r]["pid"] for r in NODE1], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not job.incidents():
            time.sleep(0.1)
        incidents = job.incidents()
        assert incidents and incidents[0]["ranks"] == NODE1, incidents
        assert incidents[0]["detail"]["attribution"] == "node_silent", incidents[0]
        assert not [e for e in incidents if set(e["ranks"]) - set(NODE1)], incidents


def test_a_cut_off_aggregator_blames_nobody_while_training_goes_on(tmp_path):
    with Job(tmp_path, "healthy", steps=600, compute_s=0.03, stall_s=1.5) as job:
        rows = job.wait_hierarchy()
        aggregator = rows[NODE1[0]]["observer_pid"]
        _signal([aggregator], signal.SIGSTOP)
        try:
            job.thread.join(150)
        finally:
            _signal([aggregator], signal.SIGCONT)
        assert job.outcomes is not None and all(o.exitcode == 0 for o in job.outcomes), job.outcomes
    assert not job.incidents(), job.incidents()
    with Ledger.open(tmp_path, readonly=True) as led:
        assert not [e for e in led.events() if e["kind"] in ("hang", "crash")]


def test_losing_node_0_and_the_root_is_recorded_by_the_survivor_naming_node_0(tmp_path):
    node0 = [0, 1]
    with Job(tmp_path, "healthy", steps=100_000, compute_s=0.02, stall_s=1.5) as job:
        rows = job.wait_hierarchy()
        _signal([rows[r]["observer_pid"] for r in node0], signal.SIGKILL)  # the root and its store
        _signal([rows[r]["pid"] for r in node0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not job.incidents():
            time.sleep(0.1)
        incidents = job.incidents()
        assert incidents and incidents[0]["ranks"] == node0, incidents
        detail = incidents[0]["detail"]
        assert (detail["attribution"], detail["root_lost"], detail["judged_by_node"]) == ("node_silent", True, 1), (
            detail
        )
        assert detail["nodes_silent"] == [0], detail
        assert not [e for e in incidents if set(e["ranks"]) - set(node0)], incidents


def test_a_stuck_node_0_is_named_by_the_survivor_though_its_stopped_root_never_answers(tmp_path):
    """Node 0's host stuck: its trainers and observers (the root and its store among them) SIGSTOPped. The root's
    store accepts and never answers, which blocks torch's store calls past their timeout
    (observer/store_transport.py): node 1's aggregator still goes on and records the loss, naming node 0's ranks,
    for which its own trainers wait in a collective."""
    node0 = [0, 1]
    with Job(tmp_path, "healthy", steps=100_000, compute_s=0.02, stall_s=1.5) as job:
        rows = job.wait_hierarchy()
        stopped = [rows[r]["observer_pid"] for r in node0] + [rows[r]["pid"] for r in node0]
        _signal(stopped, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not job.incidents():
                time.sleep(0.1)
            incidents = job.incidents()
        finally:
            _signal(stopped, signal.SIGCONT)
        assert incidents and incidents[0]["ranks"] == node0, incidents
        detail = incidents[0]["detail"]
        assert (incidents[0]["kind"], detail["attribution"], detail["root_lost"], detail["judged_by_node"]) == (
            "hang",
            "node_silent",
            True,
            1,
        ), detail
        assert not [e for e in incidents if set(e["ranks"]) - set(node0)], incidents
