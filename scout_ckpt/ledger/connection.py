"""Opening the ledger: the SQLite connection, its journal mode, busy timeouts, schema migration and the write
transaction. Everything that reads or writes rows builds on `LedgerConnection` (ledger/queries.py reads,
ledger/store.py writes the state machine), so that these rules are in one place.

Write discipline (docs/pytorch-facts.md, SQLite): one writer at a time, every write in `BEGIN IMMEDIATE` with a busy
timeout, because a deferred transaction that reads then writes fails at once under another writer in WAL mode.
Read-only users open with `mode=ro` and never migrate or modify anything.

Journal mode (ledger/fsdetect.py): WAL on a local disk, the rollback journal (DELETE) on a network or FUSE
filesystem, where WAL's shared-memory index is not shared between hosts. A writer puts the database into the mode
it needs (a new ledger is created in it); on a network filesystem it refuses to write a ledger it cannot take out
of WAL. Every writer commits with synchronous=FULL. A reader never changes the mode; it refuses (LedgerUnavailable)
a WAL ledger on a network filesystem, and waits at most SCOUT_CKPT_READ_BUSY_TIMEOUT (default 5 s) for a lock, so
that restart tooling can fall back to the manifests (scout_ckpt/ops/disk_view.py) instead of blocking.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, TypeVar

if TYPE_CHECKING:
    import sqlite_utils

from scout_ckpt.errors import LedgerError, LedgerUnavailable
from scout_ckpt.format.layout import LEDGER_NAME
from scout_ckpt.ledger import fsdetect
from scout_ckpt.ledger.schema import AUX_TABLES, MIGRATIONS, SCHEMA_VERSION

DEFAULT_BUSY_TIMEOUT_S = 10.0
DEFAULT_READ_BUSY_TIMEOUT_S = 5.0
_L = TypeVar("_L", bound="LedgerConnection")  # open() and `with` give the subclass opened (Ledger)


def _busy_timeout(readonly: bool = False) -> float:
    """Seconds a connection waits for a lock: SCOUT_CKPT_BUSY_TIMEOUT (writers, default 10), for readers the
    smaller of that and SCOUT_CKPT_READ_BUSY_TIMEOUT (default 5): a reader has a fallback, a writer has not."""
    timeout = float(os.environ.get("SCOUT_CKPT_BUSY_TIMEOUT", DEFAULT_BUSY_TIMEOUT_S))
    if readonly:
        timeout = min(timeout, float(os.environ.get("SCOUT_CKPT_READ_BUSY_TIMEOUT", DEFAULT_READ_BUSY_TIMEOUT_S)))
    return timeout


# Descriptors of database files opened to read their header, kept open for the life of the process and never
# closed. On POSIX, close() of ANY descriptor of a file drops every fcntl lock the process holds on that file,
# SQLite's included: a header read with open()/close() while a connection of this process had the ledger open
# silently released that connection's locks, and another process's writer then checkpointed and reset the WAL
# under it: committed rows of both vanished (two writers, one kept 1 insert of 150). SQLite itself never closes a
# descriptor of a file it holds locks on; neither does this. Keyed by (device, inode): a file replaced by a rename
# (a rebuild) gets a new descriptor, the old one is kept (one small descriptor per ledger file per process).
_HEADER_FDS: dict[tuple[int, int], int] = {}


def header_journal(path: Path) -> str | None:
    """ "wal" or "delete" from the database header (bytes 18-19: 2 = WAL, 1 = rollback journal) without opening
    it with SQLite; None if it is not an SQLite file (or empty). Reads through a descriptor this process keeps
    open (see _HEADER_FDS): never a close() that would drop a connection's locks."""
    try:
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        fd = _HEADER_FDS.get(key)
        if fd is None:
            fd = _HEADER_FDS[key] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        head = os.pread(fd, 100, 0)
    except OSError:
        return None
    if len(head) < 20 or not head.startswith(b"SQLite format 3\0"):
        return None
    return "wal" if head[18] == 2 or head[19] == 2 else "delete"


def record_beside(root: Path) -> str | None:
    """What of a run's record lies in ROOT besides the ledger: "N checkpoint(s) with manifests" and/or the
    journal; None when neither (a new run, or a foreign directory). A ledger missing or empty beside them is a
    lost ledger, never a fresh start (docs/design.md, "Faults of the world")."""
    from scout_ckpt.format.layout import MANIFEST_NAME, list_checkpoint_dirs
    from scout_ckpt.ledger.journal import JOURNAL_NAME

    try:
        n = sum(1 for d in list_checkpoint_dirs(root).values() if (d / MANIFEST_NAME).is_file())
        journal = (root / JOURNAL_NAME).is_file()
    except OSError:
        return None
    parts = ([f"{n} checkpoint(s) with manifests"] if n else []) + ([JOURNAL_NAME] if journal else [])
    return " and ".join(parts) or None


