"""Retention rules alone (retention.decide is pure), then plan/apply against a real ledger and directories."""

import pytest

from scout_ckpt.errors import BadInput
from scout_ckpt.format import layout
from scout_ckpt.ledger import Ledger
from scout_ckpt.ops import retention
from scout_ckpt.ops.settle import this_process_owner


def test_keep_counts_certified_checkpoints():
    p = retention.decide({10: "certified", 20: "certified", 30: "certified"}, keep=2)
    assert sorted(p.delete) == [10] and sorted(p.keep) == [20, 30] and p.protected == 30


def test_checkpoints_awaiting_evidence_newer_than_newest_certified_are_kept():
    # keep=1 used to delete the checkpoint just committed (still waiting for replay coverage).
    states = {5: "certified", 10: "committed", 15: "committed", 20: "writing"}
    p = retention.decide(states, keep=1)
    assert p.delete == {} and p.protected == 5
    assert p.keep == {5: "newest certified", 10: "awaiting evidence", 15: "awaiting evidence", 20: "awaiting evidence"}


def test_no_certified_checkpoint_yet_keeps_everything_awaiting():
    p = retention.decide({5: "committed", 10: "committed", 15: "rejected"}, keep=1)
    assert p.protected is None and sorted(p.keep) == [5, 10] and p.delete == {15: "rejected"}


def test_committed_older_than_newest_certified_and_rejected_go():
    states = {5: "committed", 10: "certified", 15: "rejected", 20: "certified", 25: "committed"}
    p = retention.decide(states, keep=1)
    assert p.delete == {5: "committed", 10: "certified", 15: "rejected"}
    assert sorted(p.keep) == [20, 25]


def test_quarantined_is_never_deleted():
    p = retention.decide({5: "quarantined", 10: "certified", 15: "certified"}, keep=1)
    assert p.keep[5] == "quarantined" and 5 not in p.delete


def test_deleted_row_with_a_directory_left_is_finished():
    assert retention.decide({5: "deleted", 10: "certified"}, keep=1).delete == {5: "deleted"}


def test_keep_below_one_is_refused():
    with pytest.raises(BadInput, match="at least 1"):
        retention.decide({}, keep=0)


def _commit(led, root, step, state, run_id="r"):
    led.record_writing(step, run_id, f"a{step}", layout.step_dirname(step), owner=this_process_owner())
    (root / layout.step_dirname(step)).mkdir()
    led.record_commit(
        step,
        run_id=run_id,
        path=layout.step_dirname(step),
        nbytes=0,
        manifest_digest="d",
        files=[],
        evidence={},
        state=state,
        reasons=[],
        attempt=f"a{step}",
    )


def test_apply_deletes_through_the_ledger_and_lists_temp_dirs_with_owner(tmp_path):
    with Ledger.open(tmp_path, create=True) as led:
        for step, state in ((5, "certified"), (10, "certified"), (15, "committed")):
            _commit(led, tmp_path, step, state)
        layout.create_tmp_dir(tmp_path / layout.tmp_dirname(20, "x-1"), {"run_id": "r", **this_process_owner()})
        dry = retention.apply(led, tmp_path, 1, dry_run=True)
        assert dry["delete"] == [5] and dry["dry_run"]
        assert [(p["alive"], p["owner"]["pid"]) for p in dry["partial"]] == [(True, this_process_owner()["pid"])]
        assert (tmp_path / "step-00000005").is_dir()
        # A concurrent operator decision wins over the plan (compare-and-set on the state the plan saw).
        led.transition(5, "quarantined", [{"code": "quarantined"}], source="operator", expect="certified")
        assert retention.apply(led, tmp_path, 1)["delete"] == []
        assert (tmp_path / "step-00000005").is_dir()
        led.transition(10, "rejected", [{"code": "x"}], source="certify", expect="certified")
        # step 10 is rejected now; step 15 is awaiting evidence with no certified step newer than 5 (quarantined)
        res = retention.apply(led, tmp_path, 1)
        assert res["delete"] == [10] and not (tmp_path / "step-00000010").exists()
        assert led.checkpoint(10)["state"] == "deleted"
        assert (tmp_path / "step-00000015").is_dir() and layout.list_tmp_dirs(tmp_path)


def test_a_concurrent_gc_removing_the_same_directory_is_not_an_error(tmp_path, monkeypatch):
    import shutil

    with Ledger.open(tmp_path, create=True) as led:
        for step in (5, 10):
            _commit(led, tmp_path, step, "certified")
        real = layout.remove_dir

        def raced(path):  # the other gc renamed and removed it just before us
            shutil.rmtree(path)
            real(path)

        monkeypatch.setattr(layout, "remove_dir", raced)
        assert retention.apply(led, tmp_path, 1)["delete"] == [5]
        assert led.checkpoint(5)["state"] == "deleted" and not (tmp_path / "step-00000005").exists()
