"""At a job's start: is this rank's device a persistent suspect in the fleet record? (Checkpointer, every rank.)

Local to each rank and read-only: one query of the store with a short busy timeout. A store that cannot be read
is a WARNING, never a failed start: the fleet record advises, it does not gate training.
"""

from __future__ import annotations

import logging
import os
import sys

from scout_ckpt.fleet import suspects
from scout_ckpt.fleet.identity import this_device
from scout_ckpt.fleet.store import JOB_BUSY_TIMEOUT_S, FleetStore
from scout_ckpt.options import EXIT_SUSPECT_DEVICE, FleetOptions

log = logging.getLogger("scout_ckpt")


def suspect_entry(path, device: str) -> dict | None:
    """The store's entry for `device` if it is a persistent suspect, else None. Raises FleetUnavailable."""
    with FleetStore.open(path, readonly=True, busy_timeout=JOB_BUSY_TIMEOUT_S) as store:
        rows = store.verdicts()
    for s in suspects.rank(rows):
        if s["device"] == device and s["class"] == "persistent":
            return s
    return None


def check_this_rank(opts: FleetOptions, rank: int) -> dict | None:
    """Log an ERROR naming the evidence when this rank's device is a persistent suspect; with
    on_suspect="exit", then exit the process with EXIT_SUSPECT_DEVICE. Returns the entry (None: not a suspect,
    or the store could not be read)."""
    local_rank = int(os.environ["LOCAL_RANK"]) if os.environ.get("LOCAL_RANK", "").isdigit() else None
    ident = this_device(local_rank)
    try:
        entry = suspect_entry(opts.path, ident["device"])
    except Exception as e:  # noqa: BLE001 - a missing or locked store never stops a job from starting
        if not str(e).endswith("no fleet store here"):
            log.warning("fleet: %s not read at start (%s)", opts.path, e)
        return None
    if entry is None:
        return None
    kinds = ", ".join(f"{k} {sum(v.values())}" for k, v in entry["verdicts"].items())
    log.error(
        "fleet: rank %d runs on %s (host %s, local rank %s), a persistent suspect in %s: %s in %d job(s) "
        "(%s), score %g, last seen %s; `scout-ckpt suspects --explain %s` lists the verdicts%s",
        rank,
        ident["device"],
        ident["host"],
        local_rank,
        opts.path,
        kinds,
        len(entry["jobs"]),
        ", ".join(entry["jobs"][:4]),
        entry["score"],
        entry["last_seen"],
        ident["device"],
        f"; exiting with {EXIT_SUSPECT_DEVICE} (replace this node)" if opts.on_suspect == "exit" else "",
    )
    if opts.on_suspect == "exit":
        for h in logging.getLogger("scout_ckpt").handlers + logging.getLogger().handlers:
            h.flush()
        sys.stderr.flush()
        raise SystemExit(EXIT_SUSPECT_DEVICE)
    return entry
