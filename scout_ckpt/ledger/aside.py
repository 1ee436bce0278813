"""Attempts of a quarantined step that a later incarnation set aside to save the step anew: where their bytes are
kept, so that no sweep, `gc` or retention takes them for a dead attempt, and so that the views can show them.

A quarantined checkpoint is never resumed from, so a job whose operator quarantined step S restarts from an
earlier step and, training on, reaches S again. That save is not refused (every restart would stop there); the
quarantined attempt is set aside instead and the new attempt takes the step's row. What is kept, per storage:

  POSIX ROOT      the folder renamed `NAME.scout-quarantined-ATTEMPT` (save/set_aside.py), the row's path follows;
  object store    the attempt's own prefix `step-S.attempt-A/`, as it is (every attempt has its own prefix);
  fast tier       each node's `RUN_ID/step-S/` of the earlier incarnation, as it is (the new one writes its own
                  run's folder), with the digests the row recorded for its files.

Each is recorded by one `quarantine_set_aside` event, written in the same ledger transaction that lets the new
attempt replace the quarantined row (Ledger.record_writing for a durable save, the fast tier's commit for a local
one): there is no moment at which neither the row nor the event names the kept bytes. The object store's sweep
also keeps every attempt whose quarantine the journal holds and no release followed (a ledger rebuilt from the
bucket has no events). Nothing removes a set-aside attempt: the operator deletes it when it is no longer wanted.
No torch.
"""

from __future__ import annotations

import json

EVENT = "quarantine_set_aside"
DURABLE, LOCAL = "durable", "local"


def durable_detail(row: dict, *, by: str, attempt: str, run_id: str, storage: str) -> dict:
    """The event's detail for a durable row set aside: the kept folder or prefix (`path`, relative to ROOT or to
    the store's prefix), the quarantined attempt and its incarnation, and who replaced it."""
    return {
        "tier": DURABLE,
        "storage": storage,
        "path": row.get("path"),
        "attempt": row.get("attempt"),
        "run_id": row.get("run_id"),
        "manifest_digest": row.get("manifest_digest"),
        "reasons": (row.get("reasons") or [])[:4],
        "by": by,
        "new_attempt": attempt,
        "new_run_id": run_id,
    }


def local_detail(row: dict, *, by: str, run_id: str) -> dict:
    """The event's detail for a fast-tier row set aside: the kept folder on each node (`dir`, relative to each
    node's local directory), every rank's file with the digest recorded before it was written, the peer copies,
    and the incarnation that wrote them."""
    return {
        "tier": LOCAL,
        "storage": "node_local",
        "dir": row.get("dir"),
        "run_id": row.get("run_id"),
        "files": row.get("files") or [],
        "copies": row.get("copies") or [],
        "reasons": (row.get("reasons") or [])[:4],
        "by": by,
        "new_run_id": run_id,
    }


def records(ledger, step: int | None = None) -> list[dict]:
    """The set-aside attempts recorded, oldest first: [{"step", "time", "tier", "path" or "dir", ...}] (the
    events' details, with their step and time)."""
    sql = "SELECT step, time, detail FROM events WHERE kind=?"
    params: list = [EVENT]
    if step is not None:
        sql += " AND step=?"
        params.append(step)
    out = []
    for r in ledger._query(sql + " ORDER BY id", params):
        try:
            detail = json.loads(r["detail"] or "{}")
        except ValueError:  # a damaged cell names nothing: nothing is kept by it, nothing shown
            continue
        if isinstance(detail, dict):
            out.append({"step": r["step"], "time": r["time"], "tier": DURABLE, **detail})
    return out


def kept_paths(ledger) -> set[str]:
    """The durable folders and object-store prefixes kept for set-aside attempts (relative names)."""
    return {r["path"] for r in records(ledger) if r.get("tier") != LOCAL and r.get("path")}


def kept_dirs(ledger) -> set[str]:
    """The fast tier's `RUN_ID/step-NNNNNNNN` folders kept for set-aside attempts."""
    return {r["dir"] for r in records(ledger) if r.get("tier") == LOCAL and r.get("dir")}


def quarantined_in_journal(records_: list[dict]) -> set[tuple[int, str]]:
    """(step, attempt) of every attempt whose last quarantine or release in the journal is a quarantine."""
    last: dict[tuple[int, str], str] = {}
    for r in records_:
        if r.get("kind") in ("quarantine", "release") and r.get("attempt"):
            last[(r["step"], r["attempt"])] = r["kind"]
    return {k for k, kind in last.items() if kind == "quarantine"}


__all__ = ["DURABLE", "EVENT", "LOCAL", "durable_detail", "kept_dirs", "kept_paths", "local_detail", "records"]
