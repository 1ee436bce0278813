"""The Ledger: the only code in scout-ckpt that opens the SQLite database.

Write discipline (TORCH-NOTES, SQLite): one writer at a time, every write in `BEGIN IMMEDIATE` with a busy
timeout, because a deferred transaction that reads then writes fails at once under another writer in WAL mode.
Read-only users open with `mode=ro` and never migrate or modify anything.

Journal mode (ledger/fsdetect.py): WAL on a local disk, the rollback journal (DELETE) on a network or FUSE
filesystem, where WAL's shared-memory index is not shared between hosts. A writer puts the database into the mode
it needs (a new ledger is created in it); on a network filesystem it refuses to write a ledger it cannot take out
of WAL. Every writer commits with synchronous=FULL. A reader never changes the mode; it refuses (LedgerUnavailable)
a WAL ledger on a network filesystem, and waits at most SCOUT_CKPT_READ_BUSY_TIMEOUT (default 5 s) for a lock, so
that restart tooling can fall back to the manifests (scout_ckpt/disk_view.py) instead of blocking.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sqlite_utils

from scout_ckpt.errors import LedgerError, Quarantined
from scout_ckpt.layout import LEDGER_NAME
from scout_ckpt.ledger import fsdetect
from scout_ckpt.ledger.schema import AUX_TABLES, MIGRATIONS, SCHEMA_VERSION
from scout_ckpt.ledger.transitions import APPLIED, REFUSED, STATES, SUPERSEDED, allowed
DEFAULT_BUSY_TIMEOUT_S = 10.0
DEFAULT_READ_BUSY_TIMEOUT_S = 5.0
_JSON_COLUMNS = {"topology", "policy", "versions", "reasons", "detail", "ranks"}


def _busy_timeout(readonly: bool = False) -> float:
    """Seconds a connection waits for a lock: SCOUT_CKPT_BUSY_TIMEOUT (writers, default 10), for readers the
    smaller of that and SCOUT_CKPT_READ_BUSY_TIMEOUT (default 5): a reader has a fallback, a writer has not."""
    timeout = float(os.environ.get("SCOUT_CKPT_BUSY_TIMEOUT", DEFAULT_BUSY_TIMEOUT_S))
    if readonly:
        timeout = min(timeout, float(os.environ.get("SCOUT_CKPT_READ_BUSY_TIMEOUT", DEFAULT_READ_BUSY_TIMEOUT_S)))
    return timeout


class LedgerUnavailable(LedgerError):
    """The ledger file exists but cannot be read now: locked beyond the busy timeout, corrupt, a hot journal a
    read-only reader cannot roll back, or WAL on a network filesystem. Readers with a fallback (ls, resume) read
    the checkpoints' manifests and the journal instead (scout_ckpt/disk_view.py)."""


def header_journal(path: Path) -> str | None:
    """"wal" or "delete" from the database header (bytes 18-19: 2 = WAL, 1 = rollback journal) without opening
    it with SQLite; None if it is not an SQLite file (or empty)."""
    try:
        with open(path, "rb") as f:
            head = f.read(100)
    except OSError:
        return None
    if len(head) < 20 or not head.startswith(b"SQLite format 3\0"):
        return None
    return "wal" if head[18] == 2 or head[19] == 2 else "delete"


def _decode(row: dict[str, Any]) -> dict[str, Any]:
    for k in _JSON_COLUMNS.intersection(row):
        if isinstance(row[k], str):
            row[k] = json.loads(row[k])
    return row


