"""Issue 9, item 1: the ledger is a state machine, enforced as compare-and-set on a real SQLite file.

Each test reproduces a way the old ledger handed out state it should not: a verdict overwriting a row that changed
meanwhile, a re-save erasing a quarantine or the history of a rejection, a commit landing on another attempt.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys

import pytest

from scout_ckpt.errors import Quarantined
from scout_ckpt.format import manifest
from scout_ckpt.format.layout import LEDGER_NAME, step_dirname
from scout_ckpt.ledger import ALLOWED, SCHEMA_VERSION, Ledger, journal
from scout_ckpt.ledger.schema import MIGRATIONS
from scout_ckpt.ops.settle import owner_alive, process_start
from tests.conftest import REPO, run_cli

BYTES_PASS = {"bytes": {"status": "pass", "reasons": []}}
FILES = [{"path": ".metadata", "size": 7, "digest": "d", "rank": 0}]


def _commit(led, step, attempt, state="certified", reasons=None, **kw):
    return led.record_commit(
        step,
        run_id="r1",
        path=f"step-{step}",
        nbytes=7,
        manifest_digest=f"m-{attempt}",
        files=FILES,
        evidence=BYTES_PASS,
        state=state,
        reasons=reasons or [],
        attempt=attempt,
        **kw,
    )


@pytest.fixture
def led(tmp_path):
    led = Ledger.open(tmp_path, create=True)
    led.begin_run("r1", world_size=1, topology={}, policy={"require": ["bytes"]})
    yield led
    led.close()


def _history(led, step):
    return [(c["state"], c["attempt"], c["outcome"]) for c in led.certifications(step, all_outcomes=True)]


def test_transition_table_matches_the_architecture():
    assert ALLOWED["writing"] >= {"committed", "rejected"}
    assert ALLOWED["committed"] >= {"certified", "rejected"}
    assert "certified" not in ALLOWED["rejected"] and "committed" not in ALLOWED["certified"]
    assert ALLOWED["quarantined"] == set() and ALLOWED["deleted"] == set()
    assert all("quarantined" in tos for s, tos in ALLOWED.items() if s not in ("quarantined", "deleted"))


def test_transition_is_compare_and_set_and_keeps_the_superseded_verdict(led):
    led.record_writing(10, "r1", "a1", "step-10")
    assert _commit(led, 10, "a1", "committed", [{"code": "replay_missing"}])
    # an operator quarantines while a (slow) evidence check is still computing its verdict on `committed`
    assert led.transition(
        10,
        "quarantined",
        [{"code": "quarantined", "detail": "x"}],
        source="operator",
        expect=("committed", "certified"),
    )
    assert not led.transition(10, "certified", [], source="certify", expect="committed", attempt="a1")
    row = led.checkpoint(10)
    assert row["state"] == "quarantined"
    sup = led.certifications(10, all_outcomes=True)[-1]
    assert (sup["state"], sup["outcome"], sup["source"]) == ("certified", "superseded", "certify")
    assert {"code": "superseded", "found": "quarantined", "attempt": "a1"} in sup["reasons"]
    # the default history lists applied verdicts only (what campaign and demo summaries count)
    assert "superseded" not in {c["outcome"] for c in led.certifications(10)}


def test_disallowed_moves_are_refused(led):
    led.record_writing(10, "r1", "a1", "step-10")
    _commit(led, 10, "a1", "rejected", [{"code": "digest_mismatch"}])
    with pytest.raises(ValueError, match="not an allowed transition"):
        led.transition(10, "certified", [], source="certify", expect="rejected")
    led.transition(10, "quarantined", [{"code": "quarantined"}], source="operator", expect="rejected")
    with pytest.raises(ValueError):
        led.transition(10, "deleted", [], source="gc", expect="quarantined")
    with pytest.raises(ValueError):
        led.transition(10, "certified", [], source="certify", expect="quarantined")
    assert led.transition(10, "rejected", [{"code": "digest_mismatch"}], source="operator", expect="quarantined")
    assert led.checkpoint(10)["state"] == "rejected"


def test_resave_of_a_quarantined_step_is_refused(led):
    led.record_writing(10, "r1", "a1", "step-10")
    _commit(led, 10, "a1")
    led.transition(
        10, "quarantined", [{"code": "quarantined", "detail": "loss spike"}], source="operator", expect="certified"
    )
    with pytest.raises(Quarantined, match="loss spike") as e:
        led.record_writing(10, "r1", "a2", "step-10")
    assert e.value.exit_code == 1
    row = led.checkpoint(10)
    assert (row["state"], row["attempt"]) == ("quarantined", "a1")
    assert led.files(10) and led.evidence(10)
    assert _history(led, 10)[-1] == ("writing", "a2", "refused")


def test_resave_of_a_rejected_step_is_a_new_attempt_that_keeps_the_rejection(led):
    led.record_writing(10, "r1", "a1", "step-10")
    _commit(led, 10, "a1", "rejected", [{"code": "consensus_attributed", "ranks": [2]}])
    led.record_writing(10, "r1", "a2", "step-10", owner={"host": "h", "pid": 42, "start": "7"})
    row = led.checkpoint(10)
    assert (row["state"], row["attempt"], row["owner_host"], row["owner_pid"], row["owner_start"]) == (
        "writing",
        "a2",
        "h",
        42,
        "7",
    )
    assert _commit(led, 10, "a2")
    row = led.checkpoint(10)
    assert (row["state"], row["owner_pid"]) == ("certified", None)
    assert _history(led, 10) == [
        ("writing", "a1", "applied"),
        ("rejected", "a1", "applied"),
        ("writing", "a2", "applied"),
        ("certified", "a2", "applied"),
    ]
    rejected = [c for c in led.certifications(10) if c["state"] == "rejected"]
    assert rejected[0]["reasons"] == [{"code": "consensus_attributed", "ranks": [2]}]


def test_commit_of_a_replaced_attempt_is_superseded(led):
    led.record_writing(10, "r1", "a1", "step-10")
    led.record_writing(10, "r1", "a2", "step-10")  # another save of the same step took over
    assert not _commit(led, 10, "a1")
    row = led.checkpoint(10)
    assert (row["state"], row["attempt"], row["manifest_digest"]) == ("writing", "a2", None)
    assert led.files(10) == []
    assert _history(led, 10)[-1] == ("certified", "a1", "superseded")


def test_commit_after_a_quarantine_during_the_save_records_evidence_not_state(led):
    led.record_writing(10, "r1", "a1", "step-10")
    led.transition(10, "quarantined", [{"code": "quarantined"}], source="operator", expect="writing")
    assert not _commit(led, 10, "a1")
    row = led.checkpoint(10)
    assert (row["state"], row["manifest_digest"]) == ("quarantined", "m-a1")
    assert led.evidence(10)["bytes"]["status"] == "pass" and led.files(10)


def test_v1_ledger_is_migrated(tmp_path):
    c = sqlite3.connect(tmp_path / LEDGER_NAME, isolation_level=None)
    c.executescript(MIGRATIONS[0])
    c.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    c.execute("INSERT INTO checkpoints(step, state, attempt, reasons) VALUES (5, 'certified', 'x', '[]')")
    c.execute("INSERT INTO certifications(step, state, reasons) VALUES (5, 'certified', '[]')")
    c.close()
    with Ledger.open(tmp_path) as led:
        assert led.checkpoint(5)["owner_pid"] is None
        assert [h["state"] for h in led.certifications(5)] == ["certified"]  # v1 rows (outcome NULL) count
    c = sqlite3.connect(tmp_path / LEDGER_NAME)
    assert c.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION) == "2"


# ---- real checkpoints, real processes ---------------------------------------------------------------------------

# certify in its own process, held inside its hashing (the progress callback of the library's certify) until the
# gate file exists: the window in which an operator's quarantine used to be overwritten.
_SLOW_CERTIFY = """
import json, sys, time
from pathlib import Path
from scout_ckpt.ops.certify import certify
root, gate = Path(sys.argv[1]), Path(sys.argv[2])
def factory(total):
    first = [True]
    def hold(n):
        if first[0]:
            first[0] = False
            print("hashing", flush=True)
            while not gate.exists():
                time.sleep(0.05)
    return hold
