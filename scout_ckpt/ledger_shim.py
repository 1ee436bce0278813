"""TEMPORARY: the ledger API of PLAN.md ("Ledger API contract") for code written before branch wp-ledger lands.

Each function uses the real API (Ledger.transition, scout_ckpt.settle, scout_ckpt.journal) when it exists and
falls back to the old one otherwise. Deleted once wp-ledger is merged; callers then use the real names.
"""

from __future__ import annotations

import os
import socket

from scout_ckpt import layout
from scout_ckpt import manifest as manifest_mod
from scout_ckpt.errors import ScoutError

try:
    from scout_ckpt import settle as _settle  # type: ignore[attr-defined]
except ImportError:
    _settle = None
try:
    from scout_ckpt import journal as _journal  # type: ignore[attr-defined]
except ImportError:
    _journal = None


def transition(ledger, step: int, to: str, reasons: list[dict], *, source: str, expect) -> bool:
    if hasattr(ledger, "transition"):
        return ledger.transition(step, to, reasons, source=source, expect=expect)
    expect = (expect,) if isinstance(expect, str) else tuple(expect)
    with ledger.write():
        row = ledger.checkpoint(step)
        if row is None or row["state"] not in expect:
            return False
        ledger.set_state(step, to, reasons, source=source)
    return True


def record_writing(ledger, step: int, run_id: str, attempt: str, path: str, owner: dict) -> None:
    try:
        ledger.record_writing(step, run_id, attempt, path, owner=owner)
    except TypeError:
        ledger.record_writing(step, run_id, attempt, path)


def this_process_owner() -> dict:
    if _settle is not None:
        return _settle.this_process_owner()
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def owner_alive(owner: dict | None) -> bool | None:
    if _settle is not None:
        return _settle.owner_alive(owner)
    if not owner or owner.get("host") != socket.gethostname() or not owner.get("pid"):
        return None
    start = _start_time(int(owner["pid"]))
    if not start:
        return False
    return not owner.get("start") or start == owner["start"]


def settle_writing(ledger, root, *, source: str) -> list[dict]:
    if _settle is not None:
        return _settle.settle_writing(ledger, root, source=source)
    out = []
    for row in ledger.checkpoints(states=("writing",)):
        tmp = root / layout.tmp_dirname(row["step"], row["attempt"])
        if tmp.exists() and owner_alive(layout.read_owner(tmp)) is not False:
            continue
        step_dir = root / row["path"]
        try:
            m, digest = manifest_mod.read(step_dir) if step_dir.is_dir() else (None, None)
        except ScoutError:
            m = None
        if m is not None and m.get("attempt") == row["attempt"]:
            v = m["verdict"]
            ledger.record_commit(row["step"], run_id=m.get("run_id"), path=row["path"],
                                 nbytes=layout.dir_bytes(step_dir), manifest_digest=digest, files=m["files"],
                                 evidence=m["evidence"], state=v["state"], reasons=v["reasons"], source=source,
                                 attempt=row["attempt"])
            out.append({"step": row["step"], "state": v["state"]})
        else:
            transition(ledger, row["step"], "rejected", [{"code": "save_interrupted", "attempt": row["attempt"]}],
                       source=source, expect="writing")
            out.append({"step": row["step"], "state": "rejected"})
    return out


def journal_append(root, record: dict) -> None:
    if _journal is not None:
        _journal.append(root, record)
