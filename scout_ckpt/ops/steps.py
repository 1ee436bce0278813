"""The step/copy model as the offline tools show it: a step is the unit of trust, a copy the unit of bytes.

One step (its evidence, its lineage, its verdict) can have any number of copies: the durable folder under ROOT (or
the attempt's prefix on an object store), each rank's node-local file of the fast tier, and the peer copies other
ranks hold of it. A verdict on the step (quarantine, a rejection for anything but one copy's bytes:
policy.step_distrusted) holds for every copy, so no copy of such a step is handed out; a copy whose own bytes
failed (digest_mismatch, a missing file...) is ruled out alone, and the step stays certified while another copy
of it is good.

Why a view and not a table: the ledger records the durable tier in `checkpoints` and the fast tier in
`tier_checkpoints` (ledger/tiers.py), each row with the bytes evidence of its own copies; a step is what both
rows of the same number say together. Read-only, no torch: `ls`, `explain`, `gc`, `report` and `ledger rebuild`
add these documents (key "steps", or "copies" for one step) beside the keys they always had.
"""

from __future__ import annotations

import os

from scout_ckpt import policy
from scout_ckpt.ledger import tiers

DURABLE, OBJECT_STORE, NODE_LOCAL, PEER = "durable_folder", "object_store", "node_local", "peer"
PASS, FAIL, UNCHECKED, GONE = "pass", "fail", "unchecked", "deleted"


def _copy_failures(reasons: list[dict], rank: int | None = None) -> list[dict]:
    """The reasons that speak of bytes (of `rank`'s file when given) and say they are bad (could-not-check is
    not bad)."""
    out = []
    for r in reasons or []:
        code = (r or {}).get("code")
        if code not in policy.COPY_REASONS or code in ("could_not_check", "retention"):
            continue
        if rank is not None and r.get("rank") not in (None, rank):
            continue
        out.append(r)
    return out


def durable_copy(row: dict, bytes_status: str | None, uri: str | None = None) -> dict:
    """The durable folder (or object-store prefix) of a `checkpoints` row, with its bytes evidence: what the
    last check of the bytes recorded (`bytes_status`), `fail` when the row was rejected for them."""
    failed = _copy_failures(row.get("reasons") or []) if row["state"] == "rejected" else []
    if row["state"] == "deleted":
        status = GONE
    elif failed:
        status = FAIL
    else:
        status = bytes_status or UNCHECKED
    return {
        "kind": OBJECT_STORE if uri else DURABLE,
        "tier": "durable",
        "rank": None,
        "host": None,
        "where": f"{uri.rstrip('/')}/{row['path']}" if uri else row["path"],
        "bytes": {"status": status, "reasons": failed},
    }


def local_copies(row: dict) -> list[dict]:
    """The fast tier's copies of a step: each rank's node-local file and each peer copy, with its own bytes
    evidence (a file: its digest was taken before it was written, `fail` when the row names its rank among bad
    bytes; a peer copy: whether it hashed to the owner's digest when received)."""
    reasons = row.get("reasons") or []
    gone = row["state"] == "deleted"
    rejected = row["state"] == "rejected"
    out = []
    for f in row.get("files") or []:
        failed = _copy_failures(reasons, f.get("rank")) if rejected else []
        status = GONE if gone else FAIL if failed else PASS if f.get("digest") else UNCHECKED
        out.append(
            {
                "kind": NODE_LOCAL,
                "tier": tiers.LOCAL,
                "rank": f.get("rank"),
                "host": f.get("host"),
                "node": f.get("node"),
                "where": f.get("where") or f.get("path"),
                "bytes": {"status": status, "reasons": failed},
            }
        )
    for c in row.get("copies") or []:
        v = c.get("verified")
        status = GONE if gone else UNCHECKED if v is None else PASS if v else FAIL
        out.append(
            {
                "kind": PEER,
                "tier": tiers.LOCAL,
                "rank": c.get("rank"),
                "holder": c.get("holder"),
                "host": c.get("host"),
                "node": c.get("node"),
                "where": c.get("path"),
                "bytes": {"status": status, "reasons": [] if v is not False else [{"code": "digest_mismatch"}]},
            }
        )
    return out


