"""Certification follows lineage: once a save's evidence shows the live state bad, no later checkpoint of that
lineage is certified until a clean one is loaded, and by default the generation ends on every rank together so
that torchrun restarts from the latest clean step.

The user-shaped job is examples/train_fsdp.py (FSDP2 on every Linear and the root, AdamW, the Checkpointer's
defaults) under real `torchrun --max-restarts 1` on 2 gloo ranks. One low mantissa bit of one element of rank 1's
shard flips in memory between step 15's optimizer step and its save. The oracle is the job's own: the sha256 of
its full model and optimizer state printed at every save, after every load and at the end, compared with a
healthy run of the same script."""

from __future__ import annotations

import json

import pytest

from scout_ckpt import policy
from tests.conftest import run_cli
from tests.test_fsdp_torchrun import FLIP_INDEX, FLIP_PARAM, cli, loaded, run_job, saved_digests, states, verdict
from tests.torchrun_errors import why_failed

STEPS, EVERY, FLIP_STEP = "30", "5", 15


def final(recs, attempt=None) -> str:
    return next(r["digest"] for r in recs if r["event"] == "final" and (attempt is None or r["attempt"] == attempt))


# ---- pure ---------------------------------------------------------------------------------------------------


def test_live_faults_are_the_kinds_that_found_the_state_bad():
    ev = {
        "bytes": policy.evidence(policy.FAIL, [{"code": "digest_mismatch"}]),
        "consensus": policy.evidence(policy.INCONCLUSIVE, [{"code": "consensus_inconclusive"}]),
        "at_rest": policy.evidence(policy.FAIL, [{"code": "at_rest_changed"}]),
        "replay": policy.evidence(policy.MISSING),
        "invariants": policy.evidence(policy.PASS),
        "lineage": policy.evidence(policy.FAIL, [{"code": "lineage_tainted"}]),
    }
    assert policy.live_faults(ev) == ["at_rest", "consensus"]  # bytes are the disk's, lineage is not new evidence
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
    p, recs = run_job(
        tmp_path_factory.mktemp("healthy") / "run",
        "--steps",
        STEPS,
        "--save-every",
        EVERY,
        "--final-digest",
        restarts=0,
    )
    assert p.returncode == 0, why_failed(p.stderr)
    return recs


@pytest.mark.scenario
@pytest.mark.scenario_ci
def test_by_default_the_generation_ends_and_the_restart_finishes_bitwise_like_a_healthy_run(tmp_path, healthy):
    root = tmp_path / "run"
    p, recs = run_job(root, "--steps", STEPS, "--save-every", EVERY, "--flip", FLIP, "--final-digest")
    assert p.returncode == 0, why_failed(p.stderr)
    assert [r["step"] for r in recs if r["event"] == "fault"] == [FLIP_STEP]
    v = verdict(recs, 0, FLIP_STEP)
    assert v["state"] == "rejected" and v["live_fault"] == ["at_rest"]
    assert [(r["code"], r["ranks"], r["tensors"]) for r in v["reasons"]] == [("at_rest_changed", [1], [FLIP_PARAM])]
    # Generation 0 ended at that save (no later save of it), on every rank: torchrun restarted once.
    assert max(r["step"] for r in recs if r["event"] == "saved" and r["attempt"] == 0) == FLIP_STEP
    assert "LiveStateCorrupt" in p.stderr
    saved = saved_digests(recs)
    assert loaded(recs)[1] == (10, saved[(0, 10)])  # resumed from the latest clean step
    assert final(recs, attempt=1) == final(healthy)  # and finished as a healthy run does
    assert saved[(1, 30)] == saved_digests(healthy)[(0, 30)]
    assert states(root) == {s: "certified" for s in (5, 10, 15, 20, 25, 30)}  # 15 re-saved from clean state
    rc, out = cli("resume", root, "--latest-clean")
    assert rc == 0 and out["step"] == 30


