"""A quarantined step reached again: its folder set aside so that a new attempt at the step can be saved.

A quarantined checkpoint is never resumed from, so a job whose operator quarantined step S restarts from an
earlier step and, training on, reaches S again. Refusing that save would lock the job out (every restart reaches S
and is refused again); saving into the quarantined folder would mix the new attempt with the distrusted bytes. So
the quarantined folder is renamed `NAME.scout-quarantined-ATTEMPT` and its ledger row's path follows
(Ledger.move_path, with a `moved` entry in the step's history), then the new attempt's `writing` row replaces the
row (`record_writing(over_quarantined=True)`, which records the `quarantine_set_aside` event naming the kept
folder in the same transaction: ledger/aside.py): the quarantine stays in the history, the journal and its own
folder, and the new attempt is judged on its own evidence. The run that wrote the quarantined attempt is refused
(its folder is left as it is): only a later incarnation, resumed from before the step, saves it anew. On an object
store nothing is renamed: every attempt has its own prefix already, and record_writing alone sets it aside.

The rename comes first: a crash between it and the row's update leaves a row that names a folder that no longer
exists, which the next save of the step refuses (fail closed) and `explain` shows; nothing is lost."""

from __future__ import annotations

import os
from pathlib import Path

from scout_ckpt.save import log

SUFFIX = ".scout-quarantined-"


def set_aside_quarantined(ledger, root: Path, step: int, row: dict, name: str, *, source: str, run_id: str) -> bool:
    """Coordinator, before the `writing` row of a save of a quarantined step: rename its folder aside and record
    the move. Returns whether the folder was set aside; a row of this same run, a row set aside already, a folder
    that is gone, or a target name taken leaves everything as it is (the save is then refused by record_writing,
    or, for a row set aside already, goes on).

    Args:
        ledger: the open ledger (the coordinator's).
        root: ROOT, where the folder lies.
        step: the quarantined step.
        row: its ledger row (state `quarantined`).
        name: the folder the new save writes, relative to ROOT (the quarantined one's, unless set aside).
        source: who sets it aside (recorded in the step's history).
        run_id: the incarnation saving anew (a row it wrote itself is not set aside: that save is refused).
    """
    old = row.get("path") or name
    if row.get("run_id") == run_id or old != name or not (Path(root) / old).is_dir():
        return False
    new = f"{old}{SUFFIX}{row.get('attempt') or 'none'}"
    if (Path(root) / new).exists():
        return False
    os.rename(Path(root) / old, Path(root) / new)
    ledger.move_path(step, old, new, source=source)
    log.logger.warning(
        "scout-ckpt: step %d is quarantined (attempt %s): its folder is kept as %s and this run saves the step anew",
        step,
        row.get("attempt"),
        new,
    )
    return True
