"""The coordinator's one ledger connection serves the training thread and the async commit thread (#25, "also look
at"): a read on one thread must never run inside the other thread's open write transaction.

Real SQLite, real threads, the real Ledger: the commit thread's transaction adds an event (as `_record` does for a
live fault) and then fails (a busy ledger, a full disk: the transaction rolls back, as `write` does on any error);
the training thread reads the events meanwhile (as `report`, the loader or `_record_shard_faults` read rows). The
read must not see the row that was never committed: it waits for the transaction to end."""

from __future__ import annotations

import threading

import pytest

from scout_ckpt.ledger import Ledger


def test_a_read_never_sees_another_threads_uncommitted_write(tmp_path):
    led = Ledger.open(tmp_path, create=True)
    inside, read_started, seen = threading.Event(), threading.Event(), {}

    def commit_thread():
        with pytest.raises(RuntimeError):
            with led.write():
                led.add_event("sdc", step=7, ranks=[1], detail={"source": "at_rest"})
                inside.set()
                read_started.wait(10)
                # give the reader every chance to run inside this transaction (it must be held back instead)
                threading.Event().wait(0.5)
                raise RuntimeError("the ledger write failed: rolled back")

    def training_thread():
        inside.wait(10)
        read_started.set()
        seen["events"] = [e["kind"] for e in led.events()]
        seen["summary"] = led.evidence_summary()

    threads = [threading.Thread(target=commit_thread), threading.Thread(target=training_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen["events"] == []  # the rolled-back event was never visible to the other thread
    assert led.events() == []
    led.add_event("sdc", step=8, ranks=[0])  # the connection is usable by both afterwards
    assert [e["step"] for e in led.events()] == [8]
    led.close()