@pytest.mark.scenario
def test_with_continue_every_later_save_is_rejected_until_a_clean_load(tmp_path, healthy):
    root = tmp_path / "run"
    p, recs = run_job(
        root,
        "--steps",
        STEPS,
        "--save-every",
        EVERY,
        "--flip",
        FLIP,
        "--final-digest",
        "--on-live-fault",
        "continue",
        restarts=0,
    )
    assert p.returncode == 0, why_failed(p.stderr)
    assert final(recs) != final(healthy)  # the job's state really carries the flip
    got = {r["step"]: r for r in recs if r["event"] == "saved"}
    assert got[FLIP_STEP]["state"] == "rejected"
    for s in (20, 25, 30):
        assert got[s]["state"] == "rejected", got[s]
        assert [(r["code"], r["since"]) for r in got[s]["reasons"]] == [("lineage_tainted", FLIP_STEP)]
    assert states(root) == {
        5: "certified",
        10: "certified",
        15: "rejected",
        20: "rejected",
        25: "rejected",
        30: "rejected",
    }
    rc, out = cli("resume", root, "--latest-clean")
    assert rc == 0 and out["step"] == 10


# ---- real gloo ranks, in-process: async saves and the clean load that ends a taint ----------------------------


def _diverge(rank, world, root, async_save, on_live_fault):
    """A replicated model; before the save of step 2 rank 1's copy of one weight drifts by one ulp (replicas
    disagree: consensus, with 2 peers, is inconclusive). Returns what each call did on this rank."""
    import torch

    from scout_ckpt import Checkpointer, LiveStateCorrupt, ModelOptimizerState

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"app": ModelOptimizerState(model, opt)}
    ck = Checkpointer(root, model=model, optimizer=opt, async_save=async_save, on_live_fault=on_live_fault)
    out = []

    def call(name, fn):
        try:
            v = fn()
            out.append((name, (v or {}).get("state"), [r["code"] for r in (v or {}).get("reasons", [])]))
        except LiveStateCorrupt as e:
            out.append((name, "raised", e.step))

    call("save1", lambda: ck.save(1, state))
    ck.wait()
    if rank == 1:
        with torch.no_grad():
            model.weight.view(-1)[5] = torch.nextafter(model.weight.view(-1)[5], torch.tensor(1.0))
    call("save2", lambda: ck.save(2, state))
    call("step3", lambda: ck.step(3))
    call("save3", lambda: ck.save(3, state))
    call("wait", lambda: ck.wait())
    call("load", lambda: {"state": str(ck.load_latest_clean(state))})
    call("save4", lambda: ck.save(4, state))
    call("wait4", lambda: ck.wait())
    ck.close()
    return out


def test_an_async_save_that_finds_the_live_state_bad_raises_at_the_next_call_on_every_rank(tmp_path):
    from scout_ckpt.testing.launch import run_ranks

    out = [o.result for o in run_ranks(_diverge, 2, str(tmp_path), True, "raise", timeout=120)]
    for calls in out:
        raised = [c for c in calls if c[1] == "raised"]
        assert raised and raised[0][2] == 2, calls  # the save of step 2's fault, raised once
        assert raised[0][0] in ("step3", "save3"), calls  # at the next call after its commit
        assert ("load", "1", []) in calls  # the clean load: step 1
        assert calls[-1] == ("wait4", None, []) and not [
            c for c in calls[calls.index(("load", "1", [])) :] if c[1] == "raised"
        ]
    rc, stdout, _ = run_cli("ls", tmp_path, "--json", check_rc=0)
    rows = {c["step"]: c["state"] for c in json.loads(stdout)["checkpoints"]}
    assert rows[1] == "certified" and rows[2] == "rejected" and rows[4] == "certified" and 3 not in rows
    rc, stdout, _ = run_cli("report", tmp_path, "--json", check_rc=0)
    live = [e for e in json.loads(stdout)["events"] if e["kind"] == "live_fault"]
    assert [(e["step"], e["detail"]["kinds"], e["detail"]["action"]) for e in live] == [
        (2, ["consensus"], "generation ended")
    ]


def test_continue_rejects_the_saves_of_a_tainted_lineage_until_a_clean_load(tmp_path):
    from scout_ckpt.testing.launch import run_ranks

    out = [o.result for o in run_ranks(_diverge, 2, str(tmp_path), False, "continue", timeout=120)]
    for calls in out:
        got = {c[0]: c for c in calls}
        assert got["save1"][1] == "certified"
        assert got["save2"][1] == "rejected" and "consensus_inconclusive" in got["save2"][2]
        assert got["save3"][1:] == ("rejected", ["consensus_inconclusive", "lineage_tainted"])  # still apart
        assert got["load"][1] == "1"
        assert got["save4"][1] == "certified"  # the clean load ended the taint
