"""The observer's hierarchy as pure functions (observer/node_summary.py, observer/hierarchy.py): node summaries,
their merge up a tree, and the job-level verdict over them. Fast; the real processes are in
tests/test_observer_hierarchy_murphy.py and tests/test_multinode.py.

Oracles: the hand-written expectations of tests/test_observer.py's rule tables (a grouped table must give what
the table's author wrote for every rank's row), and tables built here with the culprit placed by the test.
"""

from __future__ import annotations

import pytest

from scout_ckpt.observer import hierarchy as hier
from scout_ckpt.observer import node_summary as ns
from tests import test_observer as flat

STALL = 2.0


def _tables(test) -> list:
    mark = next(m for m in test.pytestmark if m.name == "parametrize")
    return mark.args[1]


def _job(rows: dict[int, dict], per_node: int) -> dict:
    """The merged summary of `rows` ({rank: row}) cut into nodes of `per_node` consecutive ranks, as the
    aggregators would build them."""
    ranks = sorted(rows)
    parts = []
    for i in range(0, len(ranks), per_node):
        mine = ranks[i : i + per_node]
        node = i // per_node
        nodes_rows = {r: {**rows[r], "live": True} for r in mine}
        parts.append(ns.summarize(node, f"host{node}", mine[0], mine[-1], 1, nodes_rows, STALL))
    return ns.merge(parts)


@pytest.mark.parametrize(
    "rows, world, expect",
    _tables(flat.test_attribution_rule) + _tables(flat.test_attribution_rule_for_deaths),
)
@pytest.mark.parametrize("per_node", [1, 2, 3])
def test_grouped_verdict_is_the_hand_written_one(rows, world, expect, per_node):
    verdict = ns.judge(_job(rows, per_node), world, STALL)
    if expect is None:
        assert verdict is None
    else:
        assert (verdict["kind"], verdict["ranks"]) == expect


def _r(step=3, seq=9, **kw) -> dict:
    return {**flat._row(step, seq, age=kw.pop("age", 5.0), **kw), "cseq": 0, "pos": 0}


def test_a_minority_rank_inside_a_node_is_named_and_the_job_is_few_groups():
    world, per = 64, 8
    rows = {r: _r() for r in range(world)}
    rows[37] = _r(seq=8, in_coll=False)  # node 4's rank 5 never got to collective #9
    job = _job(rows, per)
    assert len(job["groups"]) == 2  # everyone else says the same thing: one group
    v = ns.judge(job, world, STALL)
    assert (v["kind"], v["ranks"], v["attribution"]) == ("hang", [37], "strict_majority")
    assert ns.node_of(job, 37) == (4, "host4")


def test_a_minority_node_is_named_by_its_fingerprint():
    world, per = 12, 4
    rows = {r: _r(age=0.0) for r in range(world)}
    for r in range(4, 8):  # node 1 entered collective #9 with another fingerprint
        rows[r] = _r(age=0.0, fp="b")
    v = ns.judge(_job(rows, per), world, STALL)
    assert (v["kind"], v["ranks"]) == ("desync", [4, 5, 6, 7])


def test_two_nodes_against_two_is_not_a_majority():
    rows = {r: _r(age=0.0, fp="a" if r < 4 else "b") for r in range(8)}
    v = ns.judge(_job(rows, 2), 8, STALL)
    assert (v["kind"], v["ranks"], v["attribution"]) == ("desync", [], "inconclusive")


def _silent_job(rows: dict[int, dict], per_node: int, silent: int) -> dict:
    parts = []
    for i in range(0, len(rows), per_node):
        node = i // per_node
        nrows = {r: {**rows[r], "live": True} for r in range(i, i + per_node)}
        s = ns.summarize(node, f"host{node}", i, i + per_node - 1, 1, nrows, STALL)
        parts.append(ns.mark_silent(s, node, 5.0) if node == silent else s)
    return ns.merge(parts)


def test_a_silent_node_the_job_waits_for_is_named():
    # node 1 (ranks 2, 3) stopped sending; its last word was "running, step 3"; ranks 0, 1, 4, 5 wait in #9
    rows = {r: _r() for r in range(6)}
    rows[2] = rows[3] = _r(seq=8, in_coll=False, age=0.0)
    v = ns.judge(_silent_job(rows, 2, silent=1), 6, STALL)
    assert (v["kind"], v["ranks"], v["attribution"], v["nodes_silent"]) == ("hang", [2, 3], "node_silent", [1])


