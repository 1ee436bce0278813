"""The observer judge's choice of straggler measure (observer/stragglers.py `StragglerJudge`), on synthetic status
rows as the daemon reads them: pure, no processes.

Rank 1 computes 3x a 0.05 s step in every measure at once (busy time, sampled arrivals, step stamps); what the rows
say about the job decides which measure names it: native collectives with stamps on every rank -> compute stamps,
native without stamps on one rank -> arrival skew, Python-level collectives -> busy time. A rank that is not
running, or whose observer stopped beating, leaves every rule unfed.
"""

from __future__ import annotations

import random

import pytest

from scout_ckpt.observer.stragglers import StragglerJudge

pytestmark = pytest.mark.timing  # its outcome depends on timing: `make stress` runs it under load

WORLD = 3


def _run(
    *,
    native: bool,
    stamps_on: set[int],
    slow: int | None = 1,
    down: int | None = None,
    state: str = "running",
    world: int = WORLD,
    rule: dict | None = None,
    factor: float = 3.0,
) -> tuple[StragglerJudge, list[dict]]:
    rng = random.Random(2)
    judge = StragglerJudge(world, **({"window_s": 0.5} if rule is None else rule))
    rows = {
        r: {
            "state": "running",
            "live": True,
            "step": 0,
            "n_steps": 0,
            "busy_sum": 0.0,
            "seq": 0,
            "cseq": 0,
            "stamps": [],
            "arrivals": [],
        }
        for r in range(world)
    }
    events, t = [], 0.0
    for step in range(1, 80):
        compute = {r: 0.05 * (factor if r == slow else 1.0) + rng.uniform(0, 0.005) for r in range(world)}
        left = t
        t += max(compute.values()) + 0.01
        for r, row in rows.items():
            row["step"], row["n_steps"] = step, step
            row["busy_sum"] += compute[r]
            row["cseq"] += 10
            row["seq"] = 0 if native else row["cseq"]  # native: the tracer saw almost none of them
            row["arrivals"] = (row["arrivals"] + [[step, left + compute[r]]])[-32:]
            if r in stamps_on:
                row["stamps"] = (row["stamps"] + [[step, 1000.0 * r + left, 1000.0 * r + left + compute[r]]])[-32:]
        if down is not None:  # "silent": the rank runs but its observer stopped beating
            rows[down].update({"live": False} if state == "silent" else {"state": state})
        events += judge.update(t, {r: dict(row) for r, row in rows.items()})
    return judge, events


@pytest.mark.parametrize(
    "native, stamps_on, measure",
    [
        (True, {0, 1, 2}, "compute_stamps"),
        (True, {0, 2}, "arrival_skew"),  # rank 1 has no stamps (no model or optimizer given there)
        (False, {0, 1, 2}, None),  # Python-level collectives: busy time, whatever else the rows carry
    ],
)
def test_the_rows_choose_the_measure_and_it_names_the_slow_rank(native, stamps_on, measure):
    judge, events = _run(native=native, stamps_on=stamps_on)
    assert [e["ranks"] for e in events] == [[1]]
    assert events[0]["detail"].get("measure") == measure
    assert 2.0 < events[0]["detail"]["slowdown"] < 4.0
    rules = {"compute_stamps": judge.compute, "arrival_skew": judge.arrival, None: judge.busy}
    for name, rule in rules.items():  # only the chosen rule reported anyone
        assert rule._reported == ({1} if name == measure else set()), name
    assert _run(native=native, stamps_on=stamps_on, slow=None)[1] == []


@pytest.mark.parametrize("state", ["stopped", "gone", "silent"])
def test_no_measure_while_a_rank_is_not_running(state):
    judge, events = _run(native=True, stamps_on={0, 1, 2}, down=2, state=state)
    assert events == []
    assert judge.compute.arrivals == {} and judge.arrival.arrivals == {} and judge.busy._start is None


