"""The fast tier's rows in the ledger: table `tier_checkpoints` (ledger/schema.py AUX_TABLES), one row per
(tier, step), apart from `checkpoints` so that a durable and a local save of the same step never collide and every
reader of the durable tier is unchanged.

Coordinator-only writes, through the ledger's own write transaction; reads tolerate a ledger that predates the
table (an older scout-ckpt created it: no local steps).
"""

from __future__ import annotations

import json
import time

TIER = "local"


def _has(ledger) -> bool:
    return ledger._has_table("tier_checkpoints")


def _decode(row: dict) -> dict:
    out = dict(row)
    for k in ("layout", "files", "copies", "evidence", "signatures", "reasons"):
        if isinstance(out.get(k), str):
            out[k] = json.loads(out[k])
    return out


def record(
    ledger,
    *,
    step: int,
    run_id: str,
    state: str,
    dir: str,
    world_size: int,
    layout: dict,
    files: list[dict],
    copies: list[dict],
    evidence: dict,
    signatures: dict,
    reasons: list[dict],
) -> None:
    now = time.time()
    with ledger.write():
        ledger.conn.execute(
            "INSERT OR REPLACE INTO tier_checkpoints(tier, step, run_id, state, dir, world_size, layout, files, "
            "copies, evidence, signatures, reasons, committed, updated) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                TIER,
                step,
                run_id,
                state,
                dir,
                world_size,
                json.dumps(layout, sort_keys=True),
                json.dumps(files),
                json.dumps(copies),
                json.dumps(evidence, default=str),
                json.dumps(signatures),
                json.dumps(reasons, default=str),
                now,
                now,
            ),
        )


def rows(ledger, states: tuple[str, ...] | None = None) -> list[dict]:
    """The local tier's rows, newest first."""
    if not _has(ledger):
        return []
    got = [_decode(r) for r in ledger._query("SELECT * FROM tier_checkpoints WHERE tier=? ORDER BY step DESC", (TIER,))]
    return [r for r in got if states is None or r["state"] in states]


def row(ledger, step: int) -> dict | None:
    if not _has(ledger):
        return None
    got = ledger._query("SELECT * FROM tier_checkpoints WHERE tier=? AND step=?", (TIER, step))
    return _decode(got[0]) if got else None


def set_state(ledger, step: int, state: str, reasons: list[dict], *, expect: str | None = None) -> bool:
    """Compare-and-set the row's state (from `expect` when given); whether it changed."""
    sql = "UPDATE tier_checkpoints SET state=?, reasons=?, updated=? WHERE tier=? AND step=?"
    args: list = [state, json.dumps(reasons, default=str), time.time(), TIER, step]
    if expect is not None:
        sql += " AND state=?"
        args.append(expect)
    with ledger.write():
        return ledger.conn.execute(sql, args).rowcount > 0


def set_verdict(ledger, step: int, state: str, reasons: list[dict], evidence: dict, *, expect: str) -> bool:
    """Compare-and-set the row's evidence and verdict together (a re-decided local save); whether it changed."""
    sql = "UPDATE tier_checkpoints SET state=?, reasons=?, evidence=?, updated=? WHERE tier=? AND step=? AND state=?"
    args = [
        state,
        json.dumps(reasons, default=str),
        json.dumps(evidence, default=str),
        time.time(),
        TIER,
        step,
        expect,
    ]
    with ledger.write():
        return ledger.conn.execute(sql, args).rowcount > 0


def settle_replay(ledger, run_id: str, run_policy: dict, replay_evidence, missing: str) -> list[int]:
    """Coordinator: re-decide this run's local steps that wait on replay evidence (committed, replay `missing`),
    as the durable tier's pending checkpoints are (save/evidence/replay.py settle_pending): `replay_evidence(step)`
    gives the coverage known now; the row's evidence and its verdict under `run_policy` are written together.
    Without it a local save made while replay was pending stayed `committed` forever (never a restart candidate),
    and a replay that later found the fault never rejected it. Returns the steps whose state changed."""
    from scout_ckpt import policy

    changed = []
    for r in rows(ledger, states=("committed",)):
        ev = dict(r.get("evidence") or {})
        if r.get("run_id") != run_id or (ev.get("replay") or {}).get("status") != missing:
            continue
        new = replay_evidence(r["step"])
        if new["status"] == missing and new.get("reasons") == ev["replay"].get("reasons"):
            continue
        ev["replay"] = new
        v = policy.evaluate(run_policy, ev)
        if set_verdict(ledger, r["step"], v.state, v.reasons, ev, expect="committed") and v.state != "committed":
            changed.append(r["step"])
            if v.state == "rejected":
                ledger.add_event("local_rejected", step=r["step"], run_id=run_id, detail={"reasons": v.reasons[:8]})
    return changed
