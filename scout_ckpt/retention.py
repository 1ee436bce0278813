"""Which checkpoints may be deleted. Never the newest certified one; rejected and partial ones go first.

Retention runs only after a new commit is durable (manifest fsynced, directory renamed, ledger written), so a
crash during gc can only lose checkpoints gc had already chosen to delete. Deleting renames the directory out of
the `step-*` namespace before removing it, so no torn `step-*` is ever visible.
"""

from __future__ import annotations

from pathlib import Path

from scout_ckpt.errors import BadInput
from scout_ckpt.layout import list_step_dirs, list_tmp_dirs, remove_dir
from scout_ckpt.ledger import Ledger

# Deleted first (oldest first within each class), then the rest by age.
_DISPOSABLE = ("rejected", "quarantined", "writing")


def plan(ledger: Ledger, root: Path, keep: int) -> dict:
    """{"delete": [steps], "keep": [steps], "protected": step|None, "partial": [paths]}; no side effects."""
    if keep < 1:
        raise BadInput(f"--keep must be at least 1 (got {keep}): the newest certified checkpoint is never deleted")
    on_disk = list_step_dirs(root)
    rows = {r["step"]: r for r in ledger.checkpoints() if r["step"] in on_disk}
    newest = ledger.latest("certified")
    protected = newest["step"] if newest else None
    # Directories the ledger does not know (e.g. foreign step-N folders) are left alone: not ours to delete.
    known = sorted(rows)
    disposable = [s for s in known if rows[s]["state"] in _DISPOSABLE and s != protected]
    good = [s for s in known if s not in disposable]
    order = disposable + [s for s in good if s != protected]  # oldest first within each class
    excess = len(known) - keep
    delete = order[:max(0, excess)]
    return {
        "delete": sorted(delete),
        "keep": sorted(s for s in known if s not in delete),
        "protected": protected,
        "partial": [str(p) for p in list_tmp_dirs(root)],
    }


def apply(ledger: Ledger, root: Path, keep: int, *, dry_run: bool = False) -> dict:
    """Carry out plan(). Temp dirs of dead saves are listed, not removed: one may belong to a save in flight;
    the checkpointer removes them at its next start."""
    result = plan(ledger, root, keep)
    if dry_run:
        return {**result, "dry_run": True}
    paths = {r["step"]: r["path"] for r in ledger.checkpoints()}
    for step in result["delete"]:
        remove_dir(Path(root) / paths[step])
        ledger.set_state(step, "deleted", [{"code": "retention", "keep": keep}], source="gc")
    return {**result, "dry_run": False}