@pytest.mark.parametrize("native, stamps_on", [(True, {0, 1}), (True, {0}), (False, {0, 1})])
def test_two_ranks_the_default_rule_names_the_slower_one(native, stamps_on):
    """No median exists with 2 ranks: the slower is named when it exceeds the faster by the default floors, with
    its slowdown over the faster ("rank 1 is 3.0x slower than rank 0"); 1.2x, or equal ranks, name nobody."""
    _judge, events = _run(native=native, stamps_on=stamps_on, world=2, rule={})
    assert [e["ranks"] for e in events] == [[1]]
    assert 2.5 < events[0]["detail"]["slowdown"] < 3.5 and "than rank 0" in events[0]["detail"]["reason"]
    assert _run(native=native, stamps_on=stamps_on, world=2, rule={}, factor=1.2)[1] == []
    assert _run(native=native, stamps_on=stamps_on, world=2, rule={}, slow=None)[1] == []


def _loaded_pair(*, slow: int | None, discount: bool, seconds: float = 12.0) -> list[dict]:
    """Two ranks of a DDP job (native collectives, step stamps) on a host so loaded that the scheduler serves rank
    0 less than rank 1 for the whole run: each step both ranks do 55 ms of their own work (a data loader's sleep,
    the model), and rank 0's training thread then waits 35-70 ms per step for a CPU, rank 1's 0-15 ms. `slow`: a
    rank whose own work is 3x (its data loader). `discount`: the stamps carry the run-queue wait (as the heartbeat
    writes them); without it they are the wall times alone, as a rule blind to the wait sees them."""
    rng = random.Random(7)
    judge = StragglerJudge(2)  # the defaults, as a user runs them
    rows = {
        r: {
            "state": "running",
            "live": True,
            "step": 0,
            "n_steps": 0,
            "busy_sum": 0.0,
            "seq": 0,
            "cseq": 0,
            "stamps": [],
            "arrivals": [],
        }
        for r in range(2)
    }
    events, t, step = [], 0.0, 0
    while t < seconds:
        step += 1
        own = {r: 0.055 * (3.0 if r == slow else 1.0) for r in range(2)}
        queued = {0: rng.uniform(0.035, 0.070), 1: rng.uniform(0.0, 0.015)}
        left = t
        t += max(own[r] + queued[r] for r in range(2)) + 0.005
        for r, row in rows.items():
            arrived = left + own[r] + queued[r]
            stamp = [step, left, arrived, queued[r]] if discount else [step, left, arrived]
            row["step"], row["n_steps"], row["cseq"] = step, step, row["cseq"] + 10
            row["stamps"] = (row["stamps"] + [stamp])[-32:]
        events += judge.update(t, {r: dict(row) for r, row in rows.items()})
    return events


def test_two_ranks_on_a_loaded_host_name_no_straggler_but_a_3x_rank_still():
    """The 2-rank pair rule on a loaded host: as wall time, rank 0's waits for a CPU make it 1.6-2x rank 1 for
    the whole run and the rule names it (the false straggler of a healthy 2-rank run at load average 25-28);
    with the waits subtracted (the stamps as the heartbeat writes them) nobody is named, and a rank whose own
    work is 3x is still named, as the slower one by its own work ("rank 1 is 3.0x slower than rank 0")."""
    blind = _loaded_pair(slow=None, discount=False)
    assert [e["ranks"] for e in blind] == [[0]], blind  # the trap is real: wall time names the unlucky rank
    assert _loaded_pair(slow=None, discount=True) == []
    for slow in (0, 1):  # the unlucky rank slow, or the lucky one
        named = _loaded_pair(slow=slow, discount=True)
        assert [e["ranks"] for e in named] == [[slow]], (slow, named)
        assert 2.5 < named[0]["detail"]["slowdown"] < 3.5 and f"than rank {1 - slow}" in named[0]["detail"]["reason"]
        assert "less the waits for a CPU" in named[0]["detail"]["reason"]
