"""The ledger's read side: the queries that `ls`, `explain`, `resume`, `report` and the views run.

Why apart from ledger/store.py: the writes there are the state machine (compare-and-set transitions, the
verdict history) and must be read with the transition table in mind; the queries here change nothing, so a
reader (and a reviewer of a new view) needs only this file. `LedgerQueries` is a base of `Ledger`: every method
stays `ledger.checkpoints()`, `ledger.evidence_summary()`, ... as before. The writes use some of these queries
(`checkpoint`, `rank_places`) inside their transactions.
"""

from __future__ import annotations

import json
from typing import Any

from scout_ckpt.ledger.connection import LedgerConnection
from scout_ckpt.ledger.transitions import APPLIED

_JSON_COLUMNS = {"topology", "policy", "versions", "reasons", "detail", "ranks"}


def decode(row: dict[str, Any]) -> dict[str, Any]:
    """A row with its JSON columns parsed."""
    for k in _JSON_COLUMNS.intersection(row):
        if isinstance(row[k], str):
            row[k] = json.loads(row[k])
    return row


def place_text(p: dict) -> str:
    """{"host": "h1", "node_rank": 1, "local_rank": 0} -> "h1 node 1 local 0"."""
    parts = [str(p.get("host") or "?")]
    if p.get("node_rank") is not None:
        parts.append(f"node {p['node_rank']}")
    if p.get("local_rank") is not None:
        parts.append(f"local {p['local_rank']}")
    return " ".join(parts)


class LedgerQueries(LedgerConnection):
    """Read-only queries over the ledger's tables (no method here writes)."""

    # ---- runs ----------------------------------------------------------------------------------------------

    def run(self, run_id: str | None = None) -> dict | None:
        """One run (incarnation) by id, or the newest."""
        if run_id is None:
            rows = list(self._query("SELECT * FROM runs ORDER BY started DESC, rowid DESC LIMIT 1"))
        else:
            rows = list(self._query("SELECT * FROM runs WHERE id=?", [run_id]))
        return decode(rows[0]) if rows else None

    def runs(self) -> list[dict]:
        return [decode(r) for r in self._query("SELECT * FROM runs ORDER BY started, rowid")]

    # ---- checkpoints and evidence --------------------------------------------------------------------------

    def checkpoint(self, step: int) -> dict | None:
        rows = list(self._query("SELECT * FROM checkpoints WHERE step=?", [step]))
        return decode(rows[0]) if rows else None

    def checkpoints(self, states: tuple[str, ...] | None = None, *, after: int | None = None) -> list[dict]:
        """Rows by step, optionally only in `states` and only with step > `after` (`resume` asks for the few
        newer than its answer, not all of a long run's: bench/scale.py)."""
        where, params = ["1=1"], []
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})")
            params += list(states)
        if after is not None:
            where.append("step>?")
            params.append(after)
        q = self._query(f"SELECT * FROM checkpoints WHERE {' AND '.join(where)} ORDER BY step", params)
        return [decode(r) for r in q]

    def latest(self, state: str = "certified", below: int | None = None) -> dict | None:
        """The newest checkpoint in `state` (strictly below `below` if given). Uses the (state, step) index."""
        if below is None:
            rows = list(self._query("SELECT * FROM checkpoints WHERE state=? ORDER BY step DESC LIMIT 1", [state]))
        else:
            rows = list(
                self._query(
                    "SELECT * FROM checkpoints WHERE state=? AND step<? ORDER BY step DESC LIMIT 1", [state, below]
                )
            )
        return decode(rows[0]) if rows else None

    def files(self, step: int) -> list[dict]:
        """The step's recorded files: one row per rank-file, or (a multi-node save) `.metadata` and one row per
        node whose node manifest lists its ranks' files (format/node_manifest.py; verify_files reads through it)."""
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
        for r in self._query("SELECT step, kind, status, source, recorded FROM evidence ORDER BY step, kind"):
            out.setdefault(r["step"], {})[r["kind"]] = {
                "status": r["status"],
                "source": r["source"],
                "recorded": r["recorded"],
            }
        return out

    def certifications(self, step: int | None = None, *, all_outcomes: bool = False) -> list[dict]:
        """The verdict history, oldest first: verdicts applied (by default), or also those superseded by a
        concurrent change and refused re-saves (`all_outcomes`)."""
        where, params = ["1=1"], []
        if step is not None:
            where.append("step=?")
            params.append(step)
        if not all_outcomes:
            where.append("(outcome IS NULL OR outcome=?)")
            params.append(APPLIED)
        q = self._query(f"SELECT * FROM certifications WHERE {' AND '.join(where)} ORDER BY id", params)
        return [decode(r) for r in q]

    # ---- where ranks ran ------------------------------------------------------------------------------------

    def rank_places(self, run_id: str | None, ranks: list[int] | None = None) -> list[dict]:
        """[{"rank", "host", "node_rank", "local_rank", "pid", "device"}] of a run, all ranks or the given ones
        ("device": the rank's hardware identity, fleet/identity.py, None where not recorded); [] for a ledger
        written before run_ranks existed."""
        if run_id is None or not self._has_table("run_ranks"):
            return []
        sql = "SELECT rank, host, node_rank, local_rank, pid, detail FROM run_ranks WHERE run_id=?"
        params: list = [run_id]
        if ranks is not None:
            sql += f" AND rank IN ({','.join('?' * len(ranks))})"
            params += list(ranks)
        rows = self._query(sql + " ORDER BY rank", params)
        for r in rows:
            try:
                r["device"] = json.loads(r.pop("detail") or "{}").get("device")
            except (ValueError, AttributeError):
                r["device"] = None
        return rows

    # ---- events and replays --------------------------------------------------------------------------------

    def last_event_id(self) -> int:
        """The id of the newest event received (0: none). Ids are the ledger's receipt order, whatever the clock of
        the host that wrote an event: what windows over events are measured in (save/evidence/health.py)."""
        rows = list(self._query("SELECT COALESCE(MAX(id), 0) AS n FROM events"))
        return int(rows[0]["n"]) if rows else 0

    def events(self, kinds: tuple[str, ...] | None = None) -> list[dict]:
        rows = [decode(r) for r in self._query("SELECT * FROM events ORDER BY time, id")]
        return [r for r in rows if kinds is None or r["kind"] in kinds]

    def replays(self, run_id: str | None = None, after: int | None = None, upto: int | None = None) -> list[dict]:
        """Replays of one incarnation with after < step <= upto (bounds optional)."""
        where, params = ["1=1"], []
        if run_id is not None:
            where.append("run_id=?")
            params.append(run_id)
        if after is not None:
            where.append("step>?")
            params.append(after)
        if upto is not None:
            where.append("step<=?")
            params.append(upto)
        q = self._query(f"SELECT * FROM replays WHERE {' AND '.join(where)} ORDER BY step, id", params)
        return [decode(r) for r in q]
