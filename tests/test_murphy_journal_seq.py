"""The journal's order is the root's own sequence, never a host's clock (#25 item 4).

Real journal appends (flock, fsync), real processes appending at once, and the journal's real copy on an fsspec
store (the in-memory filesystem standing in for the bucket: the same `bucket_journal` code writes and lists it,
named by each writer's clock as on S3). The ledger_dir is then lost, so the records are seen only through the
store's copy."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import time

from scout_ckpt import object_store
from scout_ckpt.ledger import journal
from scout_ckpt.object_store import bucket_journal
from scout_ckpt.object_store.store import ObjectStore


def test_a_quarantine_from_a_host_an_hour_slow_stands_when_only_the_store_copy_is_left(tmp_path, monkeypatch):
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()
    object_store.bind(ledger_dir, "s3://murphy-seq/run", {})
    store = ObjectStore(f"memory://murphy-seq-{tmp_path.name}/run", {})
    object_store.remember(ledger_dir, store)  # journal.append copies each record to it, as a job's does
    rec = {"step": 4, "attempt": "a1-1", "manifest_digest": "d4"}
    # host B (a true clock): an operator quarantines step 4, looks, releases it
    journal.append(ledger_dir, {"kind": "quarantine", **rec, "reason": "suspect node"})
    journal.append(ledger_dir, {"kind": "release", **rec, "state": "certified", "reason": "node cleared"})
    # host A, whose clock is an hour slow, quarantines it again later
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 3600.0)
    journal.append(ledger_dir, {"kind": "quarantine", **rec, "reason": "second look: bad DIMM"})
    monkeypatch.setattr(time, "time", real)
    local = journal.read(ledger_dir)
    assert [r["seq"] for r in local] == [0, 1, 2]
    shutil.rmtree(ledger_dir)  # the ledger_dir is lost with its node: only the store's copy is left

    seen = bucket_journal.read(store)
    assert [r["reason"] for r in seen] == ["second look: bad DIMM", "suspect node", "node cleared"]  # clock order
    q = journal.standing(seen, 4, "d4")["quarantine"]
    assert q is not None and q["reason"] == "second look: bad DIMM", q  # by sequence: still quarantined
    assert [r["reason"] for r in journal.ordered(seen)] == ["suspect node", "node cleared", "second look: bad DIMM"]


def test_records_without_a_seq_keep_their_file_order_ahead_of_numbered_ones(tmp_path):
    old = [{"kind": "quarantine", "step": 2, "time": 50.0}, {"kind": "release", "step": 2, "time": 10.0}]
    p = journal.path(tmp_path)
    p.write_text("".join(json.dumps(r) + "\n" for r in old))
    journal.append(tmp_path, {"kind": "quarantine", "step": 2, "reason": "new"})
    recs = journal.read(tmp_path)
    assert recs[-1]["seq"] == 2  # numbered after the two records already there
    shuffled = [recs[2], recs[0], recs[1]]
    assert journal.ordered(shuffled) == [recs[0], recs[1], recs[2]]
    assert journal.standing(shuffled, 2, None)["quarantine"]["reason"] == "new"
    assert journal.standing(old, 2, None)["quarantine"] is None  # old records alone: file order, as before


def _append_many(root: str, who: str, n: int) -> None:
    for i in range(n):
        journal.append(root, {"kind": "verdict", "step": i, "state": "certified", "source": who})


def test_appenders_in_several_processes_get_distinct_increasing_seqs_in_file_order(tmp_path):
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path), who, 40)) for who in ("cli", "job", "gc")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    recs = journal.read(tmp_path)
    assert len(recs) == 120
    assert [r["seq"] for r in recs] == list(range(120))  # unique, and the file's order is the seq's


def test_a_record_appended_after_a_torn_last_line_is_kept_whole(tmp_path):
    """Power loss can leave the journal's last line cut short (no newline). The next append must not glue its
    record onto that fragment (which `read` would then skip as one unparseable line, losing a verdict)."""
    journal.append(tmp_path, {"kind": "quarantine", "step": 4})
    with open(journal.path(tmp_path), "ab") as f:
        f.write(b'{"kind": "release", "st')  # a torn line, as a crash mid-write leaves it
    journal.append(tmp_path, {"kind": "quarantine", "step": 6})
    assert [(r["kind"], r["step"]) for r in journal.read(tmp_path)] == [("quarantine", 4), ("quarantine", 6)]
