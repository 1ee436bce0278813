"""Trust under Murphy: the world misbehaves (a lost ledger, a transient EIO, a directory where a file goes, a gc
racing a save, containers sharing a host name) and scout-ckpt neither hands out bad state nor loses a good
checkpoint (docs/design.md, "Faults of the world").

Real SQLite files, real CLI subprocesses (tests/conftest.py run_cli), real DCP files (the `ckpt_root` fixture: a
3-rank run with certified steps 3 and 4); faults injected by real means (a file replaced by a directory, an
OSError raised by the os-level call inside the process under test, a real child process holding a lease).
"""

from __future__ import annotations

import json

from tests.conftest import run_cli
from tests.murphy_env import eio_once_env


def _ls(root) -> dict:
    rc, out, err = run_cli("ls", root, "--json")
    assert rc == 0, err
    return {r["step"]: (r["state"], r["reasons"]) for r in json.loads(out)["checkpoints"]}


def _one_clean_line(err: str) -> None:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


# ---- item 13: an OSError is one line, exit 2, nothing modified --------------------------------------------------


def test_export_to_an_existing_directory_is_bad_input_and_writes_nothing(ckpt_root, tmp_path):
    out = tmp_path / "weights"
    out.mkdir()
    before = _ls(ckpt_root)
    rc, stdout, err = run_cli("export", ckpt_root, "--step", 4, "--out", out)
    assert rc == 2 and stdout == ""
    _one_clean_line(err)
    assert str(out) in err and "directory" in err
    assert list(out.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["run", "weights"]
    assert _ls(ckpt_root) == before


def test_quarantine_whose_journal_cannot_be_appended_changes_nothing(ckpt_root):
    journal = ckpt_root / "scout-journal.jsonl"
    records = journal.read_bytes()
    journal.unlink()
    journal.mkdir()  # the append fails with EISDIR, as on a read-only or broken mount
    before = _ls(ckpt_root)
    rc, stdout, err = run_cli("quarantine", ckpt_root, 4, "--reason", "loss spike")
    assert rc == 2 and stdout == ""
    _one_clean_line(err)
    assert "scout-journal.jsonl" in err
    assert _ls(ckpt_root) == before and before[4][0] == "certified"
    journal.rmdir()
    journal.write_bytes(records)
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert rc == 0 and json.loads(out)["step"] == 4


def test_any_other_oserror_a_command_meets_is_one_line_exit_2(ckpt_root, tmp_path):
    """The generic mapping in cli.main: `report --html` onto a directory is an OSError from deep in the writer."""
    page = tmp_path / "page.html"
    page.mkdir()
    rc, _, err = run_cli("report", ckpt_root, "--html", page)
    assert rc == 2
    _one_clean_line(err)
    assert "Is a directory" in err and str(page.name) in err


# ---- item 2: quarantine + release does not launder a rejection -------------------------------------------------


def _reject_as_the_loader_does(root, step):
    """The job's load found the loaded values differ from the saved signatures: the walk-back's own rejection
    (LatestCleanLoader._reject_load_mismatch: a transition, journaled, with no evidence row of its own)."""
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.save.loading import LatestCleanLoader

    with Ledger.open(root) as led:
        loader = LatestCleanLoader(root, 0, 1, None, led, led.run()["id"], True, lambda point, s: None)
        loader._reject_load_mismatch({"step": step}, ["model.0.weight"])
        assert led.checkpoint(step)["state"] == "rejected"


def test_quarantine_then_release_keeps_a_load_mismatch_rejected(ckpt_root):
    _reject_as_the_loader_does(ckpt_root, 4)
    run_cli("quarantine", ckpt_root, 4, "--reason", "look at it", check_rc=0)
    rc, out, _ = run_cli("release", ckpt_root, 4, "--reason", "looked", "--json")
    assert rc == 0 and json.loads(out)["state"] == "rejected"
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert rc == 0 and json.loads(out)["step"] == 3
    state, reasons = _ls(ckpt_root)[4]
    assert state == "rejected" and reasons[0]["code"] == "load_mismatch"


def test_release_of_a_bytes_rejection_and_of_a_certified_step(ckpt_root):
    """The loader's byte rejection (record_verification_failure) stays rejected too; a step certified before its
    quarantine comes back certified."""
    from scout_ckpt import policy
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.ops.recovery import record_verification_failure

    with Ledger.open(ckpt_root) as led:
        record_verification_failure(
            led, 4, policy.evidence(policy.FAIL, [{"code": "load_mismatch"}]), source="load", root=ckpt_root
        )
    for step in (3, 4):
        run_cli("quarantine", ckpt_root, step, "--reason", "check", check_rc=0)
        run_cli("release", ckpt_root, step, "--reason", "checked", check_rc=0)
    assert {s: st for s, (st, _) in _ls(ckpt_root).items()} == {3: "certified", 4: "rejected"}


# ---- item 10: gc never deletes a save in flight ------------------------------------------------------------------


def test_gc_leaves_a_resave_in_flight_of_an_older_step_alone(ckpt_root):
    """After a walk-back the job re-saves step 3 (older than the kept step 4) while an operator runs gc: the
    `writing` row with this live process as its owner, and its temp dir, are left as they are."""
    from scout_ckpt.format import layout
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.ops.settle import this_process_owner

    owner = this_process_owner()
    tmp = ckpt_root / layout.tmp_dirname(3, "resave-1")
    with Ledger.open(ckpt_root) as led:  # what Committer.begin does, in this order
        run_id = led.run()["id"]
        led.record_writing(3, run_id, "resave-1", layout.step_dirname(3), owner=owner)
    layout.create_tmp_dir(tmp, {"run_id": run_id, "attempt": "resave-1", **owner})
    rc, out, err = run_cli("gc", ckpt_root, "--keep", 1, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["delete"] == [] and doc["reasons"]["3"] == "save in flight"
    with Ledger.open(ckpt_root, readonly=True) as led:
        row = led.checkpoint(3)
        assert (row["state"], row["attempt"]) == ("writing", "resave-1")
    assert tmp.is_dir() and (ckpt_root / layout.step_dirname(3)).is_dir()
    assert [p["alive"] for p in doc["partial"]] == [True]


# ---- item 11: owner liveness across PID namespaces ---------------------------------------------------------------

_HOLD_LEASE = """
import sys, time
from scout_ckpt.ops.settle import take_lease
lease = take_lease(sys.argv[1], sys.argv[2])   # what Committer.begin does before the `writing` row
print("leased", flush=True)
time.sleep(300)
"""


def test_a_save_whose_lease_is_held_is_alive_whatever_its_pid_says(ckpt_root):
    """Another container on this host saves step 5: its lease is held by a real child process, and its owner
    record names its host (the same host name) and a pid that does not exist in our PID namespace. Neither
    certify's settling nor start-up's temp-dir sweep nor gc takes it for dead; once it is SIGKILLed they do."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    from scout_ckpt.format import layout
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.save.commit import reconcile
    from tests.conftest import REPO

    attempt = "otherns-1"
    owner = {"host": socket.gethostname(), "pid": 2**22 + 12345, "start": "1"}  # not a pid here
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LEASE, str(ckpt_root), attempt],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert child.stdout.readline().strip() == "leased"
        tmp = ckpt_root / layout.tmp_dirname(5, attempt)
        with Ledger.open(ckpt_root) as led:
            led.record_writing(5, led.run()["id"], attempt, layout.step_dirname(5), owner=owner)
        layout.create_tmp_dir(tmp, {"attempt": attempt, **owner})

        rc, out, _ = run_cli("certify", ckpt_root, "--json")
        assert rc == 1 and {r["step"]: r["state"] for r in json.loads(out)["results"]}[5] == "writing"
        rc, out, _ = run_cli("gc", ckpt_root, "--keep", 1, "--dry-run", "--json")
        assert rc == 0 and [p["alive"] for p in json.loads(out)["partial"]] == [True]
        with Ledger.open(ckpt_root) as led:
            assert reconcile(led, ckpt_root)["left"] == [tmp.name]
            assert led.checkpoint(5)["state"] == "writing"
        assert tmp.is_dir()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()

    rc, out, _ = run_cli("certify", ckpt_root, "--json")
    assert {r["step"]: r["state"] for r in json.loads(out)["results"]}[5] == "rejected"
    with Ledger.open(ckpt_root) as led:
        assert led.checkpoint(5)["reasons"][0] == {"code": "save_interrupted", "attempt": attempt}
        assert reconcile(led, ckpt_root)["removed"] == [tmp.name]
    assert not tmp.exists()


def _lease_probe(rank, world, root):
    """One save; at each fault-hook point the coordinator notes the states of the leases under ROOT/.leases."""
    from pathlib import Path

    import torch

    from scout_ckpt.checkpointer import Checkpointer
    from scout_ckpt.ops.settle import lease_state
    from scout_ckpt.testing.faults import fault_points
    from tests.workers_ckpt import make_model, state_of

    seen = {}

    def hook(point, step):
        if rank == 0:
            seen[point] = [lease_state(root, p.stem) for p in sorted((Path(root) / ".leases").glob("*.lock"))]

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fault_points(hook):
        ckpt = Checkpointer(root, model=model, optimizer=opt)
    ckpt.save(1, state_of(model, opt))
    ckpt.close()
    return seen


def test_the_checkpointer_holds_its_lease_for_the_life_of_a_save(tmp_path):
    from scout_ckpt.testing.launch import run_ranks

    seen = run_ranks(_lease_probe, 2, str(tmp_path / "run"), timeout=120)[0].result
    assert seen["before_write"] == ["held"] and seen["before_rename"] == ["held"]
    assert seen["after_commit"] == []  # released (and unlinked) once the commit is recorded


# ---- item 9: a transient EIO is "could not check now", never a rejection ------------------------------------------


def _shard(root, step):
    return next(p for p in sorted((root / f"step-{step:08d}").iterdir()) if p.suffix == ".distcp")


def _eio_once(monkeypatch, target):
    """In this process: the next os.open of `target` (the call digests.file_digest reads through) raises EIO."""
    import errno
    import os

    real, hits = os.open, []
    want = os.path.realpath(target)

    def flaky(path, flags, *args, **kwargs):
        if not hits and not isinstance(path, int) and os.path.realpath(os.fspath(path)) == want:
            hits.append(path)
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", flaky)
    return hits


def _trust(root, step):
    """What the ledger holds of a step that a could-not-check must leave alone."""
    from scout_ckpt.ledger import Ledger

    with Ledger.open(root, readonly=True) as led:
        row = led.checkpoint(step)
        return (
            row["state"],
            row["reasons"],
            row["attempt"],
            {k: v["status"] for k, v in led.evidence(step).items()},
            len(led.certifications(step)),
        )


def test_a_transient_eio_while_resume_verifies_walks_back_without_rejecting(ckpt_root, monkeypatch):
    from scout_ckpt.ops.recovery import latest_clean

    before = _trust(ckpt_root, 4)
    hits = _eio_once(monkeypatch, _shard(ckpt_root, 4))
    found = latest_clean(ckpt_root)
    assert hits and found["step"] == 3
    (skip,) = found["skipped"]
    assert skip["step"] == 4 and skip["could_not_check"] and skip["reasons"][0]["code"] == "could_not_check"
    assert skip["reasons"][0]["errno"] == "EIO"
    assert _trust(ckpt_root, 4) == before and before[0] == "certified"
    assert latest_clean(ckpt_root)["step"] == 4  # the disk answers again: the newest good one is handed out
    monkeypatch.undo()
    rc, out, _ = run_cli("gc", ckpt_root, "--keep", 2, "--json")
    assert rc == 0 and json.loads(out)["delete"] == [] and (ckpt_root / "step-00000004").is_dir()


def test_a_transient_eio_in_the_cli_rejects_nothing_and_gc_keeps_the_step(ckpt_root, tmp_path):
    eio = eio_once_env(tmp_path / "site", _shard(ckpt_root, 4))
    before = _trust(ckpt_root, 4)
    rc, out, err = run_cli("resume", ckpt_root, "--latest-clean", "--json", env=eio)
    assert rc == 0 and json.loads(out)["step"] == 3 and "could_not_check" in err, err
    rc, out, err = run_cli("certify", ckpt_root, "--step", 4, "--json", env=eio)
    (res,) = json.loads(out)["results"]
    assert rc == 1 and res["state"] == "certified" and res["could_not_check"][0]["code"] == "could_not_check"
    assert "could not be checked now" in err and "Traceback" not in err
    assert _trust(ckpt_root, 4) == before and _ls(ckpt_root)[4][0] == "certified"
    rc, out, _ = run_cli("gc", ckpt_root, "--keep", 2, "--json")
    assert rc == 0 and json.loads(out)["delete"] == []
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert rc == 0 and json.loads(out)["step"] == 4


def _load_with_eio(rank, world, root, target):
    """A restarted job whose disk fails one read of one of step 4's files (EIO, in whichever rank reads it)."""
    import errno
    import os

    import torch

    from scout_ckpt.checkpointer import Checkpointer
    from tests.workers_ckpt import ddp, make_model, state_of, train_steps

    real, hits = os.open, []

    def flaky(path, flags, *args, **kwargs):
        if not hits and not isinstance(path, int) and os.path.realpath(os.fspath(path)) == target:
            hits.append(path)
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
        return real(path, flags, *args, **kwargs)

    os.open = flaky
    try:
        model = make_model(seed=5)
        net = ddp(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_steps(net, opt, 1, seed=99)  # optimizer state exists before loading
        ckpt = Checkpointer(root, model=net, optimizer=opt)
        step = ckpt.load_latest_clean(state_of(model, opt))
        ckpt.close()
    finally:
        os.open = real
    return {"step": step, "hit": bool(hits)}


def test_a_transient_eio_in_the_jobs_walk_back_rejects_nothing(ckpt_root):
    import os

    from scout_ckpt.testing.launch import run_ranks

    before = _trust(ckpt_root, 4)
    out = run_ranks(_load_with_eio, 3, str(ckpt_root), os.path.realpath(_shard(ckpt_root, 4)), timeout=180)
    assert {o.result["step"] for o in out} == {3} and any(o.result["hit"] for o in out)
    assert _trust(ckpt_root, 4) == before
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert rc == 0 and json.loads(out)["step"] == 4


def _load_with_eio_everywhere(rank, world, root):
    """A restarted job while every step folder's data files answer EIO (a storage outage): what
    load_latest_clean did ({"step"} or {"refused": message}), and whether it saved anything."""
    import errno
    import os

    import torch

    from scout_ckpt.checkpointer import Checkpointer
    from scout_ckpt.errors import CheckpointsUnreadable
    from tests.workers_ckpt import ddp, make_model, state_of, train_steps

    real = os.open

    def flaky(path, flags, *args, **kwargs):
        if not isinstance(path, int) and "/step-" in os.fspath(path) and os.fspath(path).endswith(".distcp"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
        return real(path, flags, *args, **kwargs)

    model = make_model(seed=5)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(net, opt, 1, seed=99)
    ckpt = Checkpointer(root, model=net, optimizer=opt)
    os.open = flaky
    try:
        return {"step": ckpt.load_latest_clean(state_of(model, opt))}
    except CheckpointsUnreadable as e:
        return {"refused": str(e), "exit_code": e.exit_code}
    finally:
        os.open = real
        ckpt.close()


def test_a_storage_outage_on_every_checkpoint_refuses_the_start_instead_of_starting_from_step_0(ckpt_root):
    """Every certified step's files answer EIO: load_latest_clean walks past each (could not check: nothing
    rejected) and then, with none left, refuses on every rank alike (CheckpointsUnreadable, exit code 75, naming
    the steps and the cause) instead of returning None, which would have the job train from step 0 and save over
    the certified steps. Once the storage answers, resume hands out the newest again."""
    before = {s: _trust(ckpt_root, s) for s in (3, 4)}
    out = run_ranks_(_load_with_eio_everywhere, 2, str(ckpt_root))
    for o in out:
        r = o.result
        assert "refused" in r and r["exit_code"] == 75, r
        assert "refusing to start from step 0" in r["refused"] and "4, 3" in r["refused"], r
        assert "\n" not in r["refused"] and "could_not_check" in r["refused"], r
    assert {s: _trust(ckpt_root, s) for s in (3, 4)} == before
    rc, out_, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert rc == 0 and json.loads(out_)["step"] == 4


def run_ranks_(fn, n, *args):
    from scout_ckpt.testing.launch import run_ranks

    return run_ranks(fn, n, *args, timeout=180)


# ---- item 8: a lost ledger is rebuilt (or the start refused), never a fresh start ---------------------------------


def _restart(rank, world, root, save_step=None):
    """A restarted job: a Checkpointer on ROOT, load_latest_clean, optionally one more save; with the library's
    log records of the coordinator."""
    import logging

    import torch

    from scout_ckpt.checkpointer import Checkpointer
    from tests.workers_ckpt import ddp, make_model, state_of, train_steps

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))

    log = logging.getLogger("scout_ckpt")
    log.setLevel(logging.INFO)
    log.addHandler(Keep())
    model = make_model(seed=5)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(net, opt, 1, seed=99)  # optimizer state exists before loading
    try:
        ckpt = Checkpointer(root, model=net, optimizer=opt, timeout_s=60)
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        return {"refused": f"{type(e).__name__}: {e}", "log": records}
    st = state_of(model, opt)
    loaded = ckpt.load_latest_clean(st)
    verdict = None
    if save_step is not None:
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optim"])
        verdict = ckpt.save(save_step, state_of(model, opt))
    ckpt.close()
    return {"loaded": loaded, "verdict": verdict, "log": records}


def _lose_ledger(root, how):
    from scout_ckpt.format.layout import LEDGER_NAME

    db = root / LEDGER_NAME
    for suffix in ("-wal", "-shm"):
        side = root / (LEDGER_NAME + suffix)
        if side.exists():
            side.unlink()
    if how == "deleted":
        db.unlink()
    elif how == "truncated":
        db.write_bytes(b"")
    else:
        db.write_bytes(b"\0not a database" * 500)


import pytest  # noqa: E402


@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_a_lost_ledger_is_rebuilt_at_start_up_and_no_certified_step_is_overwritten(ckpt_root, how):
    from scout_ckpt.format import manifest
    from scout_ckpt.testing.launch import run_ranks

    digest4 = manifest.read(ckpt_root / "step-00000004")[1]
    _lose_ledger(ckpt_root, how)
    # the tools say what the job will do: step 4, from the manifests and the journal
    rc, out, err = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert rc == 0 and json.loads(out)["step"] == 4 and json.loads(out)["source"] == "manifests", err
    assert "ledger rebuild" in err
    rc, out, _ = run_cli("ls", ckpt_root, "--json")
    assert rc == 0 and [(r["step"], r["state"]) for r in json.loads(out)["checkpoints"]] == [
        (3, "certified"),
        (4, "certified"),
    ]

    out = run_ranks(_restart, 3, str(ckpt_root), 5, timeout=180)
    assert [o.result["loaded"] for o in out] == [4, 4, 4]
    assert out[0].result["verdict"]["state"] == "certified"
    warnings = [m for level, m in out[0].result["log"] if level == "WARNING"]
    assert any(
        "rebuilding it from the manifests and the journal" in m
        and how.replace("deleted", "missing").replace("truncated", "empty") in m
        for m in warnings
    ), warnings
    assert not any(m.startswith(("no checkpoint", "no certified checkpoint")) for _, m in out[0].result["log"])
    assert manifest.read(ckpt_root / "step-00000004")[1] == digest4
    assert {s: st for s, (st, _) in _ls(ckpt_root).items()} == {3: "certified", 4: "certified", 5: "certified"}


def test_a_ledger_that_is_not_sqlite_is_rebuilt_and_kept_as_bak(ckpt_root, caplog):
    from scout_ckpt.ops.startup import open_run_ledger

    _lose_ledger(ckpt_root, "garbage")
    with caplog.at_level("WARNING", logger="scout_ckpt"):
        with open_run_ledger(ckpt_root) as led:
            assert {r["step"]: r["state"] for r in led.checkpoints()} == {3: "certified", 4: "certified"}
    assert "not an SQLite file" in caplog.text
    (bak,) = ckpt_root.glob("scout-ledger.db.bak-*")
    assert bak.read_bytes().startswith(b"\0not a database")


def test_a_corrupt_ledger_refuses_the_start_on_every_rank_naming_the_command(ckpt_root):
    from scout_ckpt.format.layout import LEDGER_NAME
    from scout_ckpt.testing.launch import run_ranks

    db = ckpt_root / LEDGER_NAME
    data = db.read_bytes()
    db.write_bytes(data[:100] + b"\xa5" * (len(data) - 100))  # an SQLite header over pages of garbage

    def files():  # SQLite's -wal/-shm side files aside: opening an SQLite file may create them
        return {
            str(p.relative_to(ckpt_root)): p.read_bytes()
            for p in ckpt_root.rglob("*")
            if p.is_file() and not p.name.endswith(("-wal", "-shm"))
        }

    before = files()
    out = run_ranks(_restart, 3, str(ckpt_root), timeout=180)
    refused = [o.result.get("refused") for o in out]
    assert all(r and "scout-ckpt ledger rebuild" in r for r in refused), refused
    assert files() == before


def test_a_restart_past_only_rejected_checkpoints_warns_naming_each_and_why(ckpt_root):
    from scout_ckpt.ledger import Ledger, journal
    from scout_ckpt.testing.launch import run_ranks

    with Ledger.open(ckpt_root) as led:
        for step, code in ((3, "digest_mismatch"), (4, "load_mismatch")):
            journal.record_transition(
                led, ckpt_root, step, "rejected", [{"code": code}], source="load", expect="certified"
            )
    (out,) = run_ranks(_restart, 1, str(ckpt_root), timeout=120)
    assert out.result["loaded"] is None
    warnings = [m for level, m in out.result["log"] if level == "WARNING"]
    assert any(
        "rejected" in m and "3 (rejected: digest_mismatch)" in m and "4 (rejected: load_mismatch)" in m
        for m in warnings
    ), out.result["log"]
