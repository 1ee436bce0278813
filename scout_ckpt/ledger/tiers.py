"""The fast tier's ledger rows (table `tier_checkpoints`, schema.AUX_TABLES) as the offline tools read and rebuild
them: `ls`, `explain`, `report` (ops/tier_views.py, report/timeline.py) and `ledger rebuild` (ops/rebuild_local.py).

Why here and not in save/local_tier_rows.py, which writes them inside a job: the offline tools sit below `save`
in the house's layers (tests/test_layers.py), and the table is the ledger's. The row format is the one
local_tier_rows.record writes (JSON columns decoded the same way); a ledger that predates the table has no local
rows. No torch.
"""

from __future__ import annotations

import json
import time

LOCAL = "local"
JSON_COLUMNS = ("layout", "files", "copies", "evidence", "signatures", "reasons")
COLUMNS = (
    "tier",
    "step",
    "run_id",
    "state",
    "dir",
    "world_size",
    "layout",
    "files",
    "copies",
    "evidence",
    "signatures",
    "reasons",
    "committed",
    "updated",
)


def _decode(row: dict) -> dict:
    out = dict(row)
    for k in JSON_COLUMNS:
        if isinstance(out.get(k), str):
            try:
                out[k] = json.loads(out[k])
            except ValueError:  # a damaged cell is shown as missing, never as evidence
                out[k] = None
    return out


def rows(ledger, tier: str = LOCAL) -> list[dict]:
    """The tier's rows, newest step first ([] when the ledger has no such table)."""
    if not ledger._has_table("tier_checkpoints"):
        return []
    return [
        _decode(r) for r in ledger._query("SELECT * FROM tier_checkpoints WHERE tier=? ORDER BY step DESC", (tier,))
    ]


def row(ledger, step: int, tier: str = LOCAL) -> dict | None:
    if not ledger._has_table("tier_checkpoints"):
        return None
    got = ledger._query("SELECT * FROM tier_checkpoints WHERE tier=? AND step=?", (tier, step))
    return _decode(got[0]) if got else None


def insert(ledger, r: dict) -> None:
    """Write one whole row (a rebuilt one) into a ledger opened for writing; its times are kept when given."""
    now = time.time()
    vals = {
        **{k: None for k in COLUMNS},
        "tier": LOCAL,
        "committed": now,
        "updated": now,
        **{k: v for k, v in r.items() if k in COLUMNS},
    }
    for k in JSON_COLUMNS:
        v = vals[k]
        if v is None and k != "layout":  # an unknown layout stays NULL: no job's layout equals it
            v = {} if k in ("evidence", "signatures") else []
        vals[k] = None if v is None else json.dumps(v, sort_keys=k == "layout", default=str)
    with ledger.write():
        ledger.conn.execute(
            f"INSERT OR REPLACE INTO tier_checkpoints({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
            [vals[k] for k in COLUMNS],
        )


def set_state(
    ledger, step: int, state: str, reasons: list[dict], *, expect: str | None = None, tier: str = LOCAL
) -> bool:
    """Compare-and-set one copy row's state (from `expect` when given), inside the caller's write transaction
    if there is one; whether it changed. False when the ledger has no such table or row."""
    if not ledger._has_table("tier_checkpoints"):
        return False
    sql = "UPDATE tier_checkpoints SET state=?, reasons=?, updated=? WHERE tier=? AND step=?"
    args: list = [state, json.dumps(reasons, default=str), time.time(), tier, step]
    if expect is not None:
        sql += " AND state=?"
        args.append(expect)
    with ledger.write():
        return ledger.conn.execute(sql, args).rowcount > 0


__all__ = ["LOCAL", "insert", "row", "rows", "set_state"]
