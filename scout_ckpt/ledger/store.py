"""The Ledger: the state machine's writes (runs, save attempts, commits, evidence, compare-and-set transitions,
the verdict history, ranks' places, events, replays): the only code in scout-ckpt that writes the ledger's rows
(ledger/connection.py only creates and migrates the schema).

The module is split by concern (each file says why): ledger/connection.py opens the database (journal mode, busy
timeouts, migration, the BEGIN IMMEDIATE transaction); ledger/queries.py holds the read side; this file holds
only writes, each in one `write()` transaction. `Ledger` inherits both, so callers keep one class.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from scout_ckpt.errors import CertifiedStep, Quarantined
from scout_ckpt.ledger import aside, journal, tiers
from scout_ckpt.ledger.connection import (  # noqa: F401  (re-exported: importers use scout_ckpt.ledger.store)
    DEFAULT_BUSY_TIMEOUT_S,
    DEFAULT_READ_BUSY_TIMEOUT_S,
    LedgerUnavailable,
    header_journal,
)
from scout_ckpt.ledger.queries import LedgerQueries, place_text  # place_text re-exported
from scout_ckpt.ledger.transitions import APPLIED, REFUSED, STATES, SUPERSEDED, allowed

MOVED = "moved"  # a certifications row's outcome: the folder was renamed, the verdict unchanged


def _dumps(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def _found(row: dict | None) -> dict:
    """The history's note on a verdict not applied: what the row held instead."""
    if row is None:
        return {"code": "superseded", "found": None}
    return {"code": "superseded", "found": row["state"], "attempt": row["attempt"]}


