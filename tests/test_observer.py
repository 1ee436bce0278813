"""The hang observer on real 4-rank gloo jobs: hang, desync, crash, SIGSTOP, straggler, healthy, abort; the
collective tracer; the heartbeat's seqlock; the attribution rule on hand-made tables."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from scout_ckpt.ledger import Ledger
from scout_ckpt.observer.daemon import attribute, channel_dir
from scout_ckpt.observer.heartbeat import Heartbeat, HeartbeatReader
from scout_ckpt.observer.stacks import proc_state
from scout_ckpt.testing.launch import run_ranks
from tests import workers_observer as W
from tests.placement import place

pytestmark = pytest.mark.timing  # its outcome depends on timing: `make stress` runs it under load

WORLD = 4
STEPS = 10  # workers_observer.train's default


def fault(request):
    """The faulty rank and step of this test (tests/placement.py): any rank, from the second step (the last step
    every rank finished is then a real one) to the last but one."""
    return place(request, ranks=range(WORLD), steps=range(2, STEPS))


def at(pl) -> dict:
    return {"fault_rank": pl.rank, "fault_step": pl.step}


class Job:
    """A 4-rank training job with observers, run in a background thread so the test can watch the ledger,
    then kill whatever is left (trainers and observers, by pid) on exit."""

    def __init__(self, root: Path, scenario: str, **opts):
        self.root, self.scenario, self.opts = root, scenario, opts
        self.run_id = f"test-{scenario}"
        self.outcomes = None
        Ledger.open(root, create=True).close()  # as the Checkpointer does before starting observers
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        self.outcomes = run_ranks(
            W.train, WORLD, str(self.root), self.run_id, self.scenario, self.opts, timeout=150, allow_failures=True
        )

    def __enter__(self):
        self.thread.start()
        return self

    def statuses(self) -> dict[int, dict]:
        out = {}
        for r in range(WORLD):
            p = channel_dir(self.root, self.run_id) / f"status-{r}.json"
            try:
                out[r] = json.loads(p.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                pass
        return out

    def events(self) -> list[dict]:
        with Ledger.open(self.root, readonly=True) as ledger:
            return ledger.events()

    def wait_event(self, kind: str, timeout: float = 120.0) -> list[dict]:  # spawn is slow on a loaded machine
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            evs = self.events()
            if any(e["kind"] == kind for e in evs):
                return evs
            time.sleep(0.1)
        raise AssertionError(f"no {kind} event within {timeout}s; events: {self.events()}")

    def kill_trainers(self):
        for row in self.statuses().values():
            if proc_state(row["pid"]) not in (None, "Z"):
                os.kill(row["pid"], signal.SIGKILL)

    def wait_observers_exit(self, timeout: float = 20.0) -> None:
        pids = [row["observer_pid"] for row in self.statuses().values()]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(proc_state(p) not in (None, "Z") for p in pids):
            time.sleep(0.1)
        left = [p for p in pids if proc_state(p) not in (None, "Z")]
        for p in left:
            os.kill(p, signal.SIGKILL)
        assert not left, f"observers {left} did not exit after their trainers"

    def __exit__(self, *exc):
        if self.thread.is_alive():
            self.kill_trainers()
        self.thread.join(180)
        self.wait_observers_exit()


def report_of(root: Path, event: dict) -> dict:
    return json.loads((root / event["detail"]["report"]).read_text())


def only(events: list[dict]) -> dict:
    assert len(events) == 1, events
    return events[0]


# ---- faults on real gloo ranks ------------------------------------------------------------------------------


def test_hang_is_attributed_to_the_blocked_rank_with_its_stack(tmp_path, request):
    pl = fault(request)
    r = pl.rank
    with Job(tmp_path, "hang", **at(pl)) as job:
        job.wait_event("hang")
        job.kill_trainers()  # the supervisor's kill after a reported hang is not a new crash
    ev = only(job.events())
    # the hung rank never finished its fault step: the last step every rank finished is the one before
    assert ev["kind"] == "hang" and ev["ranks"] == [r] and ev["step"] == pl.step - 1, (pl, ev)
    assert ev["detail"]["attribution"] == "strict_majority", pl
    assert "injected_hang_before_all_reduce" in ev["detail"]["stacks"][str(r)], pl
    assert "thread 0x" in ev["detail"]["stacks"][str(r)].lower(), pl  # faulthandler all_threads format
    table = {row["rank"]: row for row in ev["detail"]["progress"]}
    assert [table[q]["in_coll"] for q in range(WORLD)] == [q != r for q in range(WORLD)], (pl, table)
    report = report_of(tmp_path, ev)
    assert report["kind"] == "hang" and report["ranks"] == [r], (pl, report)


def test_desync_names_the_rank_with_the_other_collective(tmp_path, request):
    pl = fault(request)
    r = pl.rank
    with Job(tmp_path, "desync", **at(pl)) as job:
        job.wait_event("desync")
        job.kill_trainers()
    ev = only(job.events())
    assert ev["kind"] == "desync" and ev["ranks"] == [r], (pl, ev)
    table = {row["rank"]: row for row in ev["detail"]["progress"]}
    assert len({table[q]["seq"] for q in range(WORLD)}) == 1, (pl, table)
    others = [q for q in range(WORLD) if q != r]
    assert len({table[q]["fp"] for q in others}) == 1 and table[r]["fp"] != table[others[0]]["fp"], (pl, table)


def test_sigkilled_rank_is_a_crash(tmp_path, request):
    pl = fault(request)
    with Job(tmp_path, "crash", **at(pl)) as job:
        job.wait_event("crash")
        job.thread.join(180)  # the survivors fail in their collective and exit by themselves
        job.wait_observers_exit()
    ev = only(job.events())
    assert ev["kind"] == "crash" and ev["ranks"] == [pl.rank], (pl, ev)
    assert [o.exitcode for o in job.outcomes] == [-signal.SIGKILL if q == pl.rank else 1 for q in range(WORLD)], pl


def test_sigstopped_rank_is_attributed(tmp_path, request):
    pl = fault(request)
    with Job(tmp_path, "sigstop", **at(pl)) as job:
        job.wait_event("hang")
        job.kill_trainers()
    ev = only(job.events())
    assert ev["kind"] == "hang" and ev["ranks"] == [pl.rank], (pl, ev)
    assert "stopped" in ev["detail"]["stacks"][str(pl.rank)], pl


def test_abort_action_kills_every_trainer(tmp_path, request):
    pl = fault(request)
    r = pl.rank
    with Job(tmp_path, "hang", action="abort", **at(pl)) as job:
        job.thread.join(180)  # nobody but the observers kills anything here
        assert not job.thread.is_alive(), pl
    # the hung rank can only have been SIGKILLed; the others were killed, or failed in their collective first
    # when a peer's kill reached them
    assert job.outcomes[r].exitcode == -signal.SIGKILL, pl
    rows = job.statuses()
    assert rows[r]["state"] == "aborted", (pl, rows)
    assert all(row["state"] == "aborted" or row["error"] for row in rows.values()), (pl, rows)
    # no trainer finished: each was killed, or failed in its collective first (a race even its own status cannot
    # settle: an observer can write "aborted" while its trainer is already failing)
    assert [o.exitcode for o in job.outcomes if o.exitcode == 0 or o.exitcode is None] == [], (pl, rows)
    ev = only(job.events())
    assert ev["kind"] == "hang" and ev["ranks"] == [r] and ev["detail"]["action"] == "abort", (pl, ev)


def test_slow_rank_is_a_straggler_and_a_healthy_run_has_no_events(tmp_path, request):
    # The hang threshold is far above any scheduling delay of a shared 2-core box (a rank descheduled for 1.5 s
    # is indistinguishable from a hang by design): these runs are about stragglers and false positives of the
    # verdicts that need no stall (desync, crash, straggler); hangs have their own tests above.
    straggler = {"window_s": 0.5, "min_steps": 3, "rounds": 3}
    healthy = tmp_path / "healthy"
    healthy.mkdir()
    with Job(healthy, "healthy", steps=40, compute_s=0.05, straggler=straggler, stall_s=60.0) as job:
        job.thread.join(180)
    assert not job.thread.is_alive()
    assert [o.exitcode for o in job.outcomes] == [0] * WORLD
    assert [o.result["seq"] for o in job.outcomes] == [40] * WORLD  # side-group collectives not counted
    rows = job.statuses()
    # the positive signal that the observers watched the whole run: every one saw step 40 and its trainer's
    # clean close, in rounds of its own, and wrote its final status. How many rounds fit in the run is the
    # machine's timing (an observer started late on a loaded host sees the 2 s run in one or two), not asserted.
    assert sorted(rows) == list(range(WORLD))
    assert {row["state"] for row in rows.values()} == {"closed"}
    assert all(row["step"] == 40 and row["beat"] >= 1 for row in rows.values()), rows
    job.wait_observers_exit()
    assert job.events() == []
    assert not any(row["torch_imported"] for row in rows.values())

    pl = place(request, ranks=range(WORLD))  # slow at every step
    slow = tmp_path / "slow"
    slow.mkdir()
    with Job(
        slow, "slow", steps=40, compute_s=0.05, slow_factor=3.0, straggler=straggler, stall_s=60.0, fault_rank=pl.rank
    ) as job:
        job.thread.join(180)
    events = job.events()
    assert events and {e["kind"] for e in events} == {"straggler"}, (pl, events)
    assert all(e["ranks"] == [pl.rank] for e in events), (pl, events)
    assert events[0]["detail"]["slowdown"] > 1, pl


# ---- the tracer ---------------------------------------------------------------------------------------------


def test_tracer_fingerprints_and_uninstall_restores_torch_distributed():
    outcomes = run_ranks(W.tracer_roundtrip, WORLD, timeout=150)
    results = [o.result for o in outcomes]
    for res in results:
        assert res["restored"] and not res["in_coll"]
        assert "all_reduce" in res["replaced"] and "all_gather_object" in res["replaced"]
        assert res["seq"] == res["hb_seq"] == res["hb_left"] == 5  # side-group calls were not counted
        fps = res["fps"]
        assert len({fps["ar3"], fps["ar3_max"], fps["ar4"], fps["ar3_f64"]}) == 4
        assert fps["ar3"] == fps["ar3_sum"]
        assert fps["bcast0"] != fps["bcast1"]
    for key in results[0]["fps"]:
        assert len({res["fps"][key] for res in results}) == 1, key  # equal on every rank
    assert len({res["hb_fp"] for res in results}) == 1


# ---- the heartbeat and the rule -----------------------------------------------------------------------------


def _hammer(hb: Heartbeat, n: int) -> None:
    for i in range(1, n + 1):
        hb.enter(i, i * 7919)
        hb.leave(i)
        if i % 100 == 0:
            hb.step(i // 100)
    hb.close(unlink=False)


def test_heartbeat_reader_never_sees_a_torn_record(tmp_path):
    path = str(tmp_path / "hb")
    hb = Heartbeat.create(path)  # the forked writer inherits the shared mapping
    proc = mp.get_context("fork").Process(target=_hammer, args=(hb, 200_000))
    proc.start()
    reader = HeartbeatReader(path)
    seen = 0
    while proc.is_alive() or seen == 0:
        s = reader.snapshot()
        assert s.fp_enter == s.seq_enter * 7919
        assert s.seq_leave in (s.seq_enter, s.seq_enter - 1)
        assert s.in_coll == (s.seq_leave == s.seq_enter - 1)
        seen += 1
    proc.join()
    final = reader.snapshot()
    assert final.closed and final.seq_enter == 200_000 and final.step == 2000


def _row(step, seq, *, state="running", in_coll=True, age=5.0, fp="a", error=False, phase="step", side=False):
    return {
        "state": state,
        "step": step,
        "seq": seq,
        "in_coll": in_coll,
        "age_s": age,
        "fp": fp,
        "error": error,
        "phase": phase,
        "in_side": side,
    }


@pytest.mark.parametrize(
    "rows, world, expect",
    [
        # one laggard behind the waiting majority
        ({0: _row(3, 9), 1: _row(3, 9), 2: _row(3, 8, in_coll=False), 3: _row(3, 9)}, 4, ("hang", [2])),
        # two against two: the two that stopped outside any collective, behind the two waiting ones
        (
            {0: _row(3, 9), 1: _row(3, 9), 2: _row(3, 8, in_coll=False), 3: _row(3, 8, in_coll=False)},
            4,
            ("hang", [2, 3]),
        ),
        # two against two, all four waiting in collectives at two points: a hang, seen, not attributed
        ({0: _row(3, 9), 1: _row(3, 9), 2: _row(3, 8), 3: _row(3, 8)}, 4, ("hang", [])),
        # two peers: no majority, but the collective sequence names the rank that stopped outside any collective
        # while the other waits in the next one
        ({0: _row(3, 9), 1: _row(3, 8, in_coll=False)}, 2, ("hang", [1])),
        # ... DDP without a hook: rank 0 issued native all-reduces rank 1 never issued (hung before backward)
        ({0: _row(7, 0, in_coll=False) | {"cseq": 13}, 1: _row(7, 0, in_coll=False) | {"cseq": 12}}, 2, ("hang", [1])),
        # ... hung in its optimizer: a step behind, the other waiting in the next step's backward
        (
            {
                0: _row(8, 0, in_coll=False, phase="backward") | {"cseq": 15},
                1: _row(7, 0, in_coll=False, phase="optimizer") | {"cseq": 14},
            },
            2,
            ("hang", [1]),
        ),
        # ... both waiting, in different collectives: a hang, seen, not attributed
        ({0: _row(3, 9), 1: _row(3, 8, side=True, in_coll=False)}, 2, ("hang", [])),
        # ... the rank behind in steps is ahead in the native count: ambiguous, not attributed
        ({0: _row(8, 0, in_coll=False) | {"cseq": 14}, 1: _row(7, 0, in_coll=False) | {"cseq": 16}}, 2, ("hang", [])),
        # ... nobody waits (both busy in their own code, e.g. an eval, at different steps): no verdict
        ({0: _row(8, 0, in_coll=False) | {"cseq": 14}, 1: _row(7, 0, in_coll=False) | {"cseq": 14}}, 2, None),
        # ... two against two in DDP: ranks 2 and 3 hung before backward, 0 and 1 in the all-reduce
        (
            {
                0: _row(7, 0, in_coll=False) | {"cseq": 13},
                1: _row(7, 0, in_coll=False) | {"cseq": 13},
                2: _row(7, 0, in_coll=False) | {"cseq": 12},
                3: _row(7, 0, in_coll=False) | {"cseq": 12},
            },
            4,
            ("hang", [2, 3]),
        ),
        # ... and only once both are stuck
        ({0: _row(3, 9), 1: _row(3, 8, in_coll=False, age=0.5)}, 2, None),
        # two ranks after a load: rank 1 waits in the first all-reduce while rank 0, the coordinator, still writes the
        # load's verdicts to the ledger (phase "checkpoint"): a slow checkpoint, not a hang of rank 0
        (
            {
                0: _row(5, 0, in_coll=False, phase="checkpoint") | {"cseq": 3},
                1: _row(6, 0, in_coll=False, phase="backward") | {"cseq": 4},
            },
            2,
            None,
        ),
        # two ranks, neither in a collective (a long save on both): no verdict
        ({0: _row(3, 9, in_coll=False, phase="checkpoint"), 1: _row(3, 8, in_coll=False)}, 2, None),
        # the majority not yet past the threshold
        ({0: _row(3, 9, age=0.5), 1: _row(3, 9, age=0.5), 2: _row(3, 8, in_coll=False)}, 3, None),
        # different fingerprints at the same point
        ({0: _row(3, 9), 1: _row(3, 9, fp="b"), 2: _row(3, 9)}, 3, ("desync", [1])),
        # a dead rank among live ones; victims of its death do not count
        ({0: _row(3, 9, state="gone", error=True), 1: _row(3, 9), 2: _row(3, 8, state="gone")}, 3, ("crash", [2])),
        # everyone gone without a word: a job-wide kill, not attributable
        ({0: _row(3, 9, state="gone"), 1: _row(3, 9, state="gone"), 2: _row(3, 9)}, 3, None),
        # a stopped rank inside the collective
        ({0: _row(3, 9), 1: _row(3, 9, state="stopped"), 2: _row(3, 9)}, 3, ("hang", [1])),
        # stuck inside DDP's C++ all-reduce (no traced collective open), one rank behind: still a hang
        (
            {
                0: _row(3, 9, in_coll=False, phase="backward"),
                1: _row(3, 9, in_coll=False, phase="backward"),
                2: _row(3, 7, in_coll=False),
            },
            3,
            ("hang", [2]),
        ),
        # a long save: everyone waits in a side-group collective at the same point, no laggard: no verdict
        (
            {
                0: _row(3, 9, in_coll=False, side=True),
                1: _row(3, 9, in_coll=False, side=True),
                2: _row(3, 9, in_coll=False, phase="checkpoint"),
            },
            3,
            None,
        ),
        # every rank inside the same training collective: a hang with nobody to blame
        ({0: _row(3, 9), 1: _row(3, 9), 2: _row(3, 9)}, 3, ("hang", [])),
        # a clean close is no fault
        ({0: _row(3, 9, state="closed"), 1: _row(3, 9, in_coll=False), 2: _row(3, 9, in_coll=False)}, 3, None),
        # DDP without a hook: equal traced numbers, rank 2's native count behind the others' (not in their all-reduce)
        (
            {
                0: _row(7, 4, in_coll=False, phase="backward") | {"cseq": 40},
                1: _row(7, 4, in_coll=False, phase="backward") | {"cseq": 40},
                2: _row(7, 4, in_coll=False) | {"cseq": 37},
            },
            3,
            ("hang", [2]),
        ),
        # ... the laggard one step behind (stuck in its optimizer step) while the others wait in the next backward
        (
            {
                0: _row(21, 4, in_coll=False, phase="optimizer") | {"cseq": 66},
                1: _row(22, 4, in_coll=False, phase="backward") | {"cseq": 69},
                2: _row(22, 4, in_coll=False, phase="backward") | {"cseq": 69},
            },
            3,
            ("hang", [0]),
        ),
        # a Python all_reduce at native position 31 on rank 1, where ranks 0 and 2 issued a native one (DDP's bucket)
        (
            {
                0: _row(11, 4, in_coll=False, age=0.0) | {"cseq": 33, "pos": 20},
                1: _row(11, 5, state="gone", fp="x") | {"cseq": 31, "pos": 31},
                2: _row(11, 4, in_coll=False, age=0.0) | {"cseq": 31, "pos": 20},
            },
            3,
            ("desync", [1]),
        ),
        # the same Python collective at the same position, another rank not there yet: nothing
        (
            {
                0: _row(11, 5, age=0.0) | {"cseq": 31, "pos": 31},
                1: _row(11, 5, age=0.0) | {"cseq": 31, "pos": 31},
                2: _row(11, 4, in_coll=False, age=0.0) | {"cseq": 30, "pos": 20},
            },
            3,
            None,
        ),
    ],
)
def test_attribution_rule(rows, world, expect):
    verdict = attribute(rows, world, stall_s=2.0)
    if expect is None:
        assert verdict is None
    else:
        assert (verdict["kind"], verdict["ranks"]) == expect
        if not verdict["ranks"] and verdict["kind"] == "hang" and verdict["attribution"] == "inconclusive":
            assert set(verdict["where"]) == set(rows)  # an unattributed hang says where every rank is


# ---- crash order, desync of dead ranks ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows, world, expect",
    [
        # torchrun tore everyone down, but rank 1 died 0.4 s before the others: it is named
        (
            {
                0: _row(3, 9, state="gone") | {"gone_at": 100.4},
                1: _row(3, 8, state="gone") | {"gone_at": 100.0},
                2: _row(3, 9, state="gone") | {"gone_at": 100.41},
            },
            3,
            ("crash", [1]),
        ),
        # all within milliseconds (a job-wide kill): nobody is named
        (
            {
                0: _row(3, 9, state="gone") | {"gone_at": 100.001},
                1: _row(3, 8, state="gone") | {"gone_at": 100.0},
                2: _row(3, 9, state="gone") | {"gone_at": 100.002},
            },
            3,
            None,
        ),
        # two of three died first: no strict majority is left to name them
        (
            {
                0: _row(3, 9, state="gone") | {"gone_at": 100.4},
                1: _row(3, 8, state="gone") | {"gone_at": 100.0},
                2: _row(3, 9, state="gone") | {"gone_at": 100.01},
            },
            3,
            None,
        ),
        # a mismatched collective that killed its rank (gloo aborts): still a desync, no stall needed
        ({0: _row(3, 9, age=0.0), 1: _row(3, 9, state="gone", fp="b"), 2: _row(3, 9, age=0.0)}, 3, ("desync", [1])),
    ],
)
def test_attribution_rule_for_deaths(rows, world, expect):
    verdict = attribute(rows, world, stall_s=2.0)
    assert (verdict["kind"], verdict["ranks"]) == expect if expect else verdict is None


def test_arrival_skew_names_the_last_to_arrive_and_ignores_save_steps():
    """Stragglers by arrival skew (DDP without a hook): rank 1 issues its first collective of each step 0.1 s
    after the others (3x a 0.05 s compute); rank 0 is late once every 5 steps (the coordinator's save work);
    scheduler jitter of 10 ms on everyone. Only rank 1 is named, with its slowdown, after 3 windows."""
    import random

    from scout_ckpt.observer.stragglers import ArrivalStragglers

    def run(late: dict[int, float]) -> list[dict]:
        rng = random.Random(0)
        mon, events, t = ArrivalStragglers(window_s=0.5), [], 0.0
        mon.update(0.0, {0, 1, 2})
        for step in range(1, 80):
            t += 0.05 + max(late.values(), default=0.0) + 0.01
            arrivals = {
                r: t + late.get(r, 0.0) - max(late.values(), default=0.0) + rng.uniform(0, 0.01) for r in range(3)
            }
            if step % 5 == 0:
                arrivals[0] += 0.3
            for r, a in arrivals.items():
                mon.add(r, [(step, a)])
            events += mon.update(t, {0, 1, 2})
        return events

    events = run({1: 0.1})
    assert [e["ranks"] for e in events] == [[1]]
    assert 2.0 < events[0]["detail"]["slowdown"] < 4.0
    assert run({}) == []


def test_compute_stamps_name_the_slow_rank_and_ignore_save_steps():
    """Stragglers by compute per step from step stamps (DDP with an optimizer given): rank 2 computes 3x, 2x
    or 1.5x a 0.08 s step; rank 0 does 0.3 s of extra work every 5 steps (the coordinator at a save) and every
    rank waits 0.2 s in the save's side collectives then; 5 ms of jitter. 3x and 2x are named with their
    slowdown after 3 windows; 1.5x sits at the rule's relative floor (50% above the median) and is not; a healthy
    run gives nothing."""
    import random

    from scout_ckpt.observer.stragglers import ComputeStragglers

    def run(factor: float) -> list[dict]:
        rng = random.Random(1)
        mon, events, t = ComputeStragglers(window_s=0.5), [], 0.0
        mon.update(0.0, {0, 1, 2})
        for step in range(1, 80):
            compute = {r: 0.08 * (factor if r == 2 else 1.0) + rng.uniform(0, 0.005) for r in range(3)}
            if step % 5 == 0:
                compute = {r: c + 0.2 + (0.3 if r == 0 else 0.0) for r, c in compute.items()}
            t += max(compute.values()) + 0.01
            for r, c in compute.items():
                left = 1000.0 * r + t  # each rank's own clock: only differences on one clock enter
                mon.add(r, [(step, left, left + c)])
            events += mon.update(t, {0, 1, 2})
        return events

    for factor, low, high in ((3.0, 2.5, 3.5), (2.0, 1.7, 2.3)):
        events = run(factor)
        assert [e["ranks"] for e in events] == [[2]], factor
        assert low < events[0]["detail"]["slowdown"] < high
        assert events[0]["detail"]["measure"] == "compute_stamps"
    assert run(1.5) == [] and run(1.0) == []


def test_busy_time_subtracts_the_union_of_waits_async_ones_until_completion():
    from scout_ckpt.observer.heartbeat import waited_within

    waits = [[1.0, 2.0], [1.5, 3.0], [4.0, None], [0.0, 0.5]]  # overlapping, one still in flight
    total, still_open = waited_within(waits, 0.2, 5.0)
    assert total == pytest.approx(0.3 + 2.0 + 1.0)
    assert still_open == [[4.0, None]]


def test_ddp_comm_hook_rules_on_real_ddp_modules(tmp_path):
    Ledger.open(tmp_path, create=True).close()
    outcomes = run_ranks(W.ddp_attach_rules, 2, str(tmp_path), timeout=120)
    for res in (o.result for o in outcomes):
        assert res["before_attach"] == 0  # the built-in reducer all-reduces in C++: unseen
        assert (res["given"], res["given_seen"], res["given_called"]) == ("registered", 1, 1)
        assert (res["default"], res["default_traced"], res["default_hooks"]) == ("counted", 0, 0)
        assert res["default_counted"] == 1 and res["published"]  # one bucket all-reduce, counted natively
        assert (res["ours"], res["ours_seen"]) == ("registered", 1)
        assert (res["kept"], res["kept_seen"]) == ("user_hook", 1)
        assert res["builtin"] == "builtin_hook" and res["plain_module"] == "not_ddp"
        assert res["grads_close"] and res["grads_close_after_stop"]
        assert res["open_waits"] == 0
        # step stamps: one per step after the first, the compute from the optimizer step to the next arrival;
        # judged by the order of events in the rank (its own clock marks around each call), never by durations
        stamps = res["stamps"]
        assert stamps["steps"] == [2, 3, 4, 5]
        slow = res["rank"] == 1
        for s, c in stamps["compute"].items():
            lo, hi = stamps["compute_window"][s]
            assert lo <= c <= hi, (s, c, stamps)  # from within step s-1's optimizer step to step s's arrival
            assert c >= 0.2 or not slow, (s, c)  # rank 1 slept 0.2 s in between (at step 4: after a
            # synchronous all_reduce, which does not end the step's compute)
        # DDP's buffer broadcast: the arrival is the forward's start (after the mark before the forward, before it
        # returned)
        for s, (lo, hi) in stamps["forward_window"].items():
            assert lo <= stamps["arrival"][s] <= hi, (s, stamps)
        assert res["hooks_left"] == (0, 0)  # stop removes the hooks
        # no collective in forward (DDP without buffers): the arrival is the end of the rank's own backward,
        # which includes rank 1's slow backward layer and none of rank 0's wait for it in the all-reduce
        back = res["backward_stamps"]
        assert back["steps"] == [2, 3, 4, 5], back
        for s, (lo, hi) in back["backward_window"].items():
            if s == 2:
                continue  # DDP's second forward broadcasts its rebuilt buckets: the arrival is that forward's start
            assert lo <= back["arrival"][s] <= hi, (s, back)
            assert back["compute"][s] >= 0.2 or not slow, (s, back)
            assert 0.0 <= back["cpu_wait"][s] <= back["compute"][s], (s, back)  # a wait for a CPU, within the span
        # the first step hooks every parameter, then only the last few to get their gradient stay hooked
        assert back["grad_hooks_kept"] == min(4, back["params"]) and back["grad_hooks_left"] == 0, back
