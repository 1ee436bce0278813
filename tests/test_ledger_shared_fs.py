"""The ledger on shared filesystems (issue 12, item 2): WAL only on local disks, DELETE (rollback journal) on
network and FUSE filesystems, and readers (`ls`, `resume`) that never block on the ledger: they wait a short busy
timeout, then answer from the checkpoints' manifests and the journal.

Filesystem detection runs through the real path (/proc/self/mountinfo, statfs) for this machine's directories,
and through an injected mountinfo text or SCOUT_CKPT_FSTYPE for network types this machine has none of.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

from scout_ckpt.errors import BadInput, LedgerUnavailable
from scout_ckpt.format.layout import LEDGER_NAME, MANIFEST_NAME
from scout_ckpt.ledger import Ledger, fsdetect
from scout_ckpt.ledger.store import header_journal
from tests.conftest import run_cli


def _mode(root) -> str:
    c = sqlite3.connect(root / LEDGER_NAME)
    try:
        return c.execute("PRAGMA journal_mode").fetchone()[0]
    finally:
        c.close()


# ---- detection -------------------------------------------------------------------------------------------------


def test_real_detection_on_this_machine(tmp_path):
    """/ and the test's tmp dir, through /proc/self/mountinfo; statfs(2) agrees where it knows the magic."""
    for p in ("/", tmp_path, tmp_path / "not" / "yet" / "created"):
        t = fsdetect.fs_type(p)
        assert t and t != "unknown", p
        magic = fsdetect._statfs_type(str(tmp_path if p != "/" else p))
        if magic and not magic.startswith("magic-") and t in fsdetect.LOCAL_TYPES:
            assert fsdetect.is_network(magic) is False
    assert not fsdetect.is_network(fsdetect.fs_type(tmp_path))  # this machine's disks are local
    assert fsdetect.choose_journal(tmp_path)["mode"] == "wal"
    Ledger.open(tmp_path, create=True).close()
    assert _mode(tmp_path) == "wal"


MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
60 27 0:50 / /mnt rw,relatime - ext4 /dev/vdb rw
61 60 0:51 / /mnt/shared rw,relatime - {fstype} server:/export rw,vers=4.2
62 61 0:52 / /mnt/shared/local\\040scratch rw,relatime - xfs /dev/vdc rw
"""


@pytest.mark.parametrize(
    "fstype",
    [
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "9p",
        "fuse.sshfs",
        "fuse.s3fs",
        "fuse",
        "virtiofs",
        "somethingnew",
    ],
)
def test_network_and_fuse_types_choose_delete(fstype):
    info = MOUNTINFO.format(fstype=fstype)
    got = fsdetect.choose_journal("/mnt/shared/runs/job1", mountinfo=info)
    assert got["mode"] == "delete" and got["fstype"] == fstype, got
    # the longest mount point wins: a local disk mounted inside the share, and the share's parent
    assert fsdetect.choose_journal("/mnt/shared/local scratch/r", mountinfo=info)["mode"] == "wal"
    assert fsdetect.choose_journal("/mnt/other", mountinfo=info)["mode"] == "wal"
    assert fsdetect.choose_journal("/mnt/sharedX", mountinfo=info)["mode"] == "wal"  # not a path prefix


def test_mounts_whose_locks_stay_on_one_host_are_flagged():
    info = MOUNTINFO.format(fstype="nfs").replace("rw,vers=4.2", "rw,vers=3,nolock")
    got = fsdetect.choose_journal("/mnt/shared/run", mountinfo=info)
    assert got["mode"] == "delete" and got["cross_host_locks"] is False and got["local_lock_options"] == ["nolock"]
    info = MOUNTINFO.format(fstype="lustre").replace("rw,vers=4.2", "rw,flock")
    assert fsdetect.choose_journal("/mnt/shared/run", mountinfo=info)["cross_host_locks"] is True


def test_overrides_and_bad_values(tmp_path, monkeypatch):
    monkeypatch.setenv("SCOUT_CKPT_FSTYPE", "nfs4")
    got = fsdetect.choose_journal(tmp_path)
    assert (got["mode"], got["requested"], got["fstype"]) == ("delete", "auto", "nfs4")
    assert got["why"] == "nfs4 is a network, FUSE or unknown filesystem"
    monkeypatch.setenv("SCOUT_CKPT_LEDGER_JOURNAL", "wal")
    assert fsdetect.choose_journal(tmp_path)["mode"] == "wal"
    assert fsdetect.choose_journal(tmp_path, "delete")["mode"] == "delete"  # the caller's option wins
    monkeypatch.setenv("SCOUT_CKPT_LEDGER_JOURNAL", "truncate")
    with pytest.raises(BadInput, match="SCOUT_CKPT_LEDGER_JOURNAL"):
        fsdetect.choose_journal(tmp_path)
    with pytest.raises(BadInput, match="ledger_journal"):
        fsdetect.choose_journal(tmp_path, "memory")


# ---- the ledger's journal mode ---------------------------------------------------------------------------------


def test_network_ledger_is_created_and_kept_in_delete_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("SCOUT_CKPT_FSTYPE", "lustre")
    with Ledger.open(tmp_path, create=True) as led:
        led.begin_run("r", world_size=2, topology={}, policy={})
        assert led.conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert _mode(tmp_path) == "delete" and header_journal(tmp_path / LEDGER_NAME) == "delete"
    assert not (tmp_path / (LEDGER_NAME + "-wal")).exists()
    with Ledger.open(tmp_path, readonly=True) as ro:
        assert ro.run("r")["world_size"] == 2


def test_wal_ledger_moved_to_delete_by_its_next_writer(tmp_path, monkeypatch):
    """A ledger created in WAL (local disk, or an older scout-ckpt) on what is now seen as NFS: readers refuse
    it (LedgerUnavailable: fall back), the next writer switches it to DELETE, then readers read it."""
    with Ledger.open(tmp_path, create=True) as led:
        led.begin_run("r", world_size=2, topology={}, policy={})
    assert _mode(tmp_path) == "wal"
    monkeypatch.setenv("SCOUT_CKPT_FSTYPE", "nfs")
    with pytest.raises(LedgerUnavailable, match="WAL ledger on nfs"):
        Ledger.open(tmp_path, readonly=True)
    Ledger.open(tmp_path).close()
    assert _mode(tmp_path) == "delete"
    with Ledger.open(tmp_path, readonly=True) as ro:
        assert ro.run("r") is not None


def test_writer_refuses_a_wal_ledger_it_cannot_switch(tmp_path, monkeypatch):
    Ledger.open(tmp_path, create=True).close()
    other = sqlite3.connect(tmp_path / LEDGER_NAME)  # another process's open connection, mid-read
    other.execute("BEGIN")
    other.execute("SELECT * FROM meta").fetchall()
    try:
        monkeypatch.setenv("SCOUT_CKPT_FSTYPE", "gpfs")
        monkeypatch.setenv("SCOUT_CKPT_BUSY_TIMEOUT", "0.3")
        with pytest.raises(LedgerUnavailable, match="cannot switch the ledger from wal to delete"):
            Ledger.open(tmp_path)
    finally:
        other.close()
    assert _mode(tmp_path) == "wal"


def test_local_auto_keeps_a_delete_ledger(tmp_path, monkeypatch):
    """On a local disk both modes are safe: `auto` does not flip a ledger someone put in DELETE mode (another
    process with SCOUT_CKPT_LEDGER_JOURNAL=delete may hold it open)."""
    monkeypatch.setenv("SCOUT_CKPT_LEDGER_JOURNAL", "delete")
    Ledger.open(tmp_path, create=True).close()
    monkeypatch.delenv("SCOUT_CKPT_LEDGER_JOURNAL")
    Ledger.open(tmp_path).close()
    assert _mode(tmp_path) == "delete"
    Ledger.open(tmp_path, journal="wal").close()
    assert _mode(tmp_path) == "wal"


# ---- readers while the writer holds the lock, and with a broken ledger ------------------------------------------

_HOLD = """
import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
c.execute("BEGIN " + sys.argv[2])
c.execute("UPDATE checkpoints SET bytes=bytes")
print("locked", flush=True)
time.sleep(120)
"""


class _Holder:
    """Another process holds the ledger in a write transaction: IMMEDIATE (the writer's lock: readers go on) or
    EXCLUSIVE (what a DELETE-mode commit takes, or a dead NFS client's lock until its lease ends)."""

    def __init__(self, db, how):
        self.p = subprocess.Popen([sys.executable, "-c", _HOLD, str(db), how], stdout=subprocess.PIPE, text=True)

    def __enter__(self):
        assert self.p.stdout.readline().strip() == "locked"
        return self

    def __exit__(self, *exc):
        self.p.kill()
        self.p.wait()


NFS = {"SCOUT_CKPT_FSTYPE": "nfs4", "SCOUT_CKPT_READ_BUSY_TIMEOUT": "0.5", "SCOUT_CKPT_BUSY_TIMEOUT": "0.5"}


def _to_delete(root, monkeypatch):
    monkeypatch.setenv("SCOUT_CKPT_FSTYPE", "nfs4")
    Ledger.open(root).close()
    assert _mode(root) == "delete"


def _answers(root, env=None):
    rc1, out1, err1 = run_cli("ls", root, "--json", env=env)
    rc2, out2, err2 = run_cli("resume", root, "--latest-clean", "--json", env=env)
    rc3, out3, _ = run_cli("resume", root, "--latest-clean", env=env)
    assert rc1 == rc2 == rc3 == 0, (rc1, err1, rc2, err2)
    assert "Traceback" not in err1 + err2
    return json.loads(out1), json.loads(out2), out3.strip(), err1, err2


def test_readers_work_while_a_writer_holds_the_lock(ckpt_root, monkeypatch):
    """DELETE mode (the NFS case). BEGIN IMMEDIATE held by another process: readers read the ledger itself.
    BEGIN EXCLUSIVE held: within the reader's busy timeout they answer from the manifests and the journal, say
    so on stderr, exit 0, and give the same steps and states."""
    _to_delete(ckpt_root, monkeypatch)
    ls0, res0, path0, _, _ = _answers(ckpt_root, NFS)
    assert res0["source"] == "ledger" and res0["step"] == 4 and ls0["source"] == "ledger"
    with _Holder(ckpt_root / LEDGER_NAME, "IMMEDIATE"):
        ls1, res1, path1, err1, err2 = _answers(ckpt_root, NFS)
        assert ls1["source"] == "ledger" and res1["source"] == "ledger" and path1 == path0
    with _Holder(ckpt_root / LEDGER_NAME, "EXCLUSIVE"):
        ls2, res2, path2, err1, err2 = _answers(ckpt_root, NFS)  # never blocked: each answers from the manifests
    assert ls2["source"] == "manifests" and "locked" in ls2["fallback"] and "manifests" in err1
    assert res2["source"] == "manifests" and "locked" in res2["fallback"] and "manifests" in err2
    assert path2 == path0 and res2["step"] == res0["step"] and res2["verified"] is True
    assert [(r["step"], r["state"]) for r in ls2["checkpoints"]] == [
        (r["step"], r["state"]) for r in ls0["checkpoints"]
    ]


def test_corrupt_ledger_resume_falls_back_fail_closed(ckpt_root):
    ls0, res0, path0, _, _ = _answers(ckpt_root)
    (ckpt_root / LEDGER_NAME).write_bytes(b"\0garbage" * 4096)
    for ext in ("-wal", "-shm"):
        (ckpt_root / (LEDGER_NAME + ext)).unlink(missing_ok=True)
    ls1, res1, path1, err1, err2 = _answers(ckpt_root)
    assert res1["source"] == "manifests" and path1 == path0 and res1["step"] == 4
    assert "not a readable scout-ckpt ledger" in err2 and "manifests" in err2
    assert {r["step"]: r["state"] for r in ls1["checkpoints"]} == {3: "certified", 4: "certified"}
    # a flipped byte in step 4: the fallback re-verifies against the manifest and walks back to step 3
    data = next(p for p in (ckpt_root / "step-00000004").iterdir() if p.name.endswith(".distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    rc, out, err = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    got = json.loads(out)
    assert rc == 0 and got["step"] == 3 and got["skipped"][0]["step"] == 4, (rc, out, err)
    # an edited manifest has no verdict on record for its digest: never certified from the fallback
    m3 = ckpt_root / "step-00000003" / MANIFEST_NAME
    m3.write_text(m3.read_text().replace('"step": 3', '"step": 3, "edited": true', 1))
    rc, out, err = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert rc == 1 and json.loads(out)["step"] is None and "manifests" in err, (rc, out, err)
    rows = {r["step"]: r for r in json.loads(run_cli("ls", ckpt_root, "--json")[1])["checkpoints"]}
    assert rows[3]["state"] == "committed" and rows[3]["reasons"][0]["code"] == "no_verdict_on_record"


def test_quarantine_in_the_journal_holds_in_the_fallback(ckpt_root):
    assert run_cli("quarantine", ckpt_root, 4, "--reason", "suspect node")[0] == 0
    (ckpt_root / LEDGER_NAME).write_bytes(b"not sqlite" * 100)
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json", "--no-verify")
    assert rc == 0 and json.loads(out)["step"] == 3 and json.loads(out)["verified"] is False
