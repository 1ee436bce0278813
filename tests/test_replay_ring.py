"""The ring sweep's rule (scout_ckpt/replay/ring.py): what a pattern of disagreeing pairs names. Each case places
the fault by hand (which rank's live step or arithmetic is wrong) and derives the pairs that must disagree from
that placement, independently of the code: rank r checks its predecessor p's live step with r's own arithmetic,
so the pair (p -> r) disagrees exactly when p's live step is wrong or r computes wrongly (not both: two wrongs of
different kinds make no agreement)."""

import itertools

import pytest

from scout_ckpt.replay import live as live_step
from scout_ckpt.replay.ring import judge, needs_tiebreak, predecessor, successor

A, OUT, GRAD, UNCH = live_step.SELF_AGREE, live_step.SELF_OUTPUT, live_step.SELF_GRAD, live_step.SELF_UNCHECKED


def outcomes_for(peers, live_wrong=(), compute_wrong=()):
    """Every rank's check of its predecessor, from where the faults are: the placement is the oracle."""
    out = {}
    for r in peers:
        p = predecessor(peers, r)
        bad = (p in live_wrong) != (r in compute_wrong)
        out[r] = OUT if bad else A
    return out


@pytest.mark.parametrize("n", [3, 4, 5])
def test_a_rank_that_computes_wrongly_everywhere_is_named_with_3_or_more(n):
    peers = list(range(n))
    for k in peers:  # a persistent fault: its live step and its replays are wrong
        status, ranks, detail = judge(outcomes_for(peers, live_wrong={k}, compute_wrong={k}), peers)
        assert (status, ranks) == ("ATTRIBUTED", [k])
        assert "live_disagree" not in detail


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_live_step_wrong_once_is_named_by_its_own_tiebreak(n):
    peers = list(range(n))
    for k in peers:
        o = outcomes_for(peers, live_wrong={k})
        assert needs_tiebreak(o, peers) == k
        status, ranks, detail = judge(o, peers, {k: OUT})  # k's own replay differs from its live step
        assert (status, ranks) == ("ATTRIBUTED", [k]) and detail["live_disagree"] is True


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_replay_wrong_once_is_inconclusive_naming_both_ranks_of_the_pair(n):
    peers = list(range(n))
    for k in peers:  # k's arithmetic was wrong once, in its replay of its predecessor's step
        o = outcomes_for(peers, compute_wrong={k})
        p = needs_tiebreak(o, peers)
        assert p == predecessor(peers, k)
        status, ranks, _ = judge(o, peers, {p: A})
        assert (status, ranks) == ("INCONCLUSIVE", sorted({p, k}))


def test_two_ranks_computing_wrongly_everywhere_is_inconclusive_never_a_wrong_name():
    peers = [0, 1]
    status, ranks, _ = judge(outcomes_for(peers, live_wrong={1}, compute_wrong={1}), peers)
    assert (status, ranks) == ("INCONCLUSIVE", [])


def test_healthy_ranks_agree_and_every_live_step_is_checked():
    for n in (2, 3, 7):
        peers = list(range(n))
        status, ranks, detail = judge({r: A for r in peers}, peers)
        assert (status, ranks) == ("AGREE", []) and detail["ring"]["checked"] == peers


def test_an_unchecked_pair_is_listed_and_never_a_fault():
    peers = [0, 1, 2]
    status, ranks, detail = judge({0: A, 1: UNCH, 2: A}, peers)
    assert (status, ranks) == ("AGREE", [])
    assert detail["ring"]["unchecked"] == [0] and detail["ring"]["checked"] == [1, 2]


def test_two_faults_at_once_never_name_a_healthy_rank():
    peers = list(range(5))
    for a, b in itertools.combinations(peers, 2):
        for kind_a, kind_b in itertools.product(("live", "both"), repeat=2):
            live = {x for x, k in ((a, kind_a), (b, kind_b))}
            comp = {x for x, k in ((a, kind_a), (b, kind_b)) if k == "both"}
            o = outcomes_for(peers, live_wrong=live, compute_wrong=comp)
            p = needs_tiebreak(o, peers)
            tb = {p: OUT if p in live - comp else A} if p is not None else None
            status, ranks, _ = judge(o, peers, tb)
            assert set(ranks) <= {a, b} | (
                {successor(peers, a), successor(peers, b)} if status == "INCONCLUSIVE" else set()
            ), (a, b, kind_a, kind_b, status, ranks)
            assert status != "AGREE"
