"""The ledger a job starts on: never a fresh one over existing checkpoints (ARCHITECTURE.md, "Faults of the world").

A Checkpointer used to open ROOT's ledger with `create=True`: a deleted or truncated scout-ledger.db became an
empty ledger, `load_latest_clean` found nothing, the job trained from step 0, and its next save at an existing
step replaced a certified checkpoint. The coordinator now calls `open_run_ledger` instead:

  ledger readable                          -> opened (an older schema migrated), as before
  missing, empty or not SQLite, or SQLite  -> rebuilt from the manifests and the journal first (ops/rebuild.py,
  recording no checkpoint, beside            the same fail-closed rules as `scout-ckpt ledger rebuild`: nothing
  checkpoints with manifests                 certified that the record does not vouch for), with a WARNING; the
                                             unreadable file is kept as scout-ledger.db.bak-<time>
  unreadable for any other reason          -> StartRefused naming `scout-ckpt ledger rebuild` (locked beyond the
  (locked, corrupt SQLite, newer schema),    busy timeout, a malformed database): a person decides; the job does
  or a rebuild that could not read a step    not train over checkpoints it cannot account for
  now (an I/O error)

Only the coordinator calls it; the Checkpointer broadcasts the outcome, so every rank starts or every rank raises.
No torch here.
"""

from __future__ import annotations

import logging
from pathlib import Path

from scout_ckpt.errors import LedgerError, ScoutError
from scout_ckpt.format.layout import LEDGER_NAME, MANIFEST_NAME, list_checkpoint_dirs
from scout_ckpt.ledger import Ledger
from scout_ckpt.ledger.connection import header_journal

logger = logging.getLogger("scout_ckpt")


class StartRefused(LedgerError):
    """The job must not start on this ROOT's ledger as it is; the message says what to run."""


def _ledger_file(root: Path) -> str:
    """"missing", "empty", "not_sqlite" or "sqlite" (by the header, without opening it)."""
    path = root / LEDGER_NAME
    if not path.exists():
        return "missing"
    if path.is_file() and path.stat().st_size == 0:
        return "empty"
    if path.is_file() and header_journal(path) is None:
        return "not_sqlite"
    return "sqlite"


def _manifest_steps(root: Path, store) -> list[int]:
    """Steps that carry a manifest: step dirs under a POSIX ROOT, committed attempts on a bound object store."""
    if store is not None:
        return sorted(store.committed())
    return sorted(s for s, d in list_checkpoint_dirs(root).items() if (d / MANIFEST_NAME).is_file())


def _records_nothing(root: Path) -> bool:
    """A readable ledger with no checkpoint row (e.g. created empty by a start that did not know better)."""
    try:
        with Ledger.open(root, readonly=True) as led:
            return not led.checkpoints()
    except (ScoutError, OSError):
        return False   # unreadable or to be migrated: Ledger.open below decides


def open_run_ledger(root: str | Path, *, journal: str | None = None, store=None) -> Ledger:
    """Coordinator, at start-up: ROOT's ledger opened read-write (created for a new run), rebuilt first when it
    was lost beside checkpoints with manifests; StartRefused when it cannot be used (see the module docstring)."""
    root = Path(root)
    kind = _ledger_file(root)
    steps = _manifest_steps(root, store) if kind != "sqlite" or _records_nothing(root) else []
    if steps:
        why = {"missing": "missing", "empty": "empty", "not_sqlite": "not an SQLite file",
               "sqlite": "records no checkpoint"}[kind]
        logger.warning("%s: the ledger is %s beside %d checkpoint(s) with manifests (steps %s): rebuilding it from "
                       "the manifests and the journal, as `scout-ckpt ledger rebuild` does, instead of starting "
                       "from step 0", root / LEDGER_NAME, why, len(steps), ", ".join(map(str, steps[-8:])))
        from scout_ckpt.ops.rebuild import rebuild

        try:
            result = rebuild(root)
        except (ScoutError, OSError) as e:
            raise StartRefused(f"{root}: the ledger is {why} beside checkpoints and rebuilding it failed ({e}); "
                               f"run `scout-ckpt ledger rebuild {root}` and restart") from None
        unread = [s for s in result["skipped"] if s.get("could_not_check")]
        if unread:
            raise StartRefused(f"{root}: rebuilt the lost ledger, but step {unread[0]['step']} could not be read "
                               f"now ({unread[0]['reason']}); the job does not start without it: run "
                               f"`scout-ckpt ledger rebuild {root}` once the storage answers, then restart")
        for s in result["skipped"]:
            logger.warning("%s: ledger rebuild left step %d out: %s", root, s["step"], s["reason"])
        states = {r["step"]: r["state"] for r in result["checkpoints"]}
        logger.warning("%s: ledger rebuilt: %s%s", root,
                       ", ".join(f"{s} {st}" for s, st in sorted(states.items())) or "no checkpoint",
                       f"; the unreadable ledger is kept as {result['backup']}" if result["backup"] else "")
    try:
        return Ledger.open(root, create=True, journal=journal)
    except LedgerError as e:
        raise StartRefused(f"{root}: the ledger cannot be opened ({e}); the job does not start over checkpoints "
                           f"it cannot account for: run `scout-ckpt ledger rebuild {root}` (the old ledger is kept "
                           "as .bak), then restart") from None
