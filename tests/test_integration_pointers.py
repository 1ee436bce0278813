"""integrations/pointers.refresh over a real ledger and real pointer files (DeepSpeed's `latest`, Megatron-LM's
tracker): a pointer naming a step that is not certified moves to the newest certified one, or aside; one naming a
certified step stays; one moved aside comes back once a step is certified again. End to end (real jobs, the CLI
commands) in tests/test_integration_deepspeed.py and test_integration_megatron.py."""

from __future__ import annotations

from pathlib import Path

from scout_ckpt.integrations import ds_folders, mg_folders
from scout_ckpt.integrations.pointers import refresh
from scout_ckpt.ledger import Ledger

BYTES_PASS = {"bytes": {"status": "pass", "reasons": []}}


def _root(tmp_path: Path, name) -> Path:
    root = tmp_path / "run"
    root.mkdir()
    with Ledger.open(root, create=True) as lg:
        lg.begin_run("r1", world_size=1, topology={"mode": "single"}, policy={"require": ["bytes"]})
        for step in (2, 4, 6):
            (root / name(step)).mkdir()
            lg.record_writing(step, "r1", f"a{step}", name(step))
            lg.record_commit(
                step,
                run_id="r1",
                path=name(step),
                nbytes=1,
                manifest_digest="m",
                files=[],
                evidence=BYTES_PASS,
                state="certified",
                reasons=[],
            )
    return root


def _set(root: Path, step: int, to: str, frm: str) -> None:
    with Ledger.open(root) as lg:
        assert lg.transition(step, to, [{"code": "test"}], source="operator", expect=frm)


def test_a_latest_naming_a_rejected_tag_moves_to_the_newest_certified(tmp_path):
    root = _root(tmp_path, ds_folders.folder_name)
    ds_folders.point_latest(root, "global_step6")
    _set(root, 6, "rejected", "certified")
    assert len(refresh(root)) == 1
    assert ds_folders.read_latest(root) == "global_step4"


def test_a_pointer_naming_a_certified_step_is_left_as_it_is(tmp_path):
    root = _root(tmp_path, ds_folders.folder_name)
    ds_folders.point_latest(root, "global_step2")
    assert refresh(root) == [] and ds_folders.read_latest(root) == "global_step2"


def test_with_nothing_certified_the_tracker_is_moved_aside_and_comes_back_when_one_is(tmp_path):
    root = _root(tmp_path, mg_folders.folder_name)
    mg_folders.point_tracker(root, 6)
    for step in (2, 4, 6):
        _set(root, step, "quarantined", "certified")
    refresh(root)
    assert not (root / mg_folders.TRACKER).exists() and (root / mg_folders.HIDDEN_TRACKER).read_text() == "6"
    _set(root, 4, "certified", "quarantined")  # an operator's release
    refresh(root)
    assert mg_folders.read_tracker(root) == "4"


def test_no_pointer_is_created_where_the_run_keeps_none(tmp_path):
    root = _root(tmp_path, ds_folders.folder_name)
    assert refresh(root) == [] and not (root / ds_folders.LATEST).exists()
