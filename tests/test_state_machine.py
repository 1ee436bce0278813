"""Issue 9, item 1: the ledger is a state machine, enforced as compare-and-set on a real SQLite file.

Each test reproduces a way the old ledger handed out state it should not: a verdict overwriting a row that changed
meanwhile, a re-save erasing a quarantine or the history of a rejection, a commit landing on another attempt.
"""

from __future__ import annotations

import sqlite3

import pytest

from scout_ckpt.errors import Quarantined
from scout_ckpt.layout import LEDGER_NAME
from scout_ckpt.ledger import ALLOWED, SCHEMA_VERSION, Ledger
from scout_ckpt.ledger.schema import MIGRATIONS

BYTES_PASS = {"bytes": {"status": "pass", "reasons": []}}
FILES = [{"path": ".metadata", "size": 7, "digest": "d", "rank": 0}]


def _commit(led, step, attempt, state="certified", reasons=None, **kw):
    return led.record_commit(step, run_id="r1", path=f"step-{step}", nbytes=7, manifest_digest=f"m-{attempt}",
                             files=FILES, evidence=BYTES_PASS, state=state, reasons=reasons or [], attempt=attempt,
                             **kw)


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
    assert led.transition(10, "quarantined", [{"code": "quarantined", "detail": "x"}], source="operator",
                          expect=("committed", "certified"))
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
    led.transition(10, "quarantined", [{"code": "quarantined", "detail": "loss spike"}], source="operator",
                   expect="certified")
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
        "writing", "a2", "h", 42, "7")
    assert _commit(led, 10, "a2")
    row = led.checkpoint(10)
    assert (row["state"], row["owner_pid"]) == ("certified", None)
    assert _history(led, 10) == [("writing", "a1", "applied"), ("rejected", "a1", "applied"),
                                 ("writing", "a2", "applied"), ("certified", "a2", "applied")]
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
