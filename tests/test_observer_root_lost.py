"""Losing node 0 loses the root (observer/root_lost.py): what the surviving aggregator records, over hand-written
rows of its own node (the rows' shape as tests/test_observer.py's rule tables). Node 0's ranks are named only
when everything the survivor sees waits for them or died of them and they are the only others; otherwise
nobody is blamed and the loss of the root is recorded without ranks."""

from __future__ import annotations

from scout_ckpt.observer import node_summary as ns
from scout_ckpt.observer import root_lost
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
