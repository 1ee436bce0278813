"""Issue 9, item 2: `ledger rebuild` never makes a checkpoint more trusted than it can verify itself.

Real checkpoints (the 3-rank `ckpt_root` run), the real command line. Each test reproduces a way the old rebuild
handed out state: it forgot quarantines and rejections (they lived only in the ledger) and took each manifest's
own word (`policy`, `evidence`) for the verdict, so an edited manifest certified.
"""

from __future__ import annotations

import json
import os

from scout_ckpt import policy
from scout_ckpt.format import manifest
from scout_ckpt.format.layout import LEDGER_NAME, MANIFEST_NAME, step_dirname
from scout_ckpt.ledger import Ledger, journal
from scout_ckpt.ops.certify import certify
from scout_ckpt.ops.operator import quarantine
from scout_ckpt.ops.rebuild import rebuild
from scout_ckpt.ops.rebuild_ledger import DEFAULT_POLICY, UNVERIFIED, decide, strictest
from tests.conftest import run_cli


def _lose_ledger(root):
    for suffix in ("", "-wal", "-shm"):
        p = root / f"{LEDGER_NAME}{suffix}"
        if p.exists():
            p.unlink()


def _states(root):
    with Ledger.open(root, readonly=True) as led:
        return {r["step"]: r["state"] for r in led.checkpoints()}


def test_strictest_policy_is_the_union_of_requirements():
    # what the manifest allows as not applicable survives only where the default allows it too
    assert strictest({"require": [], "allow_not_applicable": ["consensus", "bytes"]}) == {
        "require": DEFAULT_POLICY["require"],
        "allow_not_applicable": [],
    }
    p = strictest({"require": ["bytes", "replay"], "allow_not_applicable": ["consensus"], "invariants": ["finite"]})
    assert p["require"] == ["bytes", "invariants", "consensus", "replay"] and p["allow_not_applicable"] == []
    assert p["invariants"] == ["finite"]
    # replay not applicable (a run that never called ckpt.step) where the run's own policy allowed it
    assert strictest({"require": ["bytes", "replay"], "allow_not_applicable": ["replay", "bytes"]})[
        "allow_not_applicable"
    ] == ["replay"]
    assert strictest("garbage")["require"] == DEFAULT_POLICY["require"]


def test_decide_certifies_only_vouched_evidence():
    ok = {"status": "pass", "reasons": []}
    m = {"policy": {"require": []}, "evidence": {"invariants": ok, "consensus": ok}}
    nobody = {"quarantine": None, "verdict": None, "certified": False}
    d = decide(4, m, "D", ok, nobody, None)
    assert d["state"] == "committed" and d["reasons"][0]["code"] == UNVERIFIED
    assert d["evidence"]["consensus"]["status"] == "missing"  # so a later certify cannot promote it either
    vouched = {"quarantine": None, "verdict": {"state": "certified"}, "certified": True}
    assert decide(4, m, "D", ok, vouched, None)["state"] == "certified"
    # the old ledger caps: it had this manifest only committed
    assert decide(4, m, "D", ok, vouched, {"manifest_digest": "D", "state": "committed"})["state"] == "committed"
    bad = policy.evidence(policy.FAIL, [{"code": "digest_mismatch"}])
    assert decide(4, m, "D", bad, vouched, None)["state"] == "rejected"


