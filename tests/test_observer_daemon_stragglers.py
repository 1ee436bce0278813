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

WORLD = 3


def _run(*, native: bool, stamps_on: set[int], slow: int | None = 1, down: int | None = None,
         state: str = "running", world: int = WORLD, rule: dict | None = None,
         factor: float = 3.0) -> tuple[StragglerJudge, list[dict]]:
    rng = random.Random(2)
    judge = StragglerJudge(world, **({"window_s": 0.5} if rule is None else rule))
    rows = {r: {"state": "running", "live": True, "step": 0, "n_steps": 0, "busy_sum": 0.0, "seq": 0, "cseq": 0,
                "stamps": [], "arrivals": []} for r in range(world)}
    events, t = [], 0.0
    for step in range(1, 80):
        compute = {r: 0.05 * (factor if r == slow else 1.0) + rng.uniform(0, 0.005) for r in range(world)}
        left = t
        t += max(compute.values()) + 0.01
        for r, row in rows.items():
            row["step"], row["n_steps"] = step, step
            row["busy_sum"] += compute[r]
            row["cseq"] += 10
            row["seq"] = 0 if native else row["cseq"]          # native: the tracer saw almost none of them
            row["arrivals"] = (row["arrivals"] + [[step, left + compute[r]]])[-32:]
            if r in stamps_on:
                row["stamps"] = (row["stamps"] + [[step, 1000.0 * r + left, 1000.0 * r + left + compute[r]]])[-32:]
        if down is not None:  # "silent": the rank runs but its observer stopped beating
            rows[down].update({"live": False} if state == "silent" else {"state": state})
        events += judge.update(t, {r: dict(row) for r, row in rows.items()})
    return judge, events


@pytest.mark.parametrize("native, stamps_on, measure", [
    (True, {0, 1, 2}, "compute_stamps"),
    (True, {0, 2}, "arrival_skew"),       # rank 1 has no stamps (no model or optimizer given there)
    (False, {0, 1, 2}, None),             # Python-level collectives: busy time, whatever else the rows carry
])
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
