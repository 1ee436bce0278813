"""C3 verdicts (pure and over a real gloo group) and the statistical rule for timings."""

from __future__ import annotations

import random

import pytest

from scout_ckpt.consensus.c3 import AGREE, ATTRIBUTED, INCONCLUSIVE, C3Result, c3_verdict, combine
from scout_ckpt.consensus.timing import Confirmer, robust_outliers, threshold


@pytest.mark.parametrize(
    "values, status, attributed, majority",
    [
        (["a", "a", "a", "a"], AGREE, (), "a"),
        (["a", "a", "b", "a"], ATTRIBUTED, (2,), "a"),  # 4 peers, one odd
        (["b", "a", "a"], ATTRIBUTED, (0,), "a"),  # 3 peers, one odd
        (["a", "b"], INCONCLUSIVE, (), None),  # 2 peers: detect, never attribute
        (["a", "b", "a", "b"], INCONCLUSIVE, (), None),  # 2-2: no strict majority
        (["a", "a", "b", "c"], INCONCLUSIVE, (), None),  # 2 of 4 is not > 2
        (["a", "a", "a", "b", "c"], ATTRIBUTED, (3, 4), "a"),  # 3 of 5 attributes both others
        (["a", "b", "c"], INCONCLUSIVE, (), None),
        (["x"], AGREE, (), "x"),  # one peer agrees with itself
    ],
)
def test_verdict_table(values, status, attributed, majority):
    r = c3_verdict(values)
    assert (r.status, r.attributed, r.majority) == (status, attributed, majority)
    assert r.evidence and all(isinstance(e, str) for e in r.evidence)
    assert sorted(i for cls in r.classes for i in cls) == list(range(len(values)))


def test_verdict_compares_by_content():
    import torch

    sigs = [torch.tensor([1, 2]), torch.tensor([1, 2]), torch.tensor([1, 3])]
    assert c3_verdict(sigs).attributed == (2,)
    assert c3_verdict([[1, 2], (1, 2), [1, 2]]).status == AGREE


def test_verdict_is_deterministic_and_explains_itself():
    r = c3_verdict(["b", "a", "b", "b"])
    assert r == c3_verdict(["b", "a", "b", "b"])
    assert r.classes == ((0, 2, 3), (1,))
    assert "strict majority" in r.evidence[-1] and "[1]" in r.evidence[-1]
    assert "cannot be named" in c3_verdict(["a", "b"]).evidence[-1]
    with pytest.raises(ValueError):
        c3_verdict([])


def test_combine_per_tensor_verdicts():
    agree = C3Result(AGREE)
    odd2 = c3_verdict(["a", "a", "b", "a"])
    odd1 = c3_verdict(["a", "b", "a", "a"])
    split = c3_verdict(["a", "b", "a", "b"])
    ranks = [10, 11, 12, 13]
    gv = combine([agree, odd2, agree], ranks, ["w", "b", "step"])
    assert (gv.status, gv.attributed_ranks, gv.attributed_bitmap, gv.disagreeing_names) == (
        ATTRIBUTED,
        [12],
        0b100,
        ["b"],
    )
    gv = combine([odd2, odd1, split], ranks, ["x", "y", "z"])
    assert gv.status == ATTRIBUTED and gv.attributed_ranks == [11, 12] and gv.attributed_bitmap == 0b110
    assert gv.inconclusive_tensors == ["z"] and gv.disagreeing == [0, 1, 2]
    assert combine([split, agree], ranks).status == INCONCLUSIVE
    assert combine([agree, agree], ranks).status == AGREE
    assert combine([], ranks).status == AGREE


def test_a_rank_alone_agrees_without_a_collective():
    import torch

    from scout_ckpt.consensus.c3 import c3_over_group

    gv = c3_over_group(torch.ones(3, 2, dtype=torch.int64), None, [5], names=["a", "b", "c"])
    assert gv.status == AGREE and gv.group_ranks == [5] and len(gv.per_tensor) == 3
    with pytest.raises(ValueError):
        c3_over_group(torch.ones(3), None, [5])


def test_c3_over_a_gloo_group():
    from scout_ckpt.testing.launch import run_ranks
    from tests import workers_consensus as W

    out = run_ranks(W.c3_direct, 3, 2, 1, timeout=60)
    first = out[0].result
    assert all(o.result == first for o in out)  # identical on every rank
    assert first["status"] == ATTRIBUTED and first["attributed"] == [2] and first["attributed_bitmap"] == 0b100
    assert first["disagreeing"] == ["t1"]
    assert first["per_tensor"] == [["agree", []], ["attributed", [2]], ["agree", []], ["agree", []], ["agree", []]]
    out = run_ranks(W.c3_direct, 2, 1, 4, timeout=60)
    assert out[0].result == out[1].result
    assert out[0].result["status"] == INCONCLUSIVE and out[0].result["inconclusive_tensors"] == ["t4"]


# ---- timings -----------------------------------------------------------------------------------------------------


def test_healthy_noisy_samples_flag_nothing():
    rng = random.Random(0)
    confirmer = Confirmer(rounds=3)
    for _ in range(200):
        samples = {r: 0.2 * rng.uniform(0.8, 1.25) for r in range(8)}
        assert confirmer.update(robust_outliers(samples)) == {}


def test_a_three_times_slower_rank_is_confirmed_after_n_rounds():
    rng = random.Random(1)
    confirmer = Confirmer(rounds=3)
    confirmed_at = None
    for rnd in range(6):
        samples = {r: 0.2 * rng.uniform(0.9, 1.1) for r in range(4)}
        samples[2] = 0.6 * rng.uniform(0.95, 1.05)
        flagged = robust_outliers(samples)
        assert set(flagged) == {2} and 2.5 < flagged[2] < 3.5
        confirmed = confirmer.update(flagged)
        if confirmed and confirmed_at is None:
            confirmed_at = rnd
        assert set(confirmed) == ({2} if rnd >= 2 else set())
    assert confirmed_at == 2


def test_confirmation_needs_consecutive_rounds():
    c = Confirmer(rounds=2)
    assert c.update({1: 3.0}) == {}
    assert c.update({}) == {}  # the streak breaks
    assert c.update({1: 3.0}) == {}
    assert c.update({1: 2.5}) == {1: 2.5}
    assert c.update({1: 2.0, 3: 4.0}) == {1: 2.0}
    with pytest.raises(ValueError):
        Confirmer(rounds=0)


def test_floors_and_small_groups():
    # equal times (MAD 0): a sample 30% above the median stays under the relative floor
    assert robust_outliers({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.3}) == {}
    # tiny absolute differences stay under the absolute floor
    assert robust_outliers({0: 0.001, 1: 0.001, 2: 0.001, 3: 0.004}, abs_floor_s=0.01) == {}
    assert robust_outliers({0: 0.001, 1: 0.001, 2: 0.001, 3: 0.004}, abs_floor_s=0.0) == {3: pytest.approx(4.0)}
    # two samples: neither is the odd one out
    assert robust_outliers({0: 1.0, 1: 10.0}) == {}
    assert threshold({0: 1.0, 1: 1.0, 2: 1.0}) == pytest.approx(1.5)
    assert robust_outliers({0: 0.0, 1: 0.0, 2: 1.0}) == {2: float("inf")}