class LedgerConnection:
    """One connection to ROOT/scout-ledger.db with the ledger's open, journal, migration and transaction rules.
    Not used alone: `Ledger` (ledger/store.py) is what callers open."""

    def __init__(self, conn: sqlite3.Connection, path: Path, readonly: bool):
        self.conn = conn
        self.path = path
        self.readonly = readonly
        self._db: sqlite_utils.Database | None = None
        # One connection may serve the training thread and the async committer: every read (`_query`) and every
        # write transaction (`write`) holds it, so neither thread ever runs inside the other's transaction.
        self._lock = threading.RLock()
        self.journal: dict = {}  # fsdetect.choose_journal's answer for this ledger's directory
        self.on_close: list = []  # called once at close (a job's run lease, ops/startup.py)
        self.run_lease: Any = None  # a job's coordinator: its run lease (ops/startup.py), checked before each save

    @property
    def db(self) -> "sqlite_utils.Database":
        """sqlite-utils over the same connection, for writes; imported lazily (it pulls in numpy: 160 ms that
        `scout-ckpt resume` does not need)."""
        if self._db is None:
            import sqlite_utils

            self._db = sqlite_utils.Database(self.conn)
        return self._db

    def _query(self, sql: str, params: list | tuple = ()) -> list[dict]:
        """Rows as dicts. Under the connection's lock: the coordinator's one connection serves the training
        thread and the async commit thread, and a read run while the other thread's write transaction is open
        would be part of it, seeing rows that are not committed (and may be rolled back)."""
        with self._lock:
            cur = self.conn.execute(sql, params)
            cols = [c[0] for c in cur.description]
            return [dict(zip(cols, row)) for row in cur.fetchall()]

    # ---- opening -------------------------------------------------------------------------------------------

    @classmethod
    def open(
        cls: type[_L],
        root: str | os.PathLike,
        *,
        readonly: bool = False,
        create: bool = False,
        journal: str | None = None,
        busy_timeout: float | None = None,
    ) -> _L:
        """`journal`: "auto" (default; SCOUT_CKPT_LEDGER_JOURNAL overrides it), "wal" or "delete", for writers
        (fsdetect.choose_journal). `busy_timeout` (seconds): at most this long a wait for a lock (best-effort
        writers that must not hold up a restart). Raises LedgerError (exit 2) for a missing or foreign file, LedgerUnavailable
        when the file is there but cannot be read now."""
        root = Path(root)
        if not root.exists():
            raise LedgerError(f"{root}: no such directory")
        if not root.is_dir():
            raise LedgerError(f"{root}: not a directory")
        path = root / LEDGER_NAME
        if not create and (not path.exists() or (path.is_file() and path.stat().st_size == 0)):
            what = "missing" if not path.exists() else "empty"
            beside = record_beside(root)
            if beside:  # lost beside a run's record: readers fall back to it, writers say how to recover
                raise LedgerUnavailable(
                    f"{path}: {what} beside {beside}; `scout-ckpt ledger rebuild {root}` recreates it from them"
                )
            if what == "missing":
                raise LedgerError(f"{root}: no scout-ckpt ledger here ({LEDGER_NAME} missing)")
        if path.exists() and not path.is_file():
            raise LedgerError(f"{path}: not a file")
        choice = fsdetect.choose_journal(root, journal)
        if not readonly and not choice["cross_host_locks"]:
            import logging

            logging.getLogger("scout_ckpt").warning(
                "%s: mounted with %s: file locks do not reach other hosts; keep every ledger writer on one host",
                root,
                ",".join(choice["local_lock_options"]),
            )
        if (
            readonly
            and header_journal(path) == "wal"
            and fsdetect.is_network(choice["fstype"])
            and choice["requested"] != "wal"
        ):
            raise LedgerUnavailable(
                f"{path}: a WAL ledger on {choice['fstype']} (a network filesystem) cannot be "
                "read safely from another host; its next writer switches it to DELETE"
            )
        timeout = _busy_timeout(readonly)
        if busy_timeout is not None:
            timeout = min(timeout, busy_timeout)
        try:
            if readonly:
                conn = sqlite3.connect(
                    f"file:{path}?mode=ro", uri=True, timeout=timeout, isolation_level=None, check_same_thread=False
                )
            else:
                conn = sqlite3.connect(str(path), timeout=timeout, isolation_level=None, check_same_thread=False)
            conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
            ledger = cls(conn, path, readonly)
            ledger.journal = choice
            if not readonly:
                ledger._set_journal(choice)
            ledger._check_or_migrate(create=create)
        except sqlite3.DatabaseError as e:
            msg = str(e)
            if "locked" in msg or "busy" in msg:
                raise LedgerUnavailable(f"{path}: ledger is locked by another writer ({msg})") from None
            raise LedgerUnavailable(f"{path}: not a readable scout-ckpt ledger ({msg})") from None
        return ledger

    def _set_journal(self, choice: dict) -> None:
        """Put the database into the journal mode `choice` asks for, and synchronous=FULL (durability: every
        commit is on disk before COMMIT returns). On a local disk under "auto", a ledger someone put in DELETE
        mode stays so (both are safe there). Leaving WAL needs every other connection closed: if that fails
        where WAL is unsafe, refuse rather than write."""
        self.conn.execute("PRAGMA synchronous=FULL")
        current = self.conn.execute("PRAGMA journal_mode").fetchone()[0].lower()
        want = choice["mode"]
        # a new (empty) file: create it in the chosen mode (asked of the connection: no second descriptor)
        fresh = self.conn.execute("PRAGMA page_count").fetchone()[0] == 0
        if current == want or (choice["requested"] == "auto" and want == "wal" and not fresh):
            return
        try:
            got = self.conn.execute(f"PRAGMA journal_mode={want.upper()}").fetchone()[0].lower()
        except sqlite3.OperationalError as e:
            got = f"{current} ({e})"
        if got != want:
            raise LedgerUnavailable(
                f"{self.path}: cannot switch the ledger from {current} to {want} journal mode ({choice['why']}; "
                f"got {got}): another process holds it open; retry when it has closed"
            )

    def _version(self) -> int:
        tables = {r["name"] for r in self._query("SELECT name FROM sqlite_master WHERE type='table'")}
        if "meta" not in tables:
            if tables:
                raise LedgerError(f"{self.path}: an SQLite database, but not a scout-ckpt ledger")
            return 0
        row = self.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None:
            raise LedgerError(f"{self.path}: ledger has no schema version")
        return int(row[0])

    def _check_or_migrate(self, create: bool) -> None:
        version = self._version()
        if version > SCHEMA_VERSION:
            raise LedgerError(
                f"{self.path}: ledger schema v{version} is newer than this scout-ckpt understands "
                f"(v{SCHEMA_VERSION}); upgrade scout-ckpt"
            )
        if version == SCHEMA_VERSION:
            if not self.readonly:
                self._ensure_aux()
            return
        if self.readonly or (version == 0 and not create):
            raise LedgerError(
                f"{self.path}: ledger schema v{version} needs migration to v{SCHEMA_VERSION}; "
                "run a read-write command (e.g. certify) first"
            )
        with self.write():
            version = self._version()  # re-read under the write lock: another process may have migrated
            for i in range(version, SCHEMA_VERSION):
                for stmt in MIGRATIONS[i].split(";"):
                    if stmt.strip():
                        self.conn.execute(stmt)
            self.conn.execute(
                "INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
            )
        self._ensure_aux()

    def _ensure_aux(self) -> None:
        """Create the side tables and indexes (schema.AUX_TABLES) that are missing; one read when none is."""
        have = {r["name"] for r in self._query("SELECT name FROM sqlite_master WHERE type IN ('table', 'index')")}
        names = {
            "run_ranks": "run_ranks",
            "files_rank_index": "files_rank",
            "certifications_step_index": "certifications_step",
            "events_run_index": "events_run",
        }
        missing = [ddl for key, ddl in AUX_TABLES.items() if names.get(key, key) not in have]
        if missing:
            with self.write():
                for ddl in missing:
                    self.conn.execute(ddl)

    def _has_table(self, name: str) -> bool:
        return (
            self.conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,)).fetchone()
            is not None
        )

    def close(self) -> None:
        self.conn.close()
        hooks, self.on_close = self.on_close, []
        for hook in hooks:
            hook()

    def __enter__(self: _L) -> _L:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def write(self: _L) -> Iterator[_L]:
        """One atomic write transaction (BEGIN IMMEDIATE: takes the write lock up front, waits busy_timeout)."""
        if self.readonly:
            raise LedgerError(f"{self.path}: opened read-only")
        with self._lock:
            if self.conn.in_transaction:  # nested: join the outer transaction
                yield self
                return
            try:
                self.conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:
                raise LedgerError(f"{self.path}: ledger is locked by another writer ({e})") from None
            try:
                yield self
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            else:
                self.conn.execute("COMMIT")