def test_a_silent_node_whose_peers_keep_training_is_never_blamed():
    rows = {r: _r(age=0.0, in_coll=False) for r in range(6)}  # nobody stalled: training goes on
    assert ns.judge(_silent_job(rows, 2, silent=1), 6, STALL) is None


def test_a_silent_node_is_not_blamed_for_a_laggard_elsewhere():
    # rank 1 (node 0) hangs outside any collective; node 2 is silent: neither a majority nor "every rank seen
    # waits" holds, so nobody is named (the silent node least of all)
    rows = {r: _r() for r in range(6)}
    rows[1] = _r(seq=8, in_coll=False)
    assert ns.judge(_silent_job(rows, 2, silent=2), 6, STALL) is None


def test_a_dead_nodes_final_word_still_counts():
    # node 1's ranks were seen gone (their aggregator said so) before it fell silent: a crash by majority
    rows = {r: _r(age=0.0, in_coll=False) for r in range(6)}
    rows[3] = _r(state="gone", in_coll=False) | {"gone_at": 100.0}
    v = ns.judge(_silent_job(rows, 2, silent=1), 6, STALL)
    assert (v["kind"], v["ranks"]) == ("crash", [3])


# ---- the tree ------------------------------------------------------------------------------------------------


def test_groups_bound_every_readers_keys():
    assert hier.groups_of(2) == [[0, 1]]
    groups = hier.groups_of(12_500)
    assert sum(map(len, groups)) == 12_500 and max(map(len, groups)) <= 113 and len(groups) <= 113
    plan = hier.reads_per_round(12_500, 8)
    assert max(plan.values()) <= 2_000


class _Board:
    """A dict standing for the store (the store itself is measured in bench/_scale_observer.py)."""

    def __init__(self):
        self.keys: dict[str, dict] = {}
        self.reads = 0

    def read(self, keys):
        self.reads += len(keys)
        return {k: self.keys.get(k) for k in keys}


def test_a_silent_leader_does_not_make_its_nodes_silent():
    nodes, per = 6, 2
    groups = hier.groups_of(nodes, fan_in=3)  # [[0, 1, 2], [3, 4, 5]]: leaders 0 and 3
    assert [g[0] for g in groups] == [0, 3]
    board = _Board()
    rows = {r: _r() for r in range(nodes * per)}
    rows[9] = _r(seq=8, in_coll=False)  # node 4's second rank is the laggard

    def publish_nodes(beat):
        for n in range(nodes):
            nrows = {r: {**rows[r], "live": True} for r in range(n * per, n * per + per)}
            board.keys[hier.node_key(n)] = ns.summarize(n, f"h{n}", n * per, n * per + per - 1, beat, nrows, STALL)

    root_beats, leader_beats = hier.Beats(1.0), [hier.Beats(1.0), hier.Beats(1.0)]
    for t, beat in ((0.0, 1), (0.5, 2), (3.0, 3)):
        publish_nodes(beat)
        for g, members in enumerate(groups):
            if g == 1 and t > 0.5:
                continue  # leader 3 stops merging (its aggregator is stuck), its nodes' own summaries go on
            board.keys[hier.group_key(g)] = hier.leader_round(members, board.read, leader_beats[g], t, beat)
        job = hier.root_round(groups, board.read, root_beats, t)
    assert job["silent"] == {}  # the root read group 1's nodes itself: none of them is silent
    v = ns.judge(job, nodes * per, STALL)
    assert (v["kind"], v["ranks"]) == ("hang", [9])


def test_a_silent_nodes_rank_missing_from_its_last_summary_is_named_too():
    # node 1's aggregator sent one summary before its node died, rank 3's status not yet among it
    rows = {r: _r() for r in (0, 1, 4, 5)}
    parts = [
        ns.summarize(
            n, f"host{n}", 2 * n, 2 * n + 1, 1, {r: {**rows[r], "live": True} for r in (2 * n, 2 * n + 1)}, STALL
        )
        for n in (0, 2)
    ]
    one = ns.summarize(1, "host1", 2, 3, 1, {2: {**_r(step=0, seq=0, in_coll=False, age=0.0), "live": True}}, STALL)
    v = ns.judge(ns.merge([*parts, ns.mark_silent(one, 1, 3.0)]), 6, STALL)
    assert (v["kind"], v["ranks"], v["attribution"]) == ("hang", [2, 3], "node_silent")
