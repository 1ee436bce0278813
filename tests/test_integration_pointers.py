"""integrations/pointers.refresh over a real ledger and real pointer files (DeepSpeed's `latest`, Megatron-LM's
tracker): a pointer naming a step that is not certified moves to the newest certified one, or aside; one naming a
certified step stays; one moved aside comes back once a step is certified again. The Trainer's `checkpoint-N`
folders, which transformers' resume reads by name alone, are set aside while the newest is rejected or
quarantined. End to end (real jobs, the CLI commands) in tests/test_integration_deepspeed.py,
test_integration_megatron.py and test_integration_transformers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

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


# ---- the Trainer's checkpoint-N folders (transformers' get_last_checkpoint reads only their names) --------------


def _last_checkpoint(root: Path) -> str | None:
    """transformers.trainer_utils.get_last_checkpoint's rule, restated as its source has it (the oracle here, torch
    and transformers free): the `checkpoint-N` directory of highest N."""
    import re

    found = [p for p in root.iterdir() if re.search(r"^checkpoint\-(\d+)$", p.name) and p.is_dir()]
    return max(found, key=lambda p: int(p.name.split("-")[1])).name if found else None


def test_the_trainers_newest_folders_are_set_aside_while_rejected_or_quarantined(tmp_path):
    from scout_ckpt.integrations import folders

    root = _root(tmp_path, folders.folder_name)
    (root / "checkpoint-6" / "model.safetensors").write_bytes(b"kept")
    _set(root, 6, "quarantined", "certified")
    _set(root, 4, "rejected", "certified")
    lines = refresh(root)
    assert len(lines) == 2 and _last_checkpoint(root) == "checkpoint-2"
    with Ledger.open(root, readonly=True) as lg:
        rows = {s: lg.checkpoint(s) for s in (2, 4, 6)}
        moves = [h for h in lg.certifications(6, all_outcomes=True) if h["outcome"] == "moved"]
    assert rows[6]["path"] == "checkpoint-6.scout-quarantined-a6" and rows[6]["state"] == "quarantined"
    assert rows[4]["path"] == "checkpoint-4.scout-rejected-a4" and rows[2]["path"] == "checkpoint-2"
    assert (root / rows[6]["path"] / "model.safetensors").read_bytes() == b"kept"  # moved, never deleted
    assert moves[0]["reasons"][0] == {"code": "moved", "from": "checkpoint-6", "to": rows[6]["path"]}
    assert refresh(root) == []  # nothing left to move


def test_a_certified_newest_folder_stops_the_set_aside_below_it(tmp_path):
    from scout_ckpt.integrations import folders

    root = _root(tmp_path, folders.folder_name)
    _set(root, 4, "quarantined", "certified")  # not the newest: the Trainer loads checkpoint-6, left alone
    assert refresh(root) == [] and (root / "checkpoint-4").is_dir()


def test_a_move_interrupted_between_the_rename_and_the_row_is_completed(tmp_path):
    from scout_ckpt.integrations import folders

    root = _root(tmp_path, folders.folder_name)
    _set(root, 6, "quarantined", "certified")
    (root / "checkpoint-6").rename(root / "checkpoint-6.scout-quarantined-a6")  # the crash: the row still names it
    assert len(refresh(root)) == 1
    with Ledger.open(root, readonly=True) as lg:
        assert lg.checkpoint(6)["path"] == "checkpoint-6.scout-quarantined-a6"


def test_a_quarantined_step_is_saved_anew_only_once_its_folder_is_set_aside(tmp_path):
    """Ledger.record_writing(over_quarantined=True), as IntegrationRun.begin_save calls it: refused while the
    quarantined row still names the folder the save would write, accepted once that folder was set aside; the
    quarantine stays in the step's history."""
    from scout_ckpt.errors import Quarantined
    from scout_ckpt.integrations import folders

    root = _root(tmp_path, folders.folder_name)
    _set(root, 6, "quarantined", "certified")
    with Ledger.open(root) as lg:
        with pytest.raises(Quarantined):
            lg.record_writing(6, "r2", "b6", "checkpoint-6", over_quarantined=True)
        with pytest.raises(Quarantined):  # the core Checkpointer's own save: never over a quarantine
            lg.record_writing(6, "r2", "b6", "checkpoint-6")
        assert lg.move_path(6, "checkpoint-6", "checkpoint-6.scout-quarantined-a6", source="test")
        lg.record_writing(6, "r2", "b6", "checkpoint-6", over_quarantined=True)
        row, history = lg.checkpoint(6), [h["state"] for h in lg.certifications(6)]
    assert (row["state"], row["attempt"], row["path"]) == ("writing", "b6", "checkpoint-6")
    assert "quarantined" in history
