"""How `ls`, `explain` and `resume` show the quarantined attempts that a later incarnation set aside to save their
step anew (ledger/aside.py): where the kept bytes lie on each storage, whose they were, and that no restart
uses them. The step's row is the new attempt's; these are its history, listed apart so that no reader of the
rows mistakes one for a checkpoint. Read-only, no torch, no rich.
"""

from __future__ import annotations

import os

from scout_ckpt.ledger import aside
from scout_ckpt.ops.steps import store_uri


def rows(ledger, root: str | os.PathLike | None = None, step: int | None = None) -> list[dict]:
    """The set-aside attempts (of `step`, or all), oldest first: {"step", "tier", "storage", "where", "path" or
    "dir", "attempt", "run_id", "state": "quarantined", "time", "by", "new_attempt", "new_run_id"}; a local
    one also lists its files with their recorded digests. `where`: the kept folder under ROOT, the prefix's
    full URI on an object store, or the folder in each node's local directory."""
    uri = store_uri(root)
    out = []
    for r in aside.records(ledger, step):
        local = r.get("tier") == aside.LOCAL
        where = r.get("dir") if local else r.get("path")
        if not local and uri and r.get("storage") == "object_store":
            where = f"{uri.rstrip('/')}/{where}"
        doc = {
            "step": r["step"],
            "tier": r.get("tier"),
            "storage": r.get("storage"),
            "where": where,
            "attempt": r.get("attempt"),
            "run_id": r.get("run_id"),
            "state": "quarantined",
            "time": r.get("time"),
            "by": r.get("by"),
            "new_attempt": r.get("new_attempt"),
            "new_run_id": r.get("new_run_id"),
            "reasons": r.get("reasons") or [],
        }
        if local:
            doc["dir"] = r.get("dir")
            doc["files"] = [
                {k: f.get(k) for k in ("rank", "host", "where", "size", "digest")} for f in r.get("files") or []
            ]
        else:
            doc["path"] = r.get("path")
        out.append(doc)
    return out


def sentence(r: dict) -> str:
    """One line: which attempt of which step is kept aside, where, and that it is never resumed from."""
    whose = f"attempt {r['attempt']}" if r.get("attempt") else "copy"
    where = (
        f"in {r['where']} in each node's local directory ({len(r.get('files') or [])} rank file(s))"
        if r.get("tier") == aside.LOCAL
        else f"at {r['where']}"
    )
    return (
        f"step {r['step']}: the quarantined {r.get('tier')} {whose} of run {r.get('run_id')} is kept aside {where}, "
        "never resumed from; "
        f"run {r.get('new_run_id')} saved the step anew"
    )


__all__ = ["rows", "sentence"]