print(json.dumps(certify(root, [int(sys.argv[3])], progress_factory=factory)), flush=True)
"""


def test_certify_racing_a_quarantine_does_not_overwrite_it(ckpt_root, tmp_path):
    gate = tmp_path / "go"
    p = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CERTIFY, str(ckpt_root), str(gate), "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert p.stdout.readline().strip() == "hashing", p.stderr.read()
        run_cli("quarantine", ckpt_root, 4, "--reason", "loss spike at 4", check_rc=0)
        gate.touch()
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 0, err
    res = json.loads(out)[0]
    assert res["state"] == "quarantined" and res["superseded"]["state"] == "certified"
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert rc == 0 and json.loads(out)["step"] == 3
    with Ledger.open(ckpt_root, readonly=True) as led:
        last = led.certifications(4, all_outcomes=True)[-1]
        assert (last["source"], last["state"], last["outcome"]) == ("certify", "certified", "superseded")
    # the operator releases it: the state its recorded evidence gives, journaled beside the data
    rc, out, _ = run_cli("release", ckpt_root, 4, "--reason", "spike explained", "--json")
    assert rc == 0 and json.loads(out)["state"] == "certified"
    kinds = [(r["kind"], r["step"]) for r in journal.read(ckpt_root)]
    assert kinds[-2:] == [("quarantine", 4), ("release", 4)]
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert json.loads(out)["step"] == 4
    rc, _, err = run_cli("release", ckpt_root, 4, "--reason", "again")
    assert rc == 2 and "not quarantined" in err and len(err.strip().splitlines()) == 1


def _owner(proc) -> dict:
    return {"host": socket.gethostname(), "pid": proc.pid, "start": process_start(proc.pid)}


def test_settle_writing_rows_by_owner_liveness(ckpt_root):
    """certify settles `writing` rows with the one settler: a live save is left alone; a dead one whose step
    dir and manifest (same attempt) exist is completed; any other dead one is rejected save_interrupted."""
    alive = subprocess.Popen(["sleep", "120"])
    dead = subprocess.Popen(["sleep", "120"])
    dead_owner = _owner(dead)
    dead.kill()
    dead.wait()
    try:
        live_owner = _owner(alive)
        assert owner_alive(live_owner) is True and owner_alive(dead_owner) is False
        m, _ = manifest.read(ckpt_root / step_dirname(4))
        with Ledger.open(ckpt_root) as led:
            run_id = led.checkpoint(4)["run_id"]
            # step 4: renamed, but the ledger commit was lost when its owner died
            led.record_writing(4, run_id, m["attempt"], step_dirname(4), owner=dead_owner)
            led.record_writing(5, run_id, "live-1", step_dirname(5), owner=live_owner)  # a save in flight
            led.record_writing(7, run_id, "dead-1", step_dirname(7), owner=dead_owner)  # died before rename
        rc, out, _ = run_cli("certify", ckpt_root, "--json")
        assert rc == 1  # step 5 is not certified (yet)
        states = {r["step"]: r["state"] for r in json.loads(out)["results"]}
        assert states == {3: "certified", 4: "certified", 5: "writing", 7: "rejected"}
        with Ledger.open(ckpt_root, readonly=True) as led:
            assert led.checkpoint(7)["reasons"][0] == {"code": "save_interrupted", "attempt": "dead-1"}
            assert led.checkpoint(5)["owner_pid"] == alive.pid
            assert led.files(4) and led.evidence(4)["bytes"]["status"] == "pass"
    finally:
        alive.kill()
        alive.wait()
