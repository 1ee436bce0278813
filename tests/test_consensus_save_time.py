"""Replica groups and save-time consensus on real gloo ranks: DDP, HSDP 2x2, FSDP."""

from __future__ import annotations

import pytest

from scout_ckpt.consensus.groups import replica_groups
from scout_ckpt.policy import evaluate
from scout_ckpt.testing.launch import run_ranks
from tests import workers_consensus as W

WEIGHT = "app.model.0.weight"
EXP_AVG_SQ = "app.optim.state.2.exp_avg_sq"


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """Build the state once before forking: the first optimizer step imports torch._dynamo (about 1 s), which
    forked ranks then inherit instead of importing four times over."""
    W.replicated_state()


def evidences(out) -> dict:
    """The evidence of rank 0, after checking every rank returned exactly the same."""
    first = out[0].result["evidence"]
    for o in out:
        assert o.result["evidence"] == first, o.rank
    return first


# ---- groups ----------------------------------------------------------------------------------------------------


def test_replica_groups():
    assert replica_groups("ddp", 4) == [[0, 1, 2, 3]]
    assert replica_groups("DDP", 1) == [[0]]
    assert replica_groups("hsdp", 4, (2, 2)) == [[0, 2], [1, 3]]
    assert replica_groups("hsdp", 6, (3, 2)) == [[0, 2, 4], [1, 3, 5]]
    assert replica_groups("hsdp", 6, (2, 3)) == [[0, 3], [1, 4], [2, 5]]
    assert replica_groups("fsdp", 3) == [[0], [1], [2]]
    for bad in [("hsdp", 4, None), ("hsdp", 4, (3, 2)), ("tp", 4, None), ("ddp", 0, None)]:
        with pytest.raises(ValueError):
            replica_groups(*bad)


# ---- DDP -------------------------------------------------------------------------------------------------------


def test_ddp_healthy_passes():
    out = run_ranks(W.ddp_consensus, 4, timeout=120)
    ev = evidences(out)
    assert ev["status"] == "pass" and ev["reasons"] == []
    assert ev["groups"] == [
        {
            "members": [0, 1, 2, 3],
            "dims": ["dp"],
            "verdict": "agree",
            "attributed": [],
            "tensors_compared": ev["tensors_compared"],
        }
    ]
    # every parameter, every optimizer state tensor and the scalars (step, lr, param group fields)
    assert ev["tensors_compared"] > 20 and ev["duration_s"] >= 0
    assert [o.result["group_ranks"] for o in out] == [[0, 1, 2, 3]] * 4
    assert evaluate({"require": ["consensus"]}, {"consensus": ev}).certified


def test_ddp_one_flipped_bit_is_attributed_to_its_rank():
    out = run_ranks(W.ddp_consensus, 4, flips=[(2, WEIGHT)], timeout=120)
    ev = evidences(out)
    assert ev["status"] == "fail"
    assert ev["reasons"] == [
        {"code": "consensus_attributed", "ranks": [2], "tensors": [WEIGHT], "n_tensors": 1, "group": [0, 1, 2, 3]}
    ]
    assert ev["groups"][0]["verdict"] == "attributed" and ev["groups"][0]["attributed"] == [2]
    verdict = evaluate({"require": ["consensus"]}, {"consensus": ev})
    assert verdict.state == "rejected" and verdict.reasons[0]["code"] == "consensus_attributed"


def test_ddp_flips_on_two_ranks_in_different_tensors():
    out = run_ranks(W.ddp_consensus, 4, flips=[(3, WEIGHT), (0, EXP_AVG_SQ), (0, "extra.ema")], timeout=120)
    ev = evidences(out)
    assert ev["status"] == "fail"
    (reason,) = ev["reasons"]
    assert reason["ranks"] == [0, 3] and reason["tensors"] == sorted([WEIGHT, EXP_AVG_SQ, "extra.ema"])


def test_ddp_scalars_are_compared():
    ev = evidences(run_ranks(W.ddp_consensus, 3, flips=[(1, "app.optim.state.0.step")], timeout=120))
    assert ev["status"] == "fail" and ev["reasons"][0]["ranks"] == [1]  # Adam's step: a 0-d tensor
    ev = evidences(run_ranks(W.ddp_consensus, 3, step_rank=0, timeout=120))
    assert ev["status"] == "fail" and ev["reasons"][0]["ranks"] == [0]  # the training step: a Python int
    assert ev["reasons"][0]["tensors"] == ["step"]