def test_rebuild_restores_quarantine_and_rejections_from_the_journal(ckpt_root):
    """The ledger is lost; the journal beside the data still says: step 3 failed its load verification, step 4 is
    quarantined. Neither may come back as certified; releasing step 4 gives what its evidence gives."""
    assert all(r["state"] == "certified" for r in certify(ckpt_root))  # certified verdicts journaled
    with Ledger.open(ckpt_root) as led:  # what the checkpointer's load does on a mismatch (issue 9 item 4)
        journal.record_transition(
            led,
            ckpt_root,
            3,
            "rejected",
            [{"code": "load_mismatch", "differ": ["w"]}],
            source="load",
            expect="certified",
        )
    quarantine(ckpt_root, 4, "bad data")
    _lose_ledger(ckpt_root)
    rc, out, err = run_cli("ledger", "rebuild", ckpt_root, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    rows = {r["step"]: r for r in doc["checkpoints"]}
    assert rows[3]["state"] == "rejected" and rows[3]["reasons"][0]["code"] == "load_mismatch"
    assert rows[4]["state"] == "quarantined" and rows[4]["reasons"][0]["detail"] == "bad data"
    assert {(c["step"], c["before"], c["after"]) for c in doc["changes"]} == {
        (3, None, "rejected"),
        (4, None, "quarantined"),
    }
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert rc == 1 and json.loads(out)["step"] is None
    rc, out, _ = run_cli("release", ckpt_root, 4, "--reason", "checked", "--json")
    assert rc == 0 and json.loads(out)["state"] == "certified"
    # rebuild again, old ledger readable this time: nothing changes, the release stands
    rc, out, _ = run_cli("ledger", "rebuild", ckpt_root, "--json")
    assert rc == 0 and json.loads(out)["changes"] == [] and _states(ckpt_root) == {3: "rejected", 4: "certified"}


def test_rebuild_does_not_certify_an_edited_manifest(ckpt_root):
    path = ckpt_root / step_dirname(4) / MANIFEST_NAME
    m = json.loads(path.read_text())
    m["policy"] = {"require": [], "allow_not_applicable": ["bytes", "invariants", "consensus"], "invariants": []}
    m["evidence"]["consensus"] = {"status": "pass", "reasons": [], "note": "trust me"}
    path.write_text(json.dumps(m))
    rc, out, err = run_cli("ledger", "rebuild", ckpt_root, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["changes"] == [{"step": 4, "before": "certified", "after": "committed", "why": UNVERIFIED}]
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert json.loads(out)["step"] == 3
    # nor does certify promote it afterwards: it re-verifies bytes, but cannot re-establish consensus
    rc, out, _ = run_cli("certify", ckpt_root, "--step", 4, "--json")
    assert rc == 1 and json.loads(out)["results"][0]["state"] == "committed"


def test_rebuild_without_any_record_certifies_nothing(ckpt_root):
    """No ledger, no journal: the manifests' own word is all there is, and it is not enough."""
    _lose_ledger(ckpt_root)
    if journal.path(ckpt_root).exists():
        os.unlink(journal.path(ckpt_root))
    result = rebuild(ckpt_root)
    assert {r["step"]: r["state"] for r in result["checkpoints"]} == {3: "committed", 4: "committed"}
    assert all(r["reasons"][0]["code"] == UNVERIFIED for r in result["checkpoints"])
    assert manifest.read(ckpt_root / step_dirname(4))[0]["verdict"]["state"] == "certified"  # what it claimed


def test_default_policy_by_kind_of_checkpoint():
    """Adopted folders and vouched pure-FSDP runs keep a policy they can meet after a rebuild; an FSDP manifest
    whose policy vouched for nothing gets no exemption from consensus."""
    from scout_ckpt import policy
    from scout_ckpt.ops.rebuild_ledger import DEFAULT_POLICY, default_policy, strictest

    assert default_policy({"topology": {"mode": "adopted"}, "policy": policy.ADOPTED}) == policy.ADOPTED
    shard = {
        "topology": {"mode": "fsdp"},
        "policy": {"require": ["bytes", "shard_replay", "at_rest", "consensus"], "allow_not_applicable": ["consensus"]},
    }
    pol = strictest(shard["policy"], default_policy(shard))
    assert "consensus" in pol["allow_not_applicable"] and {"shard_replay", "at_rest"} <= set(pol["require"])
    vouched = {
        "topology": {"mode": "fsdp"},
        "policy": {
            "require": ["bytes"],
            "allow_not_applicable": ["consensus"],
            "invariants": [{"check": "spectral_bound", "hi": 9}],
        },
    }
    assert "consensus" in strictest(vouched["policy"], default_policy(vouched))["allow_not_applicable"]
    bare = {
        "topology": {"mode": "fsdp"},
        "policy": {"require": [], "allow_not_applicable": ["consensus"], "invariants": ["finite"]},
    }
    assert default_policy(bare) == DEFAULT_POLICY
    assert strictest(bare["policy"], default_policy(bare))["allow_not_applicable"] == []