class Ledger(LedgerQueries):
    """A run's ledger at ROOT/scout-ledger.db.

    Ledger.open(root)                  read-write; creates or migrates the schema if `create`
    Ledger.open(root, readonly=True)   read-only; fails with LedgerError rather than touch anything
    """

    # ---- runs ----------------------------------------------------------------------------------------------

    def begin_run(
        self,
        run_id: str,
        *,
        world_size: int,
        topology: dict,
        policy: dict,
        versions: dict | None = None,
        resumed_from: int | None = None,
    ) -> None:
        """A new incarnation of the job (one Checkpointer lifetime) begins.

        Args:
            run_id: the incarnation's id.
            world_size: its number of ranks.
            topology: its topology (mode, mesh, replica groups).
            policy: what "certified" requires of its saves.
            versions: torch, scout-ckpt and Python versions.
            resumed_from: the certified step it loaded (None: a fresh start).
        """
        with self.write():
            self.db["runs"].insert(
                {
                    "id": run_id,
                    "started": time.time(),
                    "world_size": world_size,
                    "topology": _dumps(topology),
                    "policy": _dumps(policy),
                    "versions": _dumps(versions or {}),
                    "resumed_from": resumed_from,
                    "host": socket.gethostname(),
                },
                replace=True,
            )

    def set_resumed_from(self, run_id: str, step: int | None) -> None:
        """The step an incarnation loaded, once it is known.

        Args:
            run_id: the incarnation.
            step: the step it loaded (None: a fresh start).
        """
        with self.write():
            self.conn.execute("UPDATE runs SET resumed_from=? WHERE id=?", (step, run_id))

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def record_writing(
        self,
        step: int,
        run_id: str,
        attempt: str,
        path: str,
        owner: dict | None = None,
        *,
        source: str = "save",
        keep_certified: bool = False,
        over_quarantined: bool = False,
    ) -> None:
        """The row written before DCP starts: an interrupted save leaves this record and no step dir.

        A quarantined step is refused (`Quarantined`, recorded in the history as 'refused'): the operator's
        decision stands until released. With `keep_certified` (a job's save), so is a certified step
        (`CertifiedStep`): a job that trains over a certified checkpoint instead of loading it would otherwise
        turn its row into `writing` and its folder into the new attempt's. A row in any other state is replaced by
        this attempt; its history
        (certifications rows, each with its attempt) is kept, so a re-saved rejected step still shows why the
        earlier attempt was rejected. `owner` ({"host", "pid", "start"}, `settle.this_process_owner()`) lets a
        later settler tell a save in flight from a dead one.

        Args:
            step: the step being saved.
            run_id: the incarnation saving it.
            attempt: the id of the save's temporary directory.
            path: the checkpoint's folder, relative to ROOT.
            owner: who writes it (host, pid, start time), so that start-up settles only dead owners' rows.
            source: what began it ("save", "adopt", ...).
            keep_certified: leave a certified row of the step as it is (an operator's replacement records it apart).
            over_quarantined: a quarantined step reached again by a later incarnation (a run resumed from an
                earlier step) is saved anew: a quarantined row written by another run whose bytes lie apart from
                this attempt's (its path is not `path`: the folder was set aside, or an object store's attempt
                prefix) is replaced by this attempt, and so is the fast tier's quarantined row of another run
                (its own run's folder). Each set-aside attempt is recorded, in this transaction, by a
                `quarantine_set_aside` event naming where its bytes are kept (ledger/aside.py), and stays in the
                history and the journal. The run that wrote the quarantined attempt is refused, on every storage.
        """
        owner = owner or {}
        with self.write():
            row = self.checkpoint(step)
            copy = tiers.row(self, step)

            def later_run(r: dict) -> bool:
                return over_quarantined and r.get("run_id") != run_id

            aside_row = (
                row is not None
                and row["state"] == "quarantined"
                and later_run(row)
                and row.get("path") not in (None, path)
            )
            aside_copy = copy is not None and copy["state"] == "quarantined" and later_run(copy)
            blocked = None
            if row is not None and row["state"] == "quarantined" and not aside_row:
                blocked = row
            elif copy is not None and copy["state"] == "quarantined" and not aside_copy:
                blocked = {**copy, "attempt": None}  # a step quarantined in the fast tier is quarantined: no save
            elif keep_certified and row is not None and row["state"] == "certified":
                blocked = row
            refused = blocked is not None
            if refused:
                row = blocked
                self._certification(
                    step,
                    "writing",
                    [{"code": row["state"], "attempt": row["attempt"]}],
                    source,
                    attempt=attempt,
                    outcome=REFUSED,
                )
            else:
                if aside_row:
                    assert row is not None
                    storage = "object_store" if ".attempt-" in str(row.get("path")) else "posix"
                    detail = aside.durable_detail(row, by=source, attempt=attempt, run_id=run_id, storage=storage)
                    self.add_event(aside.EVENT, step=step, run_id=run_id, detail=detail)
                if aside_copy:
                    assert copy is not None
                    detail = aside.local_detail(copy, by=source, run_id=run_id)
                    self.add_event(aside.EVENT, step=step, run_id=run_id, detail=detail)
                    self.conn.execute("DELETE FROM tier_checkpoints WHERE tier=? AND step=?", (tiers.LOCAL, step))
                now = time.time()
                self.conn.execute("DELETE FROM files WHERE step=?", (step,))
                self.conn.execute("DELETE FROM evidence WHERE step=?", (step,))
                self.db["checkpoints"].insert(
                    {
                        "step": step,
                        "run_id": run_id,
                        "state": "writing",
                        "path": path,
                        "bytes": None,
                        "attempt": attempt,
                        "started": now,
                        "committed": None,
                        "updated": now,
                        "manifest_digest": None,
                        "reasons": "[]",
                        "owner_host": owner.get("host"),
                        "owner_pid": owner.get("pid"),
                        "owner_start": owner.get("start"),
                    },
                    replace=True,
                )
                self._certification(step, "writing", [], source, attempt=attempt)
        if refused and row["state"] == "certified":
            raise CertifiedStep(
                f"step {step} is certified (attempt {row['attempt']}); a save does not replace a "
                "certified checkpoint: load it with load_latest_clean, or give a run that starts "
                "afresh its own ROOT"
            )
        if refused:
            reason = next((r.get("detail") for r in row["reasons"] or [] if r.get("code") == "quarantined"), None)
            raise Quarantined(
                f"step {step} is quarantined"
                + (f" ({reason})" if reason else "")
                + "; a run restarted from an earlier step saves it anew (the quarantined folder set aside), or "
                "`scout-ckpt release` it to trust the quarantined attempt again"
            )

    def record_commit(
        self,
        step: int,
        *,
        run_id: str | None,
        path: str,
        nbytes: int,
        manifest_digest: str,
        files: list[dict],
        evidence: dict[str, dict],
        state: str,
        reasons: list[dict],
        source: str = "save",
        attempt: str | None = None,
    ) -> bool:
        """Files, evidence and verdict of a committed checkpoint, in one transaction; compare-and-set.

        Applies only if the row is `writing` with this attempt, and returns True. Otherwise the verdict is kept in
        the history as 'superseded' and the state is left as it is; when the row is still this attempt (e.g. an
        operator quarantined it during the save) its files and evidence are recorded all the same, so that a
        release can judge them. Returns False then. `attempt=None` means whichever attempt the row holds: only for
        single-writer tools; a save passes its own.

        Args:
            step: the step committed.
            run_id: the incarnation that saved it.
            path: its folder, relative to ROOT.
            nbytes: its total size.
            manifest_digest: the digest of its scout-manifest.json.
            files: one {"path", "size", "digest", "rank"} per file (per node manifest in a multi-node save).
            evidence: the save's evidence by kind.
            state: the verdict ("certified", "committed" or "rejected").
            reasons: the verdict's reasons.
            source: what committed it ("save", "adopt", "rebuild", ...).
            attempt: the save attempt this commit closes (compare-and-set against the `writing` row).
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
                    [
                        {
                            "step": step,
                            "path": f["path"],
                            "size": f["size"],
                            "digest": f["digest"],
                            "rank": f.get("rank"),
                        }
                        for f in files
                    ]
                )
                self.put_evidence(step, evidence, source=source)
                self.conn.execute(
                    "UPDATE checkpoints SET run_id=?, path=?, bytes=?, committed=?, updated=?, manifest_digest=? "
                    "WHERE step=? AND attempt=?",
                    (run_id, path, nbytes, now, now, manifest_digest, step, attempt),
                )
            if applied:
                self.conn.execute(
                    "UPDATE checkpoints SET state=?, reasons=?, owner_host=NULL, owner_pid=NULL, "
                    "owner_start=NULL WHERE step=? AND state='writing' AND attempt=?",
                    (state, _dumps(reasons), step, attempt),
                )
                self._certification(step, state, reasons, source, attempt=attempt)
            else:
                self._certification(step, state, reasons + [_found(row)], source, attempt=attempt, outcome=SUPERSEDED)
        return applied

    def put_evidence(self, step: int, evidence: dict[str, dict], source: str) -> None:
        """Evidence checked (again) for a checkpoint, by kind.

        Args:
            step: the checkpoint.
            evidence: the evidence by kind, replacing what the kinds held.
            source: who checked it ("save", "certify", "resume", ...).
        """
        now = time.time()
        with self.write():
            for kind, ev in evidence.items():
                self.db["evidence"].insert(
                    {
                        "step": step,
                        "kind": kind,
                        "status": ev["status"],
                        "detail": _dumps({k: v for k, v in ev.items() if k != "status"}),
                        "source": source,
                        "recorded": now,
                    },
                    replace=True,
                )

    def mark_checked(self, step: int, kinds: tuple[str, ...], source: str) -> None:
        """Evidence that passed again (e.g. `resume` re-hashed the bytes): only who checked it and when change.
        Plain SQL, no sqlite-utils: `resume` stays fast.

        Args:
            step: the checkpoint.
            kinds: the evidence kinds checked again now, with the same outcome.
            source: who checked them.
        """
        with self.write():
            for kind in kinds:
                self.conn.execute(
                    "UPDATE evidence SET source=?, recorded=? WHERE step=? AND kind=?",
                    (source, time.time(), step, kind),
                )

    def transition(
        self,
        step: int,
        to: str,
        reasons: list[dict],
        *,
        source: str,
        expect: str | tuple[str, ...],
        attempt: str | None = None,
    ) -> bool:
        """Compare-and-set state change: `UPDATE ... WHERE step=? AND state IN expect [AND attempt=?]`.

        `expect` is the state (or states) the caller based its verdict on; `attempt`, if given, the save
        attempt it judged. A move not in transitions.ALLOWED raises ValueError (source "operator" may quarantine
        any state but deleted, and release a quarantine to any state). When the row changed meanwhile the verdict
        is not applied: it is kept in the history as 'superseded' and False is returned.

        Args:
            step: the checkpoint.
            to: the new state.
            reasons: why.
            source: who decided.
            expect: the state(s) the row must be in (compare-and-set).
            attempt: the save attempt the row must belong to.
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
                self._certification(
                    step,
                    to,
                    reasons + [_found(row)],
                    source,
                    attempt=attempt or (row or {}).get("attempt"),
                    outcome=SUPERSEDED,
                )
        return applied

    def set_state(self, step: int, state: str, reasons: list[dict], source: str) -> None:
        """Deprecated: an unconditional state change, kept only until every caller uses `transition` (which
        refuses moves the state machine does not allow and does not overwrite a row that changed meanwhile).

        Args:
            step: the checkpoint.
            state: the new state.
            reasons: why.
            source: who decided.
        """
        assert state in STATES, state
        with self.write():
            self.conn.execute(
                "UPDATE checkpoints SET state=?, reasons=?, updated=? WHERE step=?",
                (state, _dumps(reasons), time.time(), step),
            )
            row = self.checkpoint(step)
            self._certification(step, state, reasons, source, attempt=(row or {}).get("attempt"))

    def move_path(self, step: int, old: str, new: str, source: str) -> bool:
        """The checkpoint's folder was renamed under ROOT (integrations/pointers.py sets an untrusted one aside so
        that a framework's own "newest folder" resume passes it over): the row's path follows, compare-and-set on
        the old path, and the history records the move. Returns whether it applied.

        Args:
            step: the checkpoint.
            old: its folder relative to ROOT, as the row holds it.
            new: the folder's new name relative to ROOT.
            source: who moved it.
        """
        with self.write():
            cur = self.conn.execute(
                "UPDATE checkpoints SET path=?, updated=? WHERE step=? AND path=?", (new, time.time(), step, old)
            )
            if cur.rowcount != 1:
                return False
            row = self.checkpoint(step) or {}
            self._certification(  # history only (not a verdict): shown with all_outcomes
                step,
                row.get("state", ""),
                [{"code": "moved", "from": old, "to": new}],
                source,
                attempt=row.get("attempt"),
                outcome=MOVED,
            )
        return True

    def kept_aside(self) -> set:
        """What the object store's sweep keeps as quarantined attempts set aside (ledger/aside.py): their prefix
        names, from the events, and (step, attempt) of every quarantine in the journal that no release followed
        (a ledger rebuilt from the bucket has no events). Read-only; in store.py because the sweep's layer sits
        below the ledger and gets this object."""
        return aside.kept_paths(self) | aside.quarantined_in_journal(journal.read(self.path.parent))

    def _certification(
        self,
        step: int,
        state: str,
        reasons: list[dict],
        source: str,
        *,
        attempt: str | None = None,
        outcome: str = APPLIED,
    ) -> None:
        self.db["certifications"].insert(
            {
                "step": step,
                "time": time.time(),
                "source": source,
                "state": state,
                "reasons": _dumps(reasons),
                "attempt": attempt,
                "outcome": outcome,
            }
        )

    # ---- where ranks ran ------------------------------------------------------------------------------------

    def record_ranks(self, run_id: str, rows: list[dict]) -> None:
        """Where each global rank of `run_id` runs: [{"rank", "host", "node_rank", "local_rank", "pid", ...}]
        (placement.this_rank; extra keys go to `detail`).

        Args:
            run_id: the incarnation.
            rows: one {"rank", "host", "local_rank", "device", ...} per rank.
        """
        base = ("rank", "host", "node_rank", "local_rank", "pid")
        with self.write():
            self.conn.executemany(
                "INSERT OR REPLACE INTO run_ranks(run_id, rank, host, node_rank, local_rank, pid, detail) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    (run_id, *(r.get(k) for k in base), _dumps({k: v for k, v in r.items() if k not in base}))
                    for r in rows
                ],
            )

    # ---- events and replays --------------------------------------------------------------------------------

    def add_event(
        self,
        kind: str,
        *,
        step: int | None = None,
        ranks: list[int] | None = None,
        detail: dict | None = None,
        run_id: str | None = None,
        when: float | None = None,
    ) -> int:
        """One event. Where the run recorded its ranks' places (record_ranks) and the detail does not say, the
        event's detail gains "nodes": {rank: "host/node N/local L"} for its ranks, so `report` names the node of
        a dead or hung rank in a multi-node job, and "devices": {rank: {"host", "local_rank", "device", "uuid",
        "serial", "job"}}.

        Args:
            kind: the event's kind ("crash", "hang", "sdc", ...).
            step: the step it concerns.
            ranks: the ranks it names.
            detail: its fields.
            run_id: the incarnation it happened in.
            when: its time (default: now).
        """
        detail = dict(detail or {})
        if ranks and "nodes" not in detail:
            places = self.rank_places(run_id, sorted(ranks))
            if places:
                detail["nodes"] = {str(p["rank"]): place_text(p) for p in places}
                devices = {str(p["rank"]): p["device"] for p in places if p.get("device")}
                if devices:  # the hardware each named rank ran on (fleet/identity.py): what an operator drains
                    detail["devices"] = devices
        with self.write():
            return (
                self.db["events"]
                .insert(
                    {
                        "time": when if when is not None else time.time(),
                        "run_id": run_id,
                        "kind": kind,
                        "step": step,
                        "ranks": _dumps(sorted(ranks or [])),
                        "detail": _dumps(detail or {}),
                    }
                )
                .last_pk
            )

    def add_replays(self, rows: list[dict]) -> None:
        """Replay outcomes: {run_id, step, recipe, target, status, ranks, duration_s, detail}.

        Args:
            rows: one replay outcome per target and step.
        """
        now = time.time()
        with self.write():
            self.db["replays"].insert_all(
                [
                    {
                        "run_id": r.get("run_id"),
                        "step": r["step"],
                        "recipe": r["recipe"],
                        "target": r["target"],
                        "status": r["status"],
                        "ranks": _dumps(r.get("ranks") or []),
                        "duration_s": r.get("duration_s"),
                        "time": r.get("time", now),
                        "detail": _dumps(r.get("detail") or {}),
                    }
                    for r in rows
                ]
            )
