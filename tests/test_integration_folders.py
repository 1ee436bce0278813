"""Trainer checkpoint folders in the ledger, without torch or transformers: the share split, retention with the
Trainer's best model kept (core retention.decide underneath) and the ledger walks (latest clean past a flipped bit, settling an interrupted save) on real files and a
real ledger."""

from pathlib import Path

import pytest

from scout_ckpt import policy
from scout_ckpt.format import manifest
from scout_ckpt.format.digests import digest_files
from scout_ckpt.integrations import folders
from scout_ckpt.ledger import Ledger


def test_shares_balance_bytes_and_cover_every_file_once():
    files = [
        ("model.safetensors", 1000),
        ("optimizer.pt", 2000),
        ("rng_state_0.pth", 10),
        ("rng_state_1.pth", 10),
        ("scheduler.pt", 5),
        ("trainer_state.json", 7),
    ]
    shares = folders.assign_shares(files, 2)
    assert sorted(p for s in shares for p in s) == sorted(p for p, _ in files)
    assert shares[0] == ["optimizer.pt"]  # the largest alone; everything else to the other rank
    assert folders.assign_shares(files, 1) == [sorted(p for p, _ in files)]
    assert folders.assign_shares(files, 8)[7] == []  # more ranks than files: some hash nothing


def _commit(root: Path, ledger: Ledger, step: int, run_id: str, attempt: str, payload: bytes) -> None:
    """What ScoutTrainerCallback does for one save, by hand: writing row, files, manifest, commit."""
    pol = folders.run_policy(1, [])
    ledger.record_writing(step, run_id, attempt, folders.folder_name(step))
    d = root / folders.folder_name(step)
    d.mkdir()
    (d / "model.safetensors").write_bytes(payload)
    (d / "trainer_state.json").write_text('{"global_step": %d}' % step)
    got = digest_files([d / p for p, _ in folders.listing(d)])
    files = [{"path": Path(p).name, "size": s, "digest": g, "rank": 0} for p, (s, g) in got.items()]
    ev = {"bytes": policy.evidence(policy.PASS)}
    m = manifest.build(
        step=step,
        run_id=run_id,
        attempt=attempt,
        world_size=1,
        topology={},
        policy=pol,
        files=files,
        evidence=ev,
        verdict={"state": "certified", "reasons": []},
    )
    digest = manifest.write(d, m)
    ledger.record_commit(
        step,
        run_id=run_id,
        path=d.name,
        nbytes=1,
        manifest_digest=digest,
        files=files,
        evidence=ev,
        state="certified",
        reasons=[],
        attempt=attempt,
    )


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "out"
    root.mkdir()
    with Ledger.open(root, create=True) as led:
        led.begin_run("r1", world_size=1, topology={}, policy=folders.run_policy(1, []))
        for step in (2, 4):
            _commit(root, led, step, "r1", f"a-{step}", bytes(range(256)) * step)
    return root


def test_latest_clean_walks_back_past_a_flipped_bit_and_rejects_it(root):
    assert folders.latest_clean_row(root)["path"] == str((root / "checkpoint-4").resolve())
    f = root / "checkpoint-4" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[100] ^= 0x10
    f.write_bytes(bytes(data))
    found = folders.latest_clean_row(root)
    assert found["step"] == 2 and found["skipped"][0]["step"] == 4
    with Ledger.open(root, readonly=True) as led:
        row = led.checkpoint(4)
    assert row["state"] == "rejected" and row["reasons"][0]["code"] == "digest_mismatch"


def test_latest_clean_refuses_an_extra_file_and_a_fresh_dir(root, tmp_path):
    (root / "checkpoint-4" / "stray.bin").write_bytes(b"x")
    assert folders.latest_clean_row(root)["step"] == 2
    assert folders.latest_clean_row(tmp_path / "nothing-here") is None


def _dead_owner() -> dict:
    """The owner record of a process that has exited (core settle acts only on provably dead owners)."""
    import socket
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    return {"host": socket.gethostname(), "pid": p.pid, "start": "0"}


def test_settle_rejects_and_removes_an_interrupted_save_and_completes_a_lost_commit(root):
    with Ledger.open(root) as led:
        led.record_writing(6, "r2", "b-1", "checkpoint-6", owner=_dead_owner())  # killed while the Trainer wrote
        (root / "checkpoint-6").mkdir()
        (root / "checkpoint-6" / "model.safetensors").write_bytes(b"half")
        _commit(root, led, 8, "r2", "b-2", b"whole")  # manifest written, ledger commit lost:
        dead = _dead_owner()
        led.conn.execute(
            "UPDATE checkpoints SET state='writing', owner_host=?, owner_pid=?, owner_start=? WHERE step=8",
            (dead["host"], dead["pid"], dead["start"]),
        )
        settled = folders.settle_folders(led, root)
        assert {s["step"]: s["after"] for s in settled} == {6: "rejected", 8: "certified"}
        assert led.checkpoint(6)["reasons"][0]["code"] == "save_interrupted"
    assert not (root / "checkpoint-6").exists()
    assert folders.latest_clean_row(root)["step"] == 8


def test_apply_retention_marks_rows_deleted_and_removes_folders(root):
    with Ledger.open(root) as led:
        kept = folders.apply_retention(led, root, 1, dirs=folders.list_folders(root), also_keep={2})
        assert kept["delete"] == [] and kept["keep"] == {2: "best model", 4: "newest certified"}
        out = folders.apply_retention(led, root, 1, dirs=folders.list_folders(root))
        assert out["delete"] == [2] and led.checkpoint(2)["state"] == "deleted"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["checkpoint-4"]


def test_import_scout_ckpt_imports_no_framework():
    import subprocess
    import sys

    from tests.conftest import REPO

    code = (
        "import sys, scout_ckpt, scout_ckpt.integrations, scout_ckpt.integrations.folders, "
        "scout_ckpt.integrations.ds_folders, scout_ckpt.cli; "
        "bad = [m for m in ('transformers', 'torchtitan', 'accelerate', 'lightning', 'deepspeed', 'megatron', 'torch') if m in sys.modules]; "
        "assert not bad, bad"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(REPO)}, timeout=120
    )
    assert p.returncode == 0, p.stderr


def test_retention_keeps_the_only_certified_folder_where_the_trainers_rotation_would_not(root):
    # save_total_limit=2 by age (the Trainer's rotation) would keep checkpoint-4 and -6, both rejected, and delete
    # checkpoint-2, the only good one; the core rule keeps checkpoint-2 and deletes the rejected ones first
    with Ledger.open(root) as led:
        _commit(root, led, 6, "r1", "a-6", b"six")
        for step in (4, 6):
            assert led.transition(step, "rejected", [{"code": "digest_mismatch"}], source="test", expect="certified")
        out = folders.apply_retention(led, root, 2, dirs=folders.list_folders(root))
        assert out["delete"] == [4, 6] and out["protected"] == 2
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["checkpoint-2"]
    assert folders.latest_clean_row(root)["step"] == 2


def test_latest_clean_reads_framework_folders_without_importing_an_integration(root):
    """`scout_ckpt.latest_clean` names the frameworks' folder layouts itself (format/framework_folders.py), in a
    process that imported no integration module: the Trainer's certified checkpoint-N is found."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    code = (
        "import json, sys, scout_ckpt; r = scout_ckpt.latest_clean(sys.argv[1]); "
        "print(json.dumps({'step': r['step'], 'integrations': sorted(m for m in sys.modules if '.integrations' in m)}))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(root)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"step": 4, "integrations": []}  # the fixture certified checkpoint-2 and -4
