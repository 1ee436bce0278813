"""What each evidence option of the Checkpointer changes, on one real 3-rank DDP job (tests/workers_ckpt.py
`option_effects`): the policy recorded in the ledger, the evidence recorded for the save, the verdict on a state
whose fault the option's evidence would catch, and what a load checks. Each case beside a default Checkpointer
given the same state, so the difference is the option's."""

from __future__ import annotations

import pytest

from scout_ckpt.testing.launch import run_ranks
from tests import workers_ckpt as w

LEDGER = "scout-ledger.db"


@pytest.fixture(scope="module")
def effects(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    out = run_ranks(w.option_effects, 3, str(root), timeout=300)
    for o in out[1:]:  # every rank saw the same verdicts
        assert {k: v["verdict"] for k, v in o.result.items() if k != "loads"} == {
            k: v["verdict"] for k, v in out[0].result.items() if k != "loads"
        }
    return root, out[0].result


def _codes(verdict) -> list[str]:
    return [r["code"] for r in verdict["reasons"]]


def test_consensus_false_drops_the_replica_comparison(effects):
    _, r = effects
    # the default: rank 1's replica differs, consensus names it and the save is rejected
    assert r["default_flip"]["verdict"]["state"] == "rejected"
    attributed = [x for x in r["default_flip"]["verdict"]["reasons"] if x["code"] == "consensus_attributed"]
    assert attributed and attributed[0]["ranks"] == [1] and "model.2.weight" in attributed[0]["tensors"]
    assert "consensus" in r["default_flip"]["recorded"]["policy"]["require"]
    # consensus=False: the run's policy does not require it, no consensus evidence is taken, the same state is
    # certified on bytes and invariants alone
    got = r["no_consensus"]
    assert got["verdict"] == {"state": "certified", "reasons": []}
    assert got["recorded"]["policy"]["require"] == ["bytes", "invariants"]
    assert "consensus" not in got["recorded"]["evidence"]


def test_consensus_exclude_leaves_only_the_named_tensors_out(effects):
    _, r = effects
    base = r["default_flip"]["recorded"]["evidence"]["consensus"]
    got = r["exclude"]
    assert got["verdict"]["state"] == "certified" and got["verdict"]["reasons"] == [], got["verdict"]
    ev = got["recorded"]["evidence"]["consensus"]
    assert ev["status"] == "pass" and "consensus" in got["recorded"]["policy"]["require"]
    assert ev["tensors_compared"] == base["tensors_compared"] - 1  # model.2.weight alone, the rest compared


def test_finite_false_drops_the_writers_finite_check(effects):
    _, r = effects
    bad = r["default_nan"]["verdict"]
    assert bad["state"] == "rejected" and "invariant_failed" in _codes(bad)
    assert r["default_nan"]["recorded"]["policy"]["invariants"] == ["finite"]
    got = r["no_finite"]
    assert got["verdict"]["state"] == "certified" and got["verdict"]["reasons"] == [], got["verdict"]
    assert got["recorded"]["policy"]["invariants"] == []
    assert got["recorded"]["policy"]["require"] == ["bytes", "consensus", "replay"]  # replay: on by default
    assert "invariants" not in got["recorded"]["evidence"]


def test_verify_load_false_records_no_signatures_and_loads_unchecked_values(effects):
    from scout_ckpt.ledger import Ledger

    root, r = effects
    assert r["journal_default"]["recorded"]["signatures"]  # the default signs the saved state
    assert "model.0.weight" in r["journal_default"]["recorded"]["signatures"]
    got = r["no_verify_load"]
    assert got["verdict"]["state"] == "certified"
    assert got["recorded"]["signatures"] == {}
    # a bit flipped right after dcp.load: the default rejects the step (load_mismatch) and has nothing older to
    # resume from, and its values are in the state now: the start is refused (StateOverwritten), never a start
    # from step 0 on them; verify_load=False resumes from it
    assert r["loads"] == {"no_verify_load": 1, "journal_default": "StateOverwritten"}
    with Ledger.open(root / "journal_default", readonly=True) as led:
        assert led.checkpoint(1)["state"] == "rejected"
        assert led.checkpoint(1)["reasons"][0]["code"] == "load_mismatch"
    with Ledger.open(root / "no_verify_load", readonly=True) as led:
        assert led.checkpoint(1)["state"] == "certified" and led.events(("load_mismatch",)) == []


def test_ledger_journal_delete_keeps_the_ledger_out_of_wal(effects):
    root, r = effects

    def header(name) -> int:
        # the SQLite file header, byte 18: 1 = rollback journal, 2 = WAL (read here, without SQLite)
        with open(root / name / LEDGER, "rb") as f:
            head = f.read(100)
        assert head.startswith(b"SQLite format 3\0")
        return head[18]

    assert r["journal_delete"]["verdict"]["state"] == "certified"
    assert header("journal_delete") == 1 and not (root / "journal_delete" / f"{LEDGER}-wal").exists()
    assert header("journal_default") == 2  # auto on a local disk: WAL
