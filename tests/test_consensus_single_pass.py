"""Issue 13: each byte is hashed once per rank at a save (the consensus pass feeds load verification, in a
background thread; async saves sign DCP's staged copy). These check that nothing is missed for it."""

from __future__ import annotations

import pytest

from scout_ckpt.testing.launch import run_ranks
from tests import workers_consensus as W


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """Build the state once before forking (the first optimizer step imports torch._dynamo), as
    test_consensus_save_time does."""
    W.replicated_state()


def test_reused_rows_give_the_same_signatures_and_a_divergent_replica_is_attributed():
    out = run_ranks(W.single_pass_consensus, 3, flip_rank=2, timeout=180)
    ev = out[0].result["evidence"]
    assert ev["status"] == "fail", ev
    assert ev["reasons"][0]["code"] == "consensus_attributed" and ev["reasons"][0]["ranks"] == [2]
    assert "app.model.0.weight" in ev["reasons"][0]["tensors"]
    for o in out:
        r = o.result
        assert r["n_known"] == r["n_leaves"] > 0  # every plain leaf's row came from the consensus pass
        assert r["reused"] == r["fresh"]  # ... and equals what a second pass computes
        assert r["evidence"] == ev
        assert r["complete"] is not None and r["odd_covers"] is False  # the same answer on every rank
    assert out[0].result["complete"] == out[1].result["complete"] != out[2].result["complete"]  # each its own bits


def test_healthy_replicas_agree_with_background_hashing():
    out = run_ranks(W.single_pass_consensus, 3, timeout=180)
    assert all(o.result["evidence"]["status"] == "pass" for o in out)
    assert all(o.result["held"] for o in out)  # nothing hashed before the gate opened
    assert all(o.result["reused"] == o.result["fresh"] == o.result["complete"] for o in out)
    assert not any(o.result["odd_covers"] for o in out)


def test_one_interior_element_of_a_shard_changes_the_full_signature():
    out = run_ranks(W.sharded_change_at_load, 2, timeout=180)
    for o in out:
        r = o.result
        assert r["before"] == r["whole"]  # sharding-independent
        assert r["after"] != r["before"]  # the change on one rank's shard reaches every rank


def _load_change(tmp_path, async_save: bool):
    out = run_ranks(W.checkpointer_load_change, 2, str(tmp_path / "ck"), async_save, timeout=300)
    for o in out:
        assert o.result["verdicts"] == ["certified", "certified"], o.result
        assert o.result["loaded"] == 1 and o.result["step"] == 1, o.result
    assert out[0].result["step2"] == "rejected"
    assert "load_mismatch" in out[0].result["step2_reasons"]


def test_a_changed_element_at_load_is_caught_after_a_sync_save(tmp_path):
    _load_change(tmp_path, async_save=False)


def test_a_changed_element_at_load_is_caught_after_an_async_save(tmp_path):
    _load_change(tmp_path, async_save=True)


# ---- the writer signs what it writes (consensus/in_flight.py) -----------------------------------------------------


def test_tensors_signed_while_written_give_the_same_verdicts(tmp_path):
    """Healthy: every rank's writer delivers the signatures of the tensors it writes, and the verdict is the same as
    consensus hashing every byte itself. One rank differing in an interior element of every large tensor: each is
    attributed to it, including those it wrote and signed in flight."""
    healthy = run_ranks(W.in_flight_consensus, 3, str(tmp_path / "a"), timeout=180)
    for o in healthy:
        r = o.result
        assert r["evidence"]["status"] == "pass" and r["fresh"]["status"] == "pass", r
        assert r["delivered"] == r["expected"] >= 1  # the writer signed its share on every rank
    assert sum(o.result["delivered"] for o in healthy) >= 6  # ... and between them every large contiguous tensor
    bad = run_ranks(W.in_flight_consensus, 3, str(tmp_path / "b"), flip_rank=1, timeout=180)
    for o in bad:
        ev, fresh = o.result["evidence"], o.result["fresh"]
        assert ev["status"] == "fail" and ev["reasons"] == fresh["reasons"], (ev, fresh)
        (reason,) = [x for x in ev["reasons"] if x["code"] == "consensus_attributed"]
        assert reason["ranks"] == [1] and reason["n_tensors"] == 9, reason
    assert any(o.result["delivered"] for o in bad if o.rank == 1)
