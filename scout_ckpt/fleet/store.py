"""The fleet store: one SQLite file on a filesystem every job's coordinator and the operator's CLI can reach.

It keeps the ledger's write discipline (ledger/connection.py): every write is one `BEGIN IMMEDIATE` transaction
with a busy timeout and synchronous=FULL; the journal mode is chosen for the file's filesystem by
ledger/fsdetect.py (WAL on a local disk, the rollback journal on a network or FUSE filesystem, where WAL's
shared-memory index does not reach other hosts). Jobs write with a short busy timeout: a store held by another
writer is retried later by the job's recorder (fleet/recorder.py), never waited for on a training thread.

Tables: `verdicts`, one row per (attributed event, rank) with the hardware it names; `roots`, how far each ROOT's
ledger has been copied in (the id of its last event read). Rows are keyed by ROOT, run, event id and rank, so
recording the same event twice (a job's recorder, then `scout-ckpt fleet import` of the same ROOT) keeps one row.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Iterator

from scout_ckpt.errors import BadInput
from scout_ckpt.ledger import fsdetect
from scout_ckpt.options import FLEET_ENV

JOB_BUSY_TIMEOUT_S = 2.0  # a job's recorder: a busy store is retried at its next round
CLI_BUSY_TIMEOUT_S = 10.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS verdicts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,     -- ROOT|run|event id|rank: one row per attributed rank of one event
    time REAL,                    -- when the event happened (the ledger's time)
    recorded REAL,                -- when it reached the fleet store
    root TEXT, job TEXT, run_id TEXT, step INTEGER, event_id INTEGER,
    kind TEXT NOT NULL,           -- sdc|hang|crash|desync|straggler|health
    source TEXT,                  -- sdc: replay|consensus|shard_replay|..., observer kinds: observer
    class TEXT,                   -- persistent|transient|not_hardware (triage), NULL: not triaged
    rank INTEGER,
    host TEXT, local_rank INTEGER, device TEXT, uuid TEXT, serial TEXT,   -- NULL for not_hardware
    detail TEXT                   -- JSON
);
CREATE INDEX IF NOT EXISTS verdicts_device ON verdicts(device, time);
CREATE TABLE IF NOT EXISTS roots (root TEXT PRIMARY KEY, last_event INTEGER NOT NULL, updated REAL);
"""
COLUMNS = (
    "key",
    "time",
    "recorded",
    "root",
    "job",
    "run_id",
    "step",
    "event_id",
    "kind",
    "source",
    "class",
    "rank",
    "host",
    "local_rank",
    "device",
    "uuid",
    "serial",
    "detail",
)


class FleetUnavailable(BadInput):
    """The fleet store cannot be opened or written now (missing directory, locked, not a fleet store)."""


def configured(path: str | os.PathLike | None = None) -> Path | None:
    """The fleet store's path: `path`, else SCOUT_CKPT_FLEET, else None (the fleet record is off)."""
    value = path if path is not None else os.environ.get(FLEET_ENV)
    return Path(value) if value else None


class FleetStore:
    """One connection to a fleet store. `open` creates the file (and its tables) when `create` is set."""

    def __init__(self, conn: sqlite3.Connection, path: Path, readonly: bool):
        self.conn, self.path, self.readonly = conn, path, readonly

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        *,
        readonly: bool = False,
        create: bool = True,
        busy_timeout: float = CLI_BUSY_TIMEOUT_S,
        journal: str | None = None,
    ) -> "FleetStore":
        path = Path(path)
        if path.is_dir():
            raise FleetUnavailable(f"{path}: a directory, not a fleet store file")
        if not path.parent.is_dir():
            raise FleetUnavailable(f"{path.parent}: no such directory (the fleet store's)")
        if not path.exists() and (readonly or not create):
            raise FleetUnavailable(f"{path}: no fleet store here")
        try:
            if readonly:
                conn = sqlite3.connect(
                    f"file:{path}?mode=ro",
                    uri=True,
                    timeout=busy_timeout,
                    isolation_level=None,
                    check_same_thread=False,
                )
            else:
                conn = sqlite3.connect(str(path), timeout=busy_timeout, isolation_level=None, check_same_thread=False)
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
            store = cls(conn, path, readonly)
            if not readonly:
                store._prepare(journal)
            store._check()
        except sqlite3.DatabaseError as e:
            raise FleetUnavailable(f"{path}: not a usable fleet store ({e})") from None
        return store

    def _prepare(self, journal: str | None) -> None:
        self.conn.execute("PRAGMA synchronous=FULL")
        want = fsdetect.choose_journal(self.path.parent, journal)["mode"]
        if self.conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != want:
            with contextlib.suppress(sqlite3.OperationalError):  # another connection holds it: keep its mode
                self.conn.execute(f"PRAGMA journal_mode={want.upper()}")
        have = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not {"verdicts", "roots"} <= have:
            with self.write():
                for stmt in SCHEMA.split(";"):
                    if stmt.strip():
                        self.conn.execute(stmt)
                self.conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('kind', 'scout-ckpt fleet')")

    def _check(self) -> None:
        have = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not {"verdicts", "roots"} <= have:
            raise FleetUnavailable(f"{self.path}: an SQLite file, but not a scout-ckpt fleet store")

    @contextlib.contextmanager
    def write(self) -> Iterator["FleetStore"]:
        """One write transaction (BEGIN IMMEDIATE: the write lock up front, waiting at most the busy timeout)."""
        if self.readonly:
            raise FleetUnavailable(f"{self.path}: opened read-only")
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            raise FleetUnavailable(f"{self.path}: fleet store is locked ({e})") from None
        try:
            yield self
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        else:
            self.conn.execute("COMMIT")

    # ---- writes ------------------------------------------------------------------------------------------------

    def append(self, root: str, records: list[dict], last_event: int) -> int:
        """Add `records` (fleet/records.py) and move ROOT's cursor to `last_event`, in one transaction; a record
        already present (same key) is left as it is. Returns how many were new."""
        now = time.time()
        rows = [
            tuple(
                json.dumps(r.get(c) or {}, sort_keys=True) if c == "detail" else now if c == "recorded" else r.get(c)
                for c in COLUMNS
            )
            for r in records
        ]
        with self.write():
            before = self.conn.total_changes
            self.conn.executemany(
                f"INSERT OR IGNORE INTO verdicts({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})", rows
            )
            added = self.conn.total_changes - before
            self.conn.execute(
                "INSERT INTO roots(root, last_event, updated) VALUES (?, ?, ?) ON CONFLICT(root) DO "
                "UPDATE SET last_event=MAX(last_event, excluded.last_event), updated=excluded.updated",
                (root, last_event, now),
            )
        return added

    # ---- reads -------------------------------------------------------------------------------------------------

    def cursor(self, root: str) -> int:
        row = self.conn.execute("SELECT last_event FROM roots WHERE root=?", (root,)).fetchone()
        return int(row[0]) if row else 0

    def verdicts(self, since: float | None = None) -> list[dict]:
        sql, params = "SELECT * FROM verdicts", []
        if since is not None:
            sql, params = sql + " WHERE time >= ?", [since]
        cur = self.conn.execute(sql + " ORDER BY time, id", params)
        cols = [c[0] for c in cur.description]
        out = []
        for row in cur.fetchall():
            r = dict(zip(cols, row))
            try:
                r["detail"] = json.loads(r["detail"] or "{}")
            except ValueError:
                r["detail"] = {}
            out.append(r)
        return out

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "FleetStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
