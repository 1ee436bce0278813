"""The side channel's names and small readers, shared by the training side (handle.py) and the observer process
(daemon.py, aftermath.py). Kept apart so the observer process, which starts at every Checkpointer, imports only
what it runs: not subprocess, atexit or the training side's hooks."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

REPORTS_DIR = "reports"  # format.layout.REPORTS_DIR, restated so the observer's start-up does not import format/


def channel_dir(root: str | os.PathLike, run_id: str) -> Path:
    return Path(root) / REPORTS_DIR / ".observer" / run_id


def read_json(path: Path) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_status(path: Path, obj: dict) -> None:
    """Atomic replace without fsync: a status is ephemeral, only its atomicity matters."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
    os.replace(tmp, path)


def final_settle_s(cfg: dict) -> float:
    """How long rank 0's observer may stay after its trainer closed, settling earlier runs: their observers
    exit `linger_s` after their trainers, plus two exchanges to write their last status."""
    return float(cfg["linger_s"]) + 2 * float(cfg["exchange_s"]) + 1.0


def load_factory(name: str):
    """'package.module:attr' -> the attribute (what the health spec names)."""
    module, _, attr = name.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