def test_ddp_two_ranks_detect_but_cannot_attribute():
    out = run_ranks(W.ddp_consensus, 2, flips=[(1, WEIGHT)], timeout=120)
    ev = evidences(out)
    assert ev["status"] == "inconclusive"
    assert ev["reasons"] == [
        {"code": "consensus_inconclusive", "ranks": [0, 1], "tensors": [WEIGHT], "n_tensors": 1, "group": [0, 1]}
    ]
    assert evaluate({"require": ["consensus"]}, {"consensus": ev}).state == "rejected"  # fail closed
    assert evidences(run_ranks(W.ddp_consensus, 2, timeout=120))["status"] == "pass"


def test_ddp_a_rank_with_other_keys_is_attributed():
    out = run_ranks(W.ddp_consensus, 3, extra_key_rank=1, timeout=120)
    ev = evidences(out)
    assert ev["status"] == "fail"
    assert ev["reasons"][0]["ranks"] == [1] and ev["reasons"][0]["tensors"] == ["(state structure)"]


# ---- HSDP and FSDP ---------------------------------------------------------------------------------------------


def test_hsdp_2x2_compares_shards_within_replicate_groups():
    out = run_ranks(W.hsdp_consensus, 4, timeout=120)
    ev = evidences(out)
    assert ev["status"] == "pass"
    # plain state ("step") across the world, the shards within their replicate groups
    assert [(g["members"], g["dims"]) for g in ev["groups"]] == [
        ([0, 1, 2, 3], ["replicate", "shard"]),
        ([0, 2], ["replicate"]),
        ([1, 3], ["replicate"]),
    ]
    assert [g["tensors_compared"] for g in ev["groups"]] == [1, 2, 2]
    assert [o.result["group_ranks"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    local = [o.result["local_w"] for o in out]
    assert local[0] == local[2] != local[1] == local[3]  # peers hold the same shard, groups different ones
    ev = evidences(run_ranks(W.hsdp_consensus, 4, flip_rank=3, timeout=120))
    assert ev["status"] == "inconclusive"  # a pair cannot attribute
    assert ev["reasons"] == [
        {"code": "consensus_inconclusive", "ranks": [1, 3], "tensors": ["model.w"], "n_tensors": 1, "group": [1, 3]}
    ]
    assert [g["verdict"] for g in ev["groups"]] == ["agree", "agree", "inconclusive"]


def test_fsdp_is_not_applicable():
    out = run_ranks(W.fsdp_consensus, 4, timeout=60)
    ev = evidences(out)
    assert ev["status"] == "not_applicable"
    assert ev["reasons"] == [{"code": "no_replicas", "mode": "fsdp", "tensors": ["w"], "n_tensors": 1}]
    assert ev["tensors_compared"] == 2 and ev["plain_state_only"]  # lr and step, held by every rank
    assert ev["single_owner"] == 1 and ev["groups"][0]["members"] == [0, 1, 2, 3]
    assert all(o.result["group"] is None and o.result["group_ranks"] == [o.rank] for o in out)
    assert evaluate({"require": ["consensus"], "allow_not_applicable": ["consensus"]}, {"consensus": ev}).certified


def test_fsdp_plain_state_that_drifts_on_one_rank_is_attributed():
    """DCP saves one rank's copy of replicated plain state: a drifted copy must not pass for want of replicas."""
    ev = evidences(run_ranks(W.fsdp_consensus, 4, 2, timeout=60))
    assert ev["status"] == "fail"
    assert ev["reasons"][0]["code"] == "consensus_attributed"
    assert ev["reasons"][0]["ranks"] == [2] and ev["reasons"][0]["tensors"] == ["lr"]


def test_shard_partials_computed_in_the_background_equal_the_full_signatures():
    """A sync save's consensus thread signs the DTensor shards during the write once load verification asked for
    them; the rows it gives are the ones full_signatures takes, and the result is the whole tensors' signatures."""
    out = run_ranks(W.shard_partials_in_background, 2, timeout=60)
    for o in out:
        r = o.result
        assert r[False] == [] and r[True] == ["r", "v", "w"]  # only when asked, every DTensor leaf
        assert r["same_as_inline"]
        assert r["with_partials"] == r["inline"]
        for k in ("w", "v", "r"):
            assert r["inline"][k] == r["whole"][k], k  # saved on 2 ranks, equal to the unsharded tensor's
        assert r["tampered"] != r["inline"]["w"]
    assert out[0].result["inline"] == out[1].result["inline"]


# ---- replica signatures: xxh3 over CPU tensors, large ones in a thread pool ------------------------------------


def big_tensor_consensus(rank, world, flip_rank=None, threads=2):
    """save_time_consensus over large CPU tensors (hashed in the pool), a non-contiguous one among them; the rank
    `flip_rank` flips one bit in the middle of the non-contiguous tensor."""
    import torch

    from scout_ckpt.consensus import signatures as S
    from scout_ckpt.consensus.groups import ConsensusGroups
    from scout_ckpt.consensus.save_time import save_time_consensus

    S.THREADS = threads
    torch.manual_seed(0)
    state = {
        "model": {"emb": torch.randn(512, 1024), "w": torch.randn(1024, 300).t(), "b": torch.randn(300)},
        "step": 9,
    }
    if rank == flip_rank:  # one ulp, in place, in the non-contiguous (transposed) tensor
        w = state["model"]["w"]
        w[100, 500] = torch.nextafter(w[100, 500], torch.tensor(float("inf")))
    groups = ConsensusGroups.create("ddp", world, timeout_s=30)
    return {"evidence": save_time_consensus(state, groups)}


def test_large_cpu_tensors_pooled_xxh3():
    ev = evidences(run_ranks(big_tensor_consensus, 3, timeout=120))
    assert ev["status"] == "pass" and ev["tensors_compared"] == 4
    ev = evidences(run_ranks(big_tensor_consensus, 3, flip_rank=1, timeout=120))
    assert ev["status"] == "fail"
    assert ev["reasons"] == [
        {"code": "consensus_attributed", "ranks": [1], "tensors": ["model.w"], "n_tensors": 1, "group": [0, 1, 2]}
    ]
    ev = evidences(run_ranks(big_tensor_consensus, 3, flip_rank=2, threads=1, timeout=120))
    assert ev["status"] == "fail" and ev["reasons"][0]["ranks"] == [2]


def counted_consensus(rank, world, flip_rank=None):
    """ddp_consensus, counting the collectives save_time_consensus issues on this rank."""
    import torch.distributed as dist

    from scout_ckpt.consensus import save_time as ST
    from scout_ckpt.consensus.groups import ConsensusGroups
    from scout_ckpt.consensus.signatures import flatten_state

    state = W.replicated_state()
    groups = ConsensusGroups.create("ddp", world, timeout_s=30)
    if rank == flip_rank:
        W.flip_bit(flatten_state(state)[WEIGHT], element=3, bit=30)
    calls = {"all_gather": 0, "all_gather_object": 0}
    real = {name: getattr(dist, name) for name in calls}

    def counting(name):
        def call(*a, **k):
            calls[name] += 1
            return real[name](*a, **k)

        return call

    for name in calls:
        setattr(ST.dist, name, counting(name))
    try:
        ev = ST.save_time_consensus(state, groups)
    finally:
        for name, fn in real.items():
            setattr(ST.dist, name, fn)
    return {"evidence": ev, "calls": calls}


def test_healthy_ddp_consensus_is_one_small_collective():
    out = run_ranks(counted_consensus, 3, timeout=120)
    assert evidences(out)["status"] == "pass"
    assert all(o.result["calls"] == {"all_gather": 1, "all_gather_object": 0} for o in out)
    out = run_ranks(counted_consensus, 3, flip_rank=0, timeout=120)  # digests differ: the signatures follow
    ev = evidences(out)
    assert ev["status"] == "fail" and ev["reasons"][0]["ranks"] == [0] and ev["reasons"][0]["tensors"] == [WEIGHT]
    assert all(o.result["calls"] == {"all_gather": 2, "all_gather_object": 0} for o in out)
