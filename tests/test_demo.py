"""The demo end to end: real worker processes, real gloo, real SIGKILL, real restarts."""

from __future__ import annotations

import json

import pytest

from scout_ckpt.demo import run_demo
from scout_ckpt.errors import BadInput
from scout_ckpt.ledger import Ledger

SMALL = dict(ranks=2, steps=12, save_every=4, quiet=True)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    return run_demo(tmp_path_factory.mktemp("clean") / "run", **SMALL)


@pytest.mark.slow
def test_uninterrupted_run_certifies_every_checkpoint(clean_run):
    r = clean_run
    assert r["completed"] and r["restarts"] == 0
    assert [(c["step"], c["state"]) for c in r["checkpoints"]] == [(4, "certified"), (8, "certified"),
                                                                   (12, "certified")]
    assert all(c["evidence"]["bytes"] == "pass" and c["bytes"] > 0 for c in r["checkpoints"])
    assert r["final_digest"].startswith("xxh3_128:")
    assert r["losses"]["last"] < r["losses"]["first"]
    assert not [e for e in r["events"] if e["kind"] in ("crash", "hang")]
    json.dumps(r)  # the `demo --json` document


@pytest.mark.slow
def test_crash_mid_save_restarts_and_resumes_bitwise(tmp_path, clean_run):
    """Rank 1 dies mid-write of the last checkpoint; step 4 rots on disk after its commit. The restarted job
    resumes from step 8 (the newest clean one) and ends bitwise where the uninterrupted run ended, and the
    post-run certification rejects the rotten step 4."""
    r = run_demo(tmp_path / "run", inject=["crash:rank=1:step=12", "bitflip:step=4"], **SMALL)
    assert r["completed"] and r["restarts"] == 1
    assert r["final_digest"] == clean_run["final_digest"]
    states = {c["step"]: c for c in r["checkpoints"]}
    assert states[8]["state"] == states[12]["state"] == "certified"
    assert states[4]["state"] == "rejected"
    assert "digest_mismatch" in {x["code"] for x in states[4]["reasons"]}
    crashes = [e for e in r["events"] if e["kind"] == "crash"]
    # the observers or (when they cannot attribute) the supervisor record it; both count steps from 1
    assert crashes and crashes[0]["ranks"] == [1] and crashes[0]["step"] in (11, 12)
    fired = {f["kind"]: f["fired"] for f in r["injections"]}
    assert [x["generation"] for x in fired["crash"]] == [0] and len(fired["bitflip"]) == 1
    with Ledger.open(r["dir"], readonly=True) as ledger:
        assert [run["resumed_from"] for run in ledger.runs()] == [None, 8]
        # the interrupted save at step 12 was recorded before the restarted job redid it
        assert any(c["step"] == 12 and c["state"] == "rejected" for c in ledger.certifications())


def test_bad_options_fail_before_starting(tmp_path):
    with pytest.raises(BadInput, match="--mode"):
        run_demo(tmp_path / "a", mode="zero", quiet=True)
    with pytest.raises(BadInput, match="rank 5 does not exist"):
        run_demo(tmp_path / "b", ranks=2, inject=["crash:rank=5:step=2"], quiet=True)
    with pytest.raises(BadInput, match="not a save step"):
        run_demo(tmp_path / "b", ranks=2, save_every=10, inject=["bitflip:step=15"], quiet=True)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("")
    with pytest.raises(BadInput, match="not an empty directory"):
        run_demo(tmp_path / "c", quiet=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.scenario
@pytest.mark.slow
def test_hang_is_detected_killed_and_restarted(tmp_path):
    """Rank 1 blocks forever before step 6's first collective; the job is killed and restarted, the hang is in
    the ledger against rank 1, and the restarted generation (which does not hang again) completes.
    Persistent faults (sdc, slow) keep firing in every generation."""
    r = run_demo(tmp_path / "run", ranks=2, steps=8, save_every=4, quiet=True, hang_timeout_s=6.0,
                 inject=["hang:rank=1:step=6", "sdc:rank=0:step=2", "slow:rank=0:factor=1.5"])
    assert r["completed"] and r["restarts"] == 1 and r["final_digest"]
    hangs = [e for e in r["events"] if e["kind"] == "hang"]
    assert hangs and hangs[0]["ranks"] == [1] and hangs[0]["step"] in (5, 6)
    assert r["generations"][0]["event"] == "hang"
    fired = {f["kind"]: sorted(x["generation"] for x in f["fired"]) for f in r["injections"]}
    assert fired == {"hang": [0], "sdc": [0, 1], "slow": [0, 1]}
    with Ledger.open(r["dir"], readonly=True) as ledger:
        assert [run["resumed_from"] for run in ledger.runs()] == [None, 4]
