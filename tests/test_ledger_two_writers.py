"""Two processes writing one ledger keep every committed row (real SQLite, real processes, no mocks).

On POSIX, close() of any descriptor of a file drops every fcntl lock the process holds on it, SQLite's included.
A ledger open that read the database header with open()/close() while a connection of the same process had the
file open released that connection's locks; the other process's writer then checkpointed and reset the WAL under
it, and committed rows of both vanished while both processes exited 0 (one kept 1 of 150 inserts)."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3

from scout_ckpt.ledger import Ledger


def _keep_one_open(root, n):
    with Ledger.open(root) as led:
        for i in range(n):
            with led.write():
                led.conn.execute("INSERT INTO meta(key, value) VALUES (?, ?)", (f"a-{i}", "x"))
            # a second Ledger of this same process opens and closes meanwhile (the observer's readonly look at
            # the ledger, a coordinator's recovery read): it must not release the first one's locks
            if i % 10 == 0:
                with Ledger.open(root, readonly=True) as other:
                    other.checkpoints()


def _open_insert_close(root, n):
    for j in range(n):
        with Ledger.open(root) as led:
            with led.write():
                led.conn.execute("INSERT INTO meta(key, value) VALUES (?, ?)", (f"b-{j}", "x"))


def test_two_writer_processes_keep_every_committed_row(tmp_path):
    with Ledger.open(tmp_path, create=True) as led:
        led.begin_run("r1", world_size=1, topology={"mode": "ddp"}, policy={"require": ["bytes"]})
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_keep_one_open, args=(str(tmp_path), 200)),
        ctx.Process(target=_open_insert_close, args=(str(tmp_path), 100)),
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    c = sqlite3.connect(tmp_path / "scout-ledger.db")
    kept = {
        side: c.execute("SELECT count(*) FROM meta WHERE key LIKE ?", (f"{side}-%",)).fetchone()[0] for side in "ab"
    }
    c.close()
    assert kept == {"a": 200, "b": 100}, kept