def _dumps(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def place_text(p: dict) -> str:
    """{"host": "h1", "node_rank": 1, "local_rank": 0} -> "h1 node 1 local 0"."""
    parts = [str(p.get("host") or "?")]
    if p.get("node_rank") is not None:
        parts.append(f"node {p['node_rank']}")
    if p.get("local_rank") is not None:
        parts.append(f"local {p['local_rank']}")
    return " ".join(parts)


def _found(row: dict | None) -> dict:
    """The history's note on a verdict not applied: what the row held instead."""
    if row is None:
        return {"code": "superseded", "found": None}
    return {"code": "superseded", "found": row["state"], "attempt": row["attempt"]}


class Ledger:
    """A run's ledger at ROOT/scout-ledger.db.

    Ledger.open(root)                  read-write; creates or migrates the schema if `create`
    Ledger.open(root, readonly=True)   read-only; fails with LedgerError rather than touch anything
    """

    def __init__(self, conn: sqlite3.Connection, path: Path, readonly: bool):
        self.conn = conn
        self.path = path
        self.readonly = readonly
        self._db: sqlite_utils.Database | None = None
        self._lock = threading.RLock()  # one connection may serve the training thread and the async committer
        self.journal: dict = {}  # fsdetect.choose_journal's answer for this ledger's directory

    @property
    def db(self) -> "sqlite_utils.Database":
        """sqlite-utils over the same connection, for writes; imported lazily (it pulls in numpy: 160 ms that
        `scout-ckpt resume` does not need)."""
        if self._db is None:
            import sqlite_utils

            self._db = sqlite_utils.Database(self.conn)
        return self._db

    def _query(self, sql: str, params: list | tuple = ()) -> list[dict]:
        cur = self.conn.execute(sql, params)
        cols = [c[0] for c in cur.description]
        return [dict(zip(cols, row)) for row in cur.fetchall()]

    # ---- opening -------------------------------------------------------------------------------------------

    @classmethod
    def open(cls, root: str | os.PathLike, *, readonly: bool = False, create: bool = False,
             journal: str | None = None, busy_timeout: float | None = None) -> "Ledger":
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
        if not path.exists() and not create:
            raise LedgerError(f"{root}: no scout-ckpt ledger here ({LEDGER_NAME} missing)")
        if path.exists() and not path.is_file():
            raise LedgerError(f"{path}: not a file")
        choice = fsdetect.choose_journal(root, journal)
        if not readonly and not choice["cross_host_locks"]:
            import logging

            logging.getLogger("scout_ckpt").warning(
                "%s: mounted with %s: file locks do not reach other hosts; keep every ledger writer on one host",
                root, ",".join(choice["local_lock_options"]))
        if readonly and header_journal(path) == "wal" and fsdetect.is_network(choice["fstype"]) \
                and choice["requested"] != "wal":
            raise LedgerUnavailable(f"{path}: a WAL ledger on {choice['fstype']} (a network filesystem) cannot be "
                                    "read safely from another host; its next writer switches it to DELETE")
        timeout = _busy_timeout(readonly)
        if busy_timeout is not None:
            timeout = min(timeout, busy_timeout)
        try:
            if readonly:
                conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout, isolation_level=None,
                                       check_same_thread=False)
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
        fresh = header_journal(self.path) is None   # a new (empty) file: create it in the chosen mode
        if current == want or (choice["requested"] == "auto" and want == "wal" and not fresh):
            return
        try:
            got = self.conn.execute(f"PRAGMA journal_mode={want.upper()}").fetchone()[0].lower()
        except sqlite3.OperationalError as e:
            got = f"{current} ({e})"
        if got != want:
            raise LedgerUnavailable(
                f"{self.path}: cannot switch the ledger from {current} to {want} journal mode ({choice['why']}; "
                f"got {got}): another process holds it open; retry when it has closed")

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
                f"(v{SCHEMA_VERSION}); upgrade scout-ckpt")
        if version == SCHEMA_VERSION:
            if not self.readonly:
                self._ensure_aux()
            return
        if self.readonly or (version == 0 and not create):
            raise LedgerError(f"{self.path}: ledger schema v{version} needs migration to v{SCHEMA_VERSION}; "
                              "run a read-write command (e.g. certify) first")
        with self.write():
            version = self._version()  # re-read under the write lock: another process may have migrated
            for i in range(version, SCHEMA_VERSION):
                for stmt in MIGRATIONS[i].split(";"):
                    if stmt.strip():
                        self.conn.execute(stmt)
            self.conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)",
                              (str(SCHEMA_VERSION),))
        self._ensure_aux()

    def _ensure_aux(self) -> None:
        """Create the side tables and indexes (schema.AUX_TABLES) that are missing; one read when none is."""
        have = {r["name"] for r in self._query("SELECT name FROM sqlite_master WHERE type IN ('table', 'index')")}
        names = {"run_ranks": "run_ranks", "files_rank_index": "files_rank",
                 "certifications_step_index": "certifications_step", "events_run_index": "events_run"}
        missing = [ddl for key, ddl in AUX_TABLES.items() if names.get(key, key) not in have]
        if missing:
            with self.write():
                for ddl in missing:
                    self.conn.execute(ddl)

    def _has_table(self, name: str) -> bool:
        return self.conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,)).fetchone() \
            is not None

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def write(self) -> Iterator["Ledger"]:
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

    # ---- runs ----------------------------------------------------------------------------------------------

    def begin_run(self, run_id: str, *, world_size: int, topology: dict, policy: dict,
                  versions: dict | None = None, resumed_from: int | None = None) -> None:
        with self.write():
            self.db["runs"].insert({
                "id": run_id, "started": time.time(), "world_size": world_size, "topology": _dumps(topology),
                "policy": _dumps(policy), "versions": _dumps(versions or {}), "resumed_from": resumed_from,
                "host": socket.gethostname()}, replace=True)

    def set_resumed_from(self, run_id: str, step: int | None) -> None:
        with self.write():
            self.conn.execute("UPDATE runs SET resumed_from=? WHERE id=?", (step, run_id))

    def run(self, run_id: str | None = None) -> dict | None:
        """One run (incarnation) by id, or the newest."""
        if run_id is None:
            rows = list(self._query("SELECT * FROM runs ORDER BY started DESC, rowid DESC LIMIT 1"))
        else:
            rows = list(self._query("SELECT * FROM runs WHERE id=?", [run_id]))
        return _decode(rows[0]) if rows else None

    def runs(self) -> list[dict]:
        return [_decode(r) for r in self._query("SELECT * FROM runs ORDER BY started, rowid")]

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def record_writing(self, step: int, run_id: str, attempt: str, path: str, owner: dict | None = None, *,
                       source: str = "save") -> None:
        """The row written before DCP starts: an interrupted save leaves this record and no step dir.

        A quarantined step is refused (`Quarantined`, recorded in the history as 'refused'): the operator's
        decision stands until released. A row in any other state is replaced by this attempt; its history
        (certifications rows, each with its attempt) is kept, so a re-saved rejected step still shows why the
        earlier attempt was rejected. `owner` ({"host", "pid", "start"}, `settle.this_process_owner()`) lets a
        later settler tell a save in flight from a dead one.
        """
        owner = owner or {}
        with self.write():
            row = self.checkpoint(step)
            refused = row is not None and row["state"] == "quarantined"
            if refused:
                self._certification(step, "writing", [{"code": "quarantined", "attempt": row["attempt"]}],
                                    source, attempt=attempt, outcome=REFUSED)
            else:
                now = time.time()
                self.conn.execute("DELETE FROM files WHERE step=?", (step,))
                self.conn.execute("DELETE FROM evidence WHERE step=?", (step,))
                self.db["checkpoints"].insert({
                    "step": step, "run_id": run_id, "state": "writing", "path": path, "bytes": None,
                    "attempt": attempt, "started": now, "committed": None, "updated": now,
                    "manifest_digest": None, "reasons": "[]", "owner_host": owner.get("host"),
                    "owner_pid": owner.get("pid"), "owner_start": owner.get("start")}, replace=True)
                self._certification(step, "writing", [], source, attempt=attempt)
        if refused:
            reason = next((r.get("detail") for r in row["reasons"] or [] if r.get("code") == "quarantined"), None)
            raise Quarantined(f"step {step} is quarantined" + (f" ({reason})" if reason else "")
                              + "; `scout-ckpt release` it before saving that step again")

    def record_commit(self, step: int, *, run_id: str | None, path: str, nbytes: int, manifest_digest: str,
                      files: list[dict], evidence: dict[str, dict], state: str, reasons: list[dict],
                      source: str = "save", attempt: str | None = None) -> bool:
        """Files, evidence and verdict of a committed checkpoint, in one transaction; compare-and-set.

        Applies only if the row is `writing` with this attempt, and returns True. Otherwise the verdict is kept in
        the history as 'superseded' and the state is left as it is; when the row is still this attempt (e.g. an
        operator quarantined it during the save) its files and evidence are recorded all the same, so that a
        release can judge them. Returns False then. `attempt=None` means whichever attempt the row holds: only for
        single-writer tools; a save passes its own.
        """
        now = time.time()
        with self.write():
            row = self.checkpoint(step)
            if attempt is None and row is not None:
                attempt = row["attempt"]
            same_attempt = row is not None and row["attempt"] == attempt
            applied = same_attempt and row["state"] == "writing"
            if same_attempt:
                self.conn.execute("DELETE FROM files WHERE step=?", (step,))
                self.db["files"].insert_all(
                    [{"step": step, "path": f["path"], "size": f["size"], "digest": f["digest"],
                      "rank": f.get("rank")} for f in files])
                self.put_evidence(step, evidence, source=source)
                self.conn.execute(
                    "UPDATE checkpoints SET run_id=?, path=?, bytes=?, committed=?, updated=?, manifest_digest=? "
                    "WHERE step=? AND attempt=?", (run_id, path, nbytes, now, now, manifest_digest, step, attempt))
            if applied:
                self.conn.execute("UPDATE checkpoints SET state=?, reasons=?, owner_host=NULL, owner_pid=NULL, "
                                  "owner_start=NULL WHERE step=? AND state='writing' AND attempt=?",
                                  (state, _dumps(reasons), step, attempt))
                self._certification(step, state, reasons, source, attempt=attempt)
            else:
                self._certification(step, state, reasons + [_found(row)], source, attempt=attempt,
                                    outcome=SUPERSEDED)
        return applied

    def put_evidence(self, step: int, evidence: dict[str, dict], source: str) -> None:
        now = time.time()
        with self.write():
            for kind, ev in evidence.items():
                self.db["evidence"].insert({
                    "step": step, "kind": kind, "status": ev["status"],
                    "detail": _dumps({k: v for k, v in ev.items() if k != "status"}),
                    "source": source, "recorded": now}, replace=True)

    def mark_checked(self, step: int, kinds: tuple[str, ...], source: str) -> None:
        """Evidence that passed again (e.g. `resume` re-hashed the bytes): only who checked it and when change.
        Plain SQL, no sqlite-utils: `resume` stays fast."""
        with self.write():
            for kind in kinds:
                self.conn.execute("UPDATE evidence SET source=?, recorded=? WHERE step=? AND kind=?",
                                  (source, time.time(), step, kind))

    def transition(self, step: int, to: str, reasons: list[dict], *, source: str,
                   expect: str | tuple[str, ...], attempt: str | None = None) -> bool:
        """Compare-and-set state change: `UPDATE ... WHERE step=? AND state IN expect [AND attempt=?]`.

        `expect` is the state (or states) the caller based its verdict on; `attempt`, if given, the save
        attempt it judged. A move not in transitions.ALLOWED raises ValueError (source "operator" may quarantine
        any state but deleted, and release a quarantine to any state). When the row changed meanwhile the verdict
        is not applied: it is kept in the history as 'superseded' and False is returned.
        """
        if to not in STATES:
            raise ValueError(f"unknown state {to!r}")
        expect = (expect,) if isinstance(expect, str) else tuple(expect)
        bad = [s for s in expect if s not in STATES or not allowed(s, to, source)]
        if bad:
            raise ValueError(f"step {step}: {'/'.join(bad)} -> {to} is not an allowed transition (by {source})")
        with self.write():
            marks = ",".join("?" * len(expect))
            sql = f"UPDATE checkpoints SET state=?, reasons=?, updated=? WHERE step=? AND state IN ({marks})"
            params: list = [to, _dumps(reasons), time.time(), step, *expect]
            if attempt is not None:
                sql += " AND attempt=?"
                params.append(attempt)
            applied = self.conn.execute(sql, params).rowcount == 1
            row = self.checkpoint(step)
            if applied:
                self._certification(step, to, reasons, source, attempt=row["attempt"])
            else:
                self._certification(step, to, reasons + [_found(row)], source,
                                    attempt=attempt or (row or {}).get("attempt"), outcome=SUPERSEDED)
        return applied

    def set_state(self, step: int, state: str, reasons: list[dict], source: str) -> None:
        """Deprecated: an unconditional state change, kept only until every caller uses `transition` (which
        refuses moves the state machine does not allow and does not overwrite a row that changed meanwhile)."""
        assert state in STATES, state
        with self.write():
            self.conn.execute("UPDATE checkpoints SET state=?, reasons=?, updated=? WHERE step=?",
                              (state, _dumps(reasons), time.time(), step))
            row = self.checkpoint(step)
            self._certification(step, state, reasons, source, attempt=(row or {}).get("attempt"))

    def _certification(self, step: int, state: str, reasons: list[dict], source: str, *,
                       attempt: str | None = None, outcome: str = APPLIED) -> None:
        self.db["certifications"].insert(
            {"step": step, "time": time.time(), "source": source, "state": state, "reasons": _dumps(reasons),
             "attempt": attempt, "outcome": outcome})

    def checkpoint(self, step: int) -> dict | None:
        rows = list(self._query("SELECT * FROM checkpoints WHERE step=?", [step]))
        return _decode(rows[0]) if rows else None

    def checkpoints(self, states: tuple[str, ...] | None = None, *, after: int | None = None) -> list[dict]:
        """Rows by step, optionally only in `states` and only with step > `after` (`resume` asks for the few
        newer than its answer, not all of a long run's: bench/scale.py)."""
        where, params = ["1=1"], []
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})"); params += list(states)
        if after is not None:
            where.append("step>?"); params.append(after)
        q = self._query(f"SELECT * FROM checkpoints WHERE {' AND '.join(where)} ORDER BY step", params)
        return [_decode(r) for r in q]

    def latest(self, state: str = "certified", below: int | None = None) -> dict | None:
        """The newest checkpoint in `state` (strictly below `below` if given). Uses the (state, step) index."""
        if below is None:
            rows = list(self._query(
                "SELECT * FROM checkpoints WHERE state=? ORDER BY step DESC LIMIT 1", [state]))
        else:
            rows = list(self._query(
                "SELECT * FROM checkpoints WHERE state=? AND step<? ORDER BY step DESC LIMIT 1", [state, below]))
        return _decode(rows[0]) if rows else None

    def files(self, step: int) -> list[dict]:
        return list(self._query("SELECT path, size, digest, rank FROM files WHERE step=? ORDER BY path", [step]))

    def evidence(self, step: int) -> dict[str, dict]:
        out = {}
        for r in self._query("SELECT * FROM evidence WHERE step=? ORDER BY kind", [step]):
            detail = json.loads(r["detail"]) if r["detail"] else {}
            out[r["kind"]] = {"status": r["status"], "source": r["source"], "recorded": r["recorded"], **detail}
        return out

    def evidence_summary(self) -> dict[int, dict[str, dict]]:
        """Every step's evidence status, who recorded it and when, in one query and without the details
        ({step: {kind: {"status", "source", "recorded"}}}): `ls` over N checkpoints is one scan, not N lookups
        (bench/scale.py)."""
        out: dict[int, dict[str, dict]] = {}
        for step, kind, status, source, recorded in self.conn.execute(
                "SELECT step, kind, status, source, recorded FROM evidence ORDER BY step, kind"):
            out.setdefault(step, {})[kind] = {"status": status, "source": source, "recorded": recorded}
        return out

    def certifications(self, step: int | None = None, *, all_outcomes: bool = False) -> list[dict]:
        """The verdict history, oldest first: verdicts applied (by default), or also those superseded by a
        concurrent change and refused re-saves (`all_outcomes`)."""
        where, params = ["1=1"], []
        if step is not None:
            where.append("step=?"); params.append(step)
        if not all_outcomes:
            where.append("(outcome IS NULL OR outcome=?)"); params.append(APPLIED)
        q = self._query(f"SELECT * FROM certifications WHERE {' AND '.join(where)} ORDER BY id", params)
        return [_decode(r) for r in q]

    # ---- where ranks ran ------------------------------------------------------------------------------------

    def record_ranks(self, run_id: str, rows: list[dict]) -> None:
        """Where each global rank of `run_id` runs: [{"rank", "host", "node_rank", "local_rank", "pid", ...}]
        (placement.this_rank; extra keys go to `detail`)."""
        base = ("rank", "host", "node_rank", "local_rank", "pid")
        with self.write():
            self.conn.executemany(
                "INSERT OR REPLACE INTO run_ranks(run_id, rank, host, node_rank, local_rank, pid, detail) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(run_id, *(r.get(k) for k in base), _dumps({k: v for k, v in r.items() if k not in base}))
                 for r in rows])

    def rank_places(self, run_id: str | None, ranks: list[int] | None = None) -> list[dict]:
        """[{"rank", "host", "node_rank", "local_rank", "pid"}] of a run, all ranks or the given ones; [] for a
        ledger written before run_ranks existed."""
        if run_id is None or not self._has_table("run_ranks"):
            return []
        sql = "SELECT rank, host, node_rank, local_rank, pid FROM run_ranks WHERE run_id=?"
        params: list = [run_id]
        if ranks is not None:
            sql += f" AND rank IN ({','.join('?' * len(ranks))})"
            params += list(ranks)
        return self._query(sql + " ORDER BY rank", params)

    # ---- events and replays --------------------------------------------------------------------------------

    def add_event(self, kind: str, *, step: int | None = None, ranks: list[int] | None = None,
                  detail: dict | None = None, run_id: str | None = None, when: float | None = None) -> int:
        """One event. Where the run recorded its ranks' places (record_ranks) and the detail does not say, the
        event's detail gains "nodes": {rank: "host/node N/local L"} for its ranks, so `report` names the node of
        a dead or hung rank in a multi-node job."""
        detail = dict(detail or {})
        if ranks and "nodes" not in detail:
            places = self.rank_places(run_id, sorted(ranks))
            if places:
                detail["nodes"] = {str(p["rank"]): place_text(p) for p in places}
        with self.write():
            return self.db["events"].insert({
                "time": when if when is not None else time.time(), "run_id": run_id, "kind": kind, "step": step,
                "ranks": _dumps(sorted(ranks or [])), "detail": _dumps(detail or {})}).last_pk

    def events(self, kinds: tuple[str, ...] | None = None) -> list[dict]:
        rows = [_decode(r) for r in self._query("SELECT * FROM events ORDER BY time, id")]
        return [r for r in rows if kinds is None or r["kind"] in kinds]

    def add_replays(self, rows: list[dict]) -> None:
        """Replay outcomes: {run_id, step, recipe, target, status, ranks, duration_s, detail}."""
        now = time.time()
        with self.write():
            self.db["replays"].insert_all([{
                "run_id": r.get("run_id"), "step": r["step"], "recipe": r["recipe"], "target": r["target"],
                "status": r["status"], "ranks": _dumps(r.get("ranks") or []), "duration_s": r.get("duration_s"),
                "time": r.get("time", now), "detail": _dumps(r.get("detail") or {})} for r in rows])

    def replays(self, run_id: str | None = None, after: int | None = None, upto: int | None = None) -> list[dict]:
        """Replays of one incarnation with after < step <= upto (bounds optional)."""
        where, params = ["1=1"], []
        if run_id is not None:
            where.append("run_id=?"); params.append(run_id)
        if after is not None:
            where.append("step>?"); params.append(after)
        if upto is not None:
            where.append("step<=?"); params.append(upto)
        q = self._query(f"SELECT * FROM replays WHERE {' AND '.join(where)} ORDER BY step, id", params)
        return [_decode(r) for r in q]
