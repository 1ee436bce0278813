"""What the fleet commands do (scout_ckpt/commands/fleet.py prints it): the suspects list, the verdicts behind one
device, and the import of existing ROOTs' history. Each opens the store named by the option or SCOUT_CKPT_FLEET.
"""

from __future__ import annotations

import datetime
import re
import time
from pathlib import Path

from scout_ckpt.errors import BadInput, NotFound
from scout_ckpt.fleet import records
from scout_ckpt.fleet import suspects as rule
from scout_ckpt.fleet.recorder import sync_root
from scout_ckpt.fleet.store import FleetStore, configured
from scout_ckpt.options import FLEET_ENV

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def store_path(path: str | Path | None) -> Path:
    p = configured(path)
    if p is None:
        raise BadInput(f"no fleet store: pass --fleet PATH or set {FLEET_ENV}")
    return p


def parse_since(text: str | None, now: float | None = None) -> float | None:
    """`--since`: a duration back from now (30m, 12h, 7d, 2w), an ISO date or time (2026-12-01,
    2026-12-01T08:00, UTC unless it says), or seconds since the epoch. BadInput otherwise."""
    if text is None:
        return None
    now = time.time() if now is None else now
    t = text.strip()
    m = _RELATIVE.match(t)
    if m:
        return now - float(m.group(1)) * _UNIT[m.group(2)]
    try:
        return float(t)
    except ValueError:
        pass
    try:
        d = datetime.datetime.fromisoformat(t)
    except ValueError:
        raise BadInput(f"--since {text!r}: not a time (30m, 12h, 7d, an ISO date or time, or epoch seconds)") from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=datetime.timezone.utc)
    return d.timestamp()


def check_min_score(value: float) -> float:
    if not value >= 0:  # NaN too
        raise BadInput(f"--min-score must be a number >= 0 (got {value})")
    return value


def suspects(path: str | Path | None, since: str | None = None, min_score: float = 0.0) -> dict:
    """{"suspects": [...most suspect first...], "not_hardware": [...], "store", "since"}."""
    when, min_score = parse_since(since), check_min_score(min_score)
    with FleetStore.open(store_path(path), readonly=True) as store:
        rows = store.verdicts(since=when)
    return {
        "store": str(store_path(path)),
        "since": when,
        "min_score": min_score,
        "suspects": rule.rank(rows, min_score=min_score),
        "not_hardware": rule.not_hardware(rows),
    }


def explain(path: str | Path | None, device: str, since: str | None = None) -> dict:
    """{"device", "verdicts": [...]} behind DEVICE; NotFound (exit 1) when none names it."""
    when = parse_since(since)
    if not device.strip():
        raise BadInput(
            "--explain needs a device (as `scout-ckpt suspects` lists it, a GPU UUID or serial, or HOST:LOCAL_RANK)"
        )
    with FleetStore.open(store_path(path), readonly=True) as store:
        found = rule.explain(store.verdicts(since=when), device)
    if not found:
        raise NotFound(f"no verdict in the fleet store names {device}")
    return {"device": device, "verdicts": found}


def import_roots(path: str | Path | None, roots: list[Path]) -> dict:
    """Bring in every ROOT's history. Every ROOT's ledger is opened first: one that cannot be read stops the
    import before anything is written (BadInput). Re-importing is harmless (one row per event and rank)."""
    target = store_path(path)
    if not roots:
        raise BadInput("fleet import needs at least one ROOT")
    for root in roots:
        records.read_root(root, after=2**62)  # opens the ledger read-only: LedgerError / LedgerUnavailable
    out = []
    with FleetStore.open(target) as store:
        for root in roots:
            out.append({"root": records.root_key(root), "added": sync_root(store, root)})
    return {"store": str(target), "roots": out, "added": sum(r["added"] for r in out)}
