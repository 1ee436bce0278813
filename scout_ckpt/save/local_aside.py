"""The fast tier's save of a quarantined step: refused for the run that wrote the quarantined local copy, saved
anew by a later one, the quarantined files kept (the same rule as a durable save's, save/set_aside.py).

Why it matters: a quarantined step is never loaded, so a job restarts from an earlier step and, training on,
reaches the step again. Rejecting every later local save of it would leave the fast tier without that step for
good, although the new save is a new attempt with its own evidence. So:

  * a later incarnation (another run id) writes its own run's folder `RUN_ID/step-S/` as always; at its commit
    the quarantined row is replaced by the new one, and in the same ledger transaction a `quarantine_set_aside`
    event records the earlier run's folder with the digests of its files (ledger/aside.py). That folder is not
    renamed (it lies on every node's disk; the coordinator alone records the commit): it is kept where it is,
    and the start-up sweep of orphaned folders (local_orphans.py) and retention leave every folder an event
    names, as they leave a live row's;
  * the run that wrote the quarantined copy would write into that very folder: its ranks stage their files
    under temporary names, the coordinator's refusal travels with the table every rank gathers anyway, and a
    refused save publishes nothing (the staged files go, the peer exchange is skipped): the quarantined bytes
    are never overwritten, and the save is rejected with the reason `quarantined`.

No torch here.
"""

from __future__ import annotations

import os
from pathlib import Path

from scout_ckpt.ledger import aside
from scout_ckpt.save import local_tier_rows as rows
from scout_ckpt.save import log

REFUSED = (
    "the step is quarantined and this run wrote it; a run restarted from an earlier step saves it anew (the "
    "quarantined files kept), or `scout-ckpt release` it to trust the quarantined copy again"
)


def refusal(ledger, step: int, run_id: str) -> dict | None:
    """Coordinator, before any rank publishes its file: the reason this run's local save of `step` is refused (the
    fast tier's row of the step is quarantined and this run wrote it), else None."""
    row = rows.row(ledger, step)
    if row is None or row["state"] != "quarantined" or row.get("run_id") != run_id:
        return None
    return {"code": "quarantined", "detail": REFUSED}


def set_aside(previous: dict | None, run_id: str) -> bool:
    """Is `previous` (the local row the commit of `run_id` replaces) a quarantined copy of a later run's step,
    to set aside rather than refuse?"""
    return previous is not None and previous["state"] == "quarantined" and previous.get("run_id") != run_id


def record_over(ledger, step: int, previous: dict | None, run_id: str, record) -> bool:
    """Coordinator: the new local row (`record()`); over a quarantined copy an earlier run wrote (set_aside), the
    event naming its kept folder first, in the same ledger transaction. Returns whether it was set aside."""
    if not set_aside(previous, run_id):
        record()
        return False
    assert previous is not None
    with ledger.write():
        detail = aside.local_detail(previous, by="local save", run_id=run_id)
        ledger.add_event(aside.EVENT, step=step, run_id=run_id, detail=detail)
        record()
    log.logger.warning(
        "local step %d is quarantined (run %s): its files are kept in %s and this run saves it anew",
        step,
        previous.get("run_id"),
        previous.get("dir"),
    )
    return True


def stage(path: Path, blob: bytes) -> tuple[Path | None, str | None]:
    """Write `blob` under a temporary name beside `path` (the name the orphan sweep knows); (the temp path, None)
    or (None, one line for why not: the node's disk, not the state)."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(blob)
    except OSError as e:
        discard(tmp)
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return tmp, None


def publish(tmp: Path, path: Path) -> str | None:
    """The staged file under its own name (rename); None, or one line for why not."""
    try:
        os.replace(tmp, path)
    except OSError as e:
        discard(tmp)
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return None


def discard(tmp: Path | None) -> None:
    if tmp is not None:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


__all__ = ["REFUSED", "discard", "publish", "record_over", "refusal", "set_aside", "stage"]
