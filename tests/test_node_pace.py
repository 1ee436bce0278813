"""A node slow as a whole is a straggler (observer/node_pace.py): the root compares the nodes' paces, hand-written
here as the nodes' summaries would carry them; a node's pace is its fastest rank's sample (StragglerJudge.pace),
so one slow rank never makes its node slow."""

from __future__ import annotations

from scout_ckpt.observer import node_summary as ns
from scout_ckpt.observer.node_pace import NodePaceJudge
from scout_ckpt.observer.stragglers import StragglerJudge

PER_NODE = 2


def job(paces: dict[int, float], window: int, measure: str = "compute_stamps", silent: dict | None = None) -> dict:
    """The root's merged summary of len(paces) nodes of PER_NODE ranks: node n's pace paces[n] s per step in its
    aggregator's window number `window`."""
    parts = []
    for n, s in paces.items():
        part = ns.summarize(n, f"host{n}", n * PER_NODE, n * PER_NODE + PER_NODE - 1, 1, {}, 4.0)
        part["pace"] = {str(n): [s, f"{measure}:{window}", 10 * window, measure]}
        parts.append(part)
    merged = ns.merge(parts)
    merged["silent"] = silent or {}
    return merged


def test_a_node_three_times_slower_is_named_with_its_ranks_after_three_windows_and_once():
    j = NodePaceJudge()
    got = [j.update(job({0: 0.05, 1: 0.15}, w)) for w in range(1, 6)]
    assert [len(e) for e in got] == [0, 0, 1, 0, 0]  # confirmed in the third window, then once per episode
    ev = got[2][0]
    assert ev["ranks"] == [2, 3] and ev["step"] == 30
    assert (ev["detail"]["scope"], ev["detail"]["node"], ev["detail"]["host"]) == ("node", 1, "host1")
    assert ev["detail"]["slowdown"] == 3.0


def test_a_window_counts_once_and_only_when_every_node_sent_a_new_one():
    j = NodePaceJudge(rounds=1)
    assert len(j.update(job({0: 0.05, 1: 0.15}, 1))) == 1
    assert j.update(job({0: 0.05, 1: 0.15}, 1)) == []  # the same windows again: nothing new
    part = job({0: 0.05, 1: 0.15}, 2)
    part["pace"]["0"][1] = "compute_stamps:1"  # node 0 has not judged a new window yet
    assert j.update(part) == [] and j.seen == {"0": "compute_stamps:1", "1": "compute_stamps:1"}


def test_healthy_nodes_silent_nodes_and_mixed_measures_give_nothing():
    j = NodePaceJudge(rounds=1)
    assert all(j.update(job({0: 0.05, 1: 0.055, 2: 0.048}, w)) == [] for w in range(1, 10))
    assert NodePaceJudge(rounds=1).update(job({0: 0.05, 1: 0.5}, 1, silent={"1": 3.0})) == []
    mixed = job({0: 0.05, 1: 0.5}, 1)
    mixed["pace"]["0"][3] = "busy_time"
    assert NodePaceJudge(rounds=1).update(mixed) == []
    one = job({0: 0.05, 1: 0.5}, 1)
    del one["pace"]["1"]  # a node without a pace yet (not all its ranks run)
    assert NodePaceJudge(rounds=1).update(one) == []


def test_three_nodes_one_slow_by_the_robust_rule():
    j = NodePaceJudge(rounds=2)
    got = [j.update(job({0: 0.05, 1: 0.051, 2: 0.2}, w)) for w in (1, 2)]
    assert got[0] == [] and [e["ranks"] for e in got[1]] == [[4, 5]]
    assert got[1][0]["detail"]["slowdown"] == round(0.2 / 0.051, 3)


def test_a_nodes_pace_is_its_fastest_ranks_so_one_slow_rank_leaves_its_node_on_pace():
    judge = StragglerJudge(2, window_s=1.0, min_steps=3, rounds=3)

    def rows(n: int, busy_fast: float, busy_slow: float) -> dict:
        base = {"state": "running", "live": True, "seq": 100, "cseq": 0, "step": n}
        return {0: {**base, "n_steps": n, "busy_sum": busy_fast}, 1: {**base, "n_steps": n, "busy_sum": busy_slow}}

    assert judge.pace() is None
    judge.update(0.0, rows(0, 0.0, 0.0))
    judge.update(1.5, rows(5, 0.5, 1.5))  # 0.1 s and 0.3 s per step
    assert judge.pace() == [0.1, "busy_time:1", 5, "busy_time"]
