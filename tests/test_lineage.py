"""Certification follows lineage: once a save's evidence shows the live state bad, no later checkpoint of that
lineage is certified until a clean one is loaded, and by default the generation ends on every rank together so
that torchrun restarts from the latest clean step.

The user-shaped job is examples/train_fsdp.py (FSDP2 on every Linear and the root, AdamW, the Checkpointer's
defaults) under real `torchrun --max-restarts 1` on 2 gloo ranks. One low mantissa bit of one element of rank 1's
shard flips in memory between step 15's optimizer step and its save. The oracle is the job's own: the sha256 of
its full model and optimizer state printed at every save, after every load and at the end, compared with a
healthy run of the same script."""

from __future__ import annotations

import pytest

from scout_ckpt import policy
from tests.test_fsdp_torchrun import FLIP_INDEX, FLIP_PARAM, cli, loaded, run_job, saved_digests, states, verdict

STEPS, EVERY, FLIP_STEP = "30", "5", 15


def final(recs, attempt=None) -> str:
    return next(r["digest"] for r in recs if r["event"] == "final" and (attempt is None or r["attempt"] == attempt))


# ---- pure ---------------------------------------------------------------------------------------------------


def test_live_faults_are_the_kinds_that_found_the_state_bad():
    ev = {"bytes": policy.evidence(policy.FAIL, [{"code": "digest_mismatch"}]),
          "consensus": policy.evidence(policy.INCONCLUSIVE, [{"code": "consensus_inconclusive"}]),
          "at_rest": policy.evidence(policy.FAIL, [{"code": "at_rest_changed"}]),
          "replay": policy.evidence(policy.MISSING),
          "invariants": policy.evidence(policy.PASS),
          "lineage": policy.evidence(policy.FAIL, [{"code": "lineage_tainted"}])}
    assert policy.live_faults(ev) == ["at_rest", "consensus"]   # bytes are the disk's, lineage is not new evidence
    assert policy.live_faults({"bytes": policy.evidence(policy.FAIL)}) == []


def test_a_tainted_lineage_rejects_whatever_the_policy_requires():
    lineage = policy.lineage_evidence({"step": 15, "kinds": ["at_rest"]})
    v = policy.evaluate(policy.BYTES_ONLY, {"bytes": policy.evidence(policy.PASS), "lineage": lineage})
    assert v.state == "rejected"
    assert [(r["code"], r["since"], r["kinds"]) for r in v.reasons] == [("lineage_tainted", 15, ["at_rest"])]
    assert policy.lineage_evidence(None) is None


# ---- real torchrun ----------------------------------------------------------------------------------------------

FLIP = f"1:{FLIP_STEP}:{FLIP_PARAM}:{FLIP_INDEX}:0"


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """The same script with no fault: the digests a correct run has."""
    p, recs = run_job(tmp_path_factory.mktemp("healthy") / "run", "--steps", STEPS, "--save-every", EVERY,
                      "--final-digest", restarts=0)
    assert p.returncode == 0, p.stderr[-3000:]
    return recs


@pytest.mark.scenario
def test_by_default_the_generation_ends_and_the_restart_finishes_bitwise_like_a_healthy_run(tmp_path, healthy):
    root = tmp_path / "run"
    p, recs = run_job(root, "--steps", STEPS, "--save-every", EVERY, "--flip", FLIP, "--final-digest")
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["step"] for r in recs if r["event"] == "fault"] == [FLIP_STEP]
    v = verdict(recs, 0, FLIP_STEP)
    assert v["state"] == "rejected" and v["live_fault"] == ["at_rest"]
    assert [(r["code"], r["ranks"], r["tensors"]) for r in v["reasons"]] == [("at_rest_changed", [1], [FLIP_PARAM])]
    # Generation 0 ended at that save (no later save of it), on every rank: torchrun restarted once.
    assert max(r["step"] for r in recs if r["event"] == "saved" and r["attempt"] == 0) == FLIP_STEP
    assert "LiveStateCorrupt" in p.stderr
    saved = saved_digests(recs)
    assert loaded(recs)[1] == (10, saved[(0, 10)])                     # resumed from the latest clean step
    assert final(recs, attempt=1) == final(healthy)                    # and finished as a healthy run does
    assert saved[(1, 30)] == saved_digests(healthy)[(0, 30)]
    assert states(root) == {s: "certified" for s in (5, 10, 15, 20, 25, 30)}   # 15 re-saved from clean state
    rc, out = cli("resume", root, "--latest-clean")
    assert rc == 0 and out["step"] == 30


@pytest.mark.scenario
def test_with_continue_every_later_save_is_rejected_until_a_clean_load(tmp_path, healthy):
    root = tmp_path / "run"
    p, recs = run_job(root, "--steps", STEPS, "--save-every", EVERY, "--flip", FLIP, "--final-digest",
                      "--on-live-fault", "continue", restarts=0)
    assert p.returncode == 0, p.stderr[-3000:]
    assert final(recs) != final(healthy)                               # the job's state really carries the flip
    got = {r["step"]: r for r in recs if r["event"] == "saved"}
    assert got[FLIP_STEP]["state"] == "rejected"
    for s in (20, 25, 30):
        assert got[s]["state"] == "rejected", got[s]
        assert [(r["code"], r["since"]) for r in got[s]["reasons"]] == [("lineage_tainted", FLIP_STEP)]
    assert states(root) == {5: "certified", 10: "certified", 15: "rejected", 20: "rejected", 25: "rejected",
                            30: "rejected"}
    rc, out = cli("resume", root, "--latest-clean")
    assert rc == 0 and out["step"] == 10
