"""Consensus's exchange aggregated per node (consensus/node_exchange.py): the verdict computed from the nodes'
grouped headers is the flat one, and the one written here by hand.

Fast tests over hand-written header tables and signature rows: each case is judged three ways, (1) grouped: node
summaries -> merge -> decide -> verdict, as the aggregators and the coordinator compute it; (2) flat: every
member's header in member order, as group_exchange.group_verdict computes it (its per-tensor step gathers every
member's rows); (3) the expected verdict, written by hand. Then real gloo ranks laid out as torchrun nodes run a
save's consensus both ways on the same state and must give the same evidence, naming the rank flipped here."""

from __future__ import annotations

import struct

import pytest
import torch

from scout_ckpt.consensus import node_exchange as nx
from scout_ckpt.consensus.c3 import ATTRIBUTED, INCONCLUSIVE, c3_of_classes, c3_verdict, verdicts_from_gathered
from scout_ckpt.consensus.group_exchange import verdict_of_headers
from scout_ckpt.testing.launch import run_ranks
from tests import workers_node_consensus as W

NAMES = ["w", "b", "step"]


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """As tests/test_consensus_save_time.py: the first optimizer step's imports happen once, before forking."""
    from tests import workers_consensus

    workers_consensus.replicated_state()


GOOD = torch.tensor([[1, 10], [2, 20], [3, 30]], dtype=torch.int64)


def rows_with(tensor: int, value: int) -> torch.Tensor:
    """GOOD with one tensor's signature replaced."""
    r = GOOD.clone()
    r[tensor] = torch.tensor([value, value])
    return r


def header(sigs: torch.Tensor, structure: int = 7, t: float = 0.25, covers: int = 1) -> tuple[int, ...]:
    """A member's header as save_time builds it: (count, structure digest 2), digest of the rows (2), time, covers.
    The rows' digest here is any injective stand-in (the test's own), not the product's hash."""
    flat = [int(x) for x in sigs.flatten().tolist()]
    digest = (hash(tuple(flat)) & (2**62 - 1), len(flat))
    return (3, structure, structure * 2, *digest, struct.unpack("<q", struct.pack("<d", t))[0], covers)


def grouped(table: dict[int, tuple], rows: dict[int, torch.Tensor], members: list[int], nodes: list[list[int]]):
    """The per-node computation: each node's aggregator summarises its members' headers, the coordinator merges
    and decides, each member computes the verdict (SIGS: a class's rows fetched from its lowest rank)."""
    summaries = [nx.node_summary((r, (0, 0, table[r])) for r in node if r in members) for node in nodes]
    merged = nx.merge(summaries)
    classes, slowest, covers = merged[(0, 0)]
    decision = nx.decide(classes)
    fetched: list[int] = []

    def fetch(source):
        fetched.append(source)
        return rows[source]

    gv = nx.verdict(decision, NAMES, members, rows[members[0]], fetch)
    return decision, gv, slowest, covers, fetched


def flat(table: dict[int, tuple], rows: dict[int, torch.Tensor], members: list[int]):
    """save_time's flat path over every member's header, its per-tensor step over every member's rows."""
    hdrs = [torch.tensor(table[m], dtype=torch.int64) for m in members]
    gv, slowest, _, covers = verdict_of_headers(
        hdrs,
        members,
        NAMES,
        rows[members[0]],
        lambda: verdicts_from_gathered(torch.stack([rows[m] for m in members]), members, NAMES),
    )
    return gv, slowest, covers


def same_verdict(a, b) -> None:
    assert (a.status, a.group_ranks, a.attributed_ranks, a.attributed_tensors, a.inconclusive_tensors) == (
        b.status,
        b.group_ranks,
        b.attributed_ranks,
        b.attributed_tensors,
        b.inconclusive_tensors,
    )
    assert [r.status for r in a.per_tensor] == [r.status for r in b.per_tensor]
    assert [r.attributed for r in a.per_tensor] == [r.attributed for r in b.per_tensor]
    assert [r.classes for r in a.per_tensor] == [r.classes for r in b.per_tensor]