def step_state(durable: dict | None, local: dict | None) -> tuple[str, list[dict]]:
    """The step's verdict from its rows: a verdict on the step itself (quarantined, or rejected for anything but
    one copy's bytes) from either row holds; else certified if a row of it is certified (another copy may have
    failed its bytes); else the durable row's state (the local one's for a step the fast tier alone holds)."""
    rows = [r for r in (durable, local) if r is not None]
    for want in ("quarantined", "rejected"):
        for r in rows:
            if r["state"] == want and policy.step_distrusted(r["state"], r.get("reasons") or []):
                return r["state"], list(r.get("reasons") or [])
    if any(r["state"] == "certified" for r in rows):
        return "certified", []
    live = [r for r in rows if r["state"] != "deleted"] or rows
    first = live[0]
    return first["state"], list(first.get("reasons") or [])


def step_view(durable: dict | None, local: dict | None, bytes_status: str | None = None, uri: str | None = None):
    """One step as the tools list it: {"step", "state", "reasons", "tiers", "copies"}."""
    state, reasons = step_state(durable, local)
    copies = ([durable_copy(durable, bytes_status, uri)] if durable is not None else []) + (
        local_copies(local) if local is not None else []
    )
    held = [("durable", durable), (tiers.LOCAL, local)]
    return {
        "step": (durable or local or {})["step"],
        "state": state,
        "reasons": reasons,
        "tiers": {t: r["state"] for t, r in held if r is not None},
        "copies": copies,
        "usable_copies": sum(1 for c in copies if c["bytes"]["status"] in (PASS, UNCHECKED))
        if state == "certified"
        else 0,
    }


def store_uri(root: str | os.PathLike | None) -> str | None:
    """The object store's URI ROOT is bound to, or None (a POSIX ROOT, or a binding that cannot be read now)."""
    if root is None:
        return None
    from scout_ckpt import object_store

    try:
        bound = object_store.binding(root)
    except Exception:  # noqa: BLE001 - an unreadable binding is said by the command that needs the store
        return None
    return (bound or {}).get("uri")


def steps(ledger, root: str | os.PathLike | None = None) -> list[dict]:
    """Every step the ledger records in either tier, newest first, as step_view gives it."""
    durable = {r["step"]: r for r in ledger.checkpoints()}
    local = {r["step"]: r for r in tiers.rows(ledger)}
    summary = ledger.evidence_summary()
    uri = store_uri(root)
    return [
        step_view(durable.get(s), local.get(s), (summary.get(s, {}).get("bytes") or {}).get("status"), uri)
        for s in sorted(set(durable) | set(local), reverse=True)
    ]


def with_copies(rows: list[dict], views: list[dict]) -> list[dict]:
    """`ls --json`'s checkpoints (and the demo's, which must read the same): each listed row with every copy of its
    step (the durable folder and the fast tier's files), from `steps`."""
    by_step = {v["step"]: v for v in views}
    return [{**r, "copies": by_step[r["step"]]["copies"]} if r["step"] in by_step else r for r in rows]


def steps_of(root: str | os.PathLike) -> list[dict]:
    """`steps` of ROOT's ledger, opened read-only ([] when it cannot be read now: the caller said why)."""
    import sqlite3

    from scout_ckpt.errors import LedgerUnavailable
    from scout_ckpt.ledger import Ledger

    try:
        with Ledger.open(root, readonly=True) as ledger:
            return steps(ledger, root)
    except (LedgerUnavailable, sqlite3.DatabaseError):
        return []


def copies_text(view: dict) -> str:
    """One sentence: the step's verdict and each copy with where it lies and its bytes."""
    parts = []
    for c in view["copies"]:
        who = "" if c["rank"] is None else f"rank {c['rank']}'s " if c["kind"] == NODE_LOCAL else f"rank {c['rank']} "
        kind = {DURABLE: "durable folder", OBJECT_STORE: "object store", NODE_LOCAL: "file", PEER: "peer copy"}
        host = f" on {c['host']}" if c.get("host") else ""
        parts.append(f"{who}{kind[c['kind']]}{host} at {c['where']} ({c['bytes']['status']})")
    return f"step {view['step']} is {view['state']}; copies: " + ("; ".join(parts) or "none")


__all__ = ["copies_text", "local_copies", "step_state", "step_view", "steps", "steps_of", "store_uri"]