def judge(rows: dict[int, torch.Tensor], nodes: list[list[int]], members: list[int] | None = None, table=None):
    members = members if members is not None else sorted(r for n in nodes for r in n)
    table = table or {r: header(rows[r], t=0.1 * (r + 1)) for r in rows}
    decision, gv, slowest, covers, fetched = grouped(table, rows, members, nodes)
    fgv, fslowest, fcovers = flat(table, rows, members)
    same_verdict(gv, fgv)
    assert (slowest, covers) == (fslowest, fcovers)
    return decision, gv, fetched


def test_all_agree_is_one_class_per_node_and_one_entry_at_the_root():
    rows = {r: GOOD for r in range(8)}
    nodes = [[0, 1, 2, 3], [4, 5, 6, 7]]
    decision, gv, fetched = judge(rows, nodes)
    assert decision == (nx.AGREE,) and gv.status == "agree" and fetched == []
    s = nx.node_summary((r, (0, 0, header(GOOD, t=0.1 * (r + 1)))) for r in nodes[1])
    assert len(s[(0, 0)][0]) == 1 and list(s[(0, 0)][0].values()) == [(4, 8)]  # four ranks, one entry
    assert s[(0, 0)][1] == pytest.approx(0.8)


def test_a_minority_rank_inside_one_node_is_named():
    rows = {r: GOOD for r in range(8)} | {5: rows_with(1, 99)}
    decision, gv, fetched = judge(rows, [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert decision == (nx.SIGS, [(0, (0, 5, 6, 8)), (5, (5, 6))])
    assert fetched == [0, 5]  # one batch of rows per distinct class, not one per member
    assert gv.status == ATTRIBUTED and gv.attributed_ranks == [5] and gv.attributed_tensors == ["b"]


def test_a_whole_minority_node_is_named():
    rows = {r: GOOD for r in range(6)} | {4: rows_with(0, 5), 5: rows_with(0, 5)}
    decision, gv, _ = judge(rows, [[0, 1], [2, 3], [4, 5]])
    assert decision[0] == nx.SIGS and [c for c, _ in decision[1]] == [0, 4]
    assert gv.status == ATTRIBUTED and gv.attributed_ranks == [4, 5] and gv.attributed_tensors == ["w"]


def test_a_tie_between_two_nodes_is_inconclusive():
    rows = {0: GOOD, 1: GOOD, 2: rows_with(2, 4), 3: rows_with(2, 4)}
    _, gv, _ = judge(rows, [[0, 1], [2, 3]])
    assert gv.status == INCONCLUSIVE and gv.attributed_ranks == [] and gv.inconclusive_tensors == ["step"]


def test_two_minorities_on_different_tensors_are_both_named_per_tensor():
    # a whole-state vote would see three distinct values (no majority); per tensor each has a 4-of-6 majority
    rows = {r: GOOD for r in range(6)} | {1: rows_with(0, 8), 4: rows_with(2, 8)}
    _, gv, _ = judge(rows, [[0, 1, 2], [3, 4, 5]])
    assert gv.status == ATTRIBUTED and gv.attributed_ranks == [1, 4] and gv.attributed_tensors == ["w", "step"]


def test_a_different_structure_is_a_structure_verdict():
    rows = {r: GOOD for r in range(4)}
    table = {r: header(GOOD, structure=9 if r == 3 else 7) for r in range(4)}
    decision, gv, fetched = judge(rows, [[0, 1], [2, 3]], table=table)
    assert decision == (nx.STRUCTURE, [((3, 7, 14), (0, 3)), ((3, 9, 18), (3, 4))]) and fetched == []
    assert gv.status == ATTRIBUTED and gv.attributed_ranks == [3] and gv.attributed_tensors == ["(state structure)"]


def test_hsdp_replica_groups_across_nodes_are_judged_each_on_its_own():
    # replicate 3 x shard 2 on 6 ranks, nodes of two: groups [0, 2, 4] and [1, 3, 5], each spanning every node
    groups = [[0, 2, 4], [1, 3, 5]]
    nodes = [[0, 1], [2, 3], [4, 5]]
    rows = {r: GOOD + (r % 2) for r in range(6)} | {3: rows_with(1, 77)}
    table = {r: header(rows[r]) for r in range(6)}
    summaries = [
        nx.node_summary((r, (1, groups.index(next(g for g in groups if r in g)), table[r])) for r in node)
        for node in nodes
    ]
    merged = nx.merge(summaries)
    assert sorted(merged) == [(1, 0), (1, 1)]
    expected = {0: ("agree", []), 1: (ATTRIBUTED, [3])}
    for i, members in enumerate(groups):
        decision = nx.decide(merged[(1, i)][0])
        gv = nx.verdict(decision, NAMES, members, rows[members[0]], lambda s: rows[s])
        fgv, _, _ = flat(table, rows, members)
        same_verdict(gv, fgv)
        assert (gv.status, gv.attributed_ranks) == expected[i]


def test_classes_give_the_flat_c3_verdict():
    values = ["a", "b", "a", "c", "a"]
    by_value: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        by_value.setdefault(v, []).append(i)
    assert c3_of_classes(list(by_value.items())[::-1], 5) == c3_verdict(values)
    with pytest.raises(ValueError):
        c3_of_classes([("a", [0, 1])], 3)


def test_runs_and_fold():
    assert nx.runs([5, 1, 2, 3, 9]) == (1, 4, 5, 6, 9, 10) and nx.unruns((1, 4, 5, 6, 9, 10)) == [1, 2, 3, 5, 9]
    e = {"kind": 0, "group": 1, "verdict": "agree"}
    a = {
        "rank": 0,
        "entries": [e],
        "single": ["x"],
        "problems": [],
        "not_comparable": [("k", "why")],
        "n_selected": 3,
        "duration_s": 0.5,
        "covers": True,
    }
    b = {
        "rank": 3,
        "entries": [e],
        "single": ["y"],
        "problems": [("p", "bad")],
        "not_comparable": [],
        "n_selected": 4,
        "duration_s": 0.2,
        "covers": False,
    }
    once = nx.fold([a, b])
    assert nx.fold([nx.fold([a]), nx.fold([b])]) == once
    assert once["entries"] == {(0, 1): e} and once["single"] == {"x", "y"} and once["problems"] == {3: [("p", "bad")]}
    assert (once["n_selected"], once["duration_s"], once["covers"]) == (4, 0.5, False)


# ---- real gloo ranks laid out as torchrun nodes ------------------------------------------------------------------


def _both(out) -> dict:
    first = out[0].result
    for o in out:
        assert o.result == first, o.rank
    return first


@pytest.mark.scenario  # 7 s on an idle host; the HSDP twin below runs in `make test`, both rounds included
def test_ddp_per_node_evidence_is_the_flat_one_and_names_the_flipped_rank():
    out = _both(run_ranks(W.both_ways, 4, timeout=180, node_size=2, flip_rank=3))
    assert out["per_node"] == out["flat"]
    ev = out["per_node"]
    assert ev["status"] == "fail" and [r["ranks"] for r in ev["reasons"]] == [[3]]
    assert out["used_nodes"] is True and out["exchange"] == "per_node"


def test_hsdp_per_node_evidence_is_the_flat_one():
    out = _both(run_ranks(W.both_ways, 4, timeout=180, node_size=2, flip_rank=3, mode="hsdp", mesh_shape=(2, 2)))
    assert out["per_node"] == out["flat"]
    # HSDP 2x2 on nodes [0, 1], [2, 3]: replica groups [0, 2] and [1, 3] span both nodes; a pair that differs is
    # detected, never attributed
    ev = out["per_node"]
    assert ev["status"] == "inconclusive" and [g["verdict"] for g in ev["groups"]] == ["agree", "agree", "inconclusive"]
    assert ev["reasons"] == [
        {"code": "consensus_inconclusive", "ranks": [1, 3], "tensors": ["model.w"], "n_tensors": 1, "group": [1, 3]}
    ]
