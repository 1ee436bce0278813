"""Which checkpoints may be deleted: a pure plan over (step, state) rows, then an apply that goes through the
ledger's compare-and-set.

Rules (`keep=N` counts certified checkpoints):
  * the N newest certified checkpoints are kept; the newest certified one always (it is what a restart loads);
  * every committed (or still `writing`) checkpoint newer than the newest certified one is kept: it is awaiting
    evidence (replay coverage, certify) and may become the next latest clean; deleting it would strand the run;
  * quarantined checkpoints are kept: an operator decision is not retention's to undo (the state table forbids
    quarantined -> deleted);
  * everything else goes: rejected ones, committed ones older than the newest certified, certified ones beyond N.

Retention runs only after a new commit is durable, and its errors never fail a save (the checkpointer records them
as events). Deleting first moves the ledger row to `deleted` by compare-and-set on the state the plan saw (so a
concurrent quarantine or verdict wins), then renames the directory out of the `step-*` namespace and removes it;
a crash in between leaves a `deleted` row whose directory the next apply removes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from scout_ckpt import layout
from scout_ckpt.errors import BadInput
from scout_ckpt.ledger import Ledger
from scout_ckpt.settle import owner_alive

AWAITING = ("committed", "writing")


@dataclass(frozen=True)
class Plan:
    """The outcome of `decide`: steps to delete (with the state each was seen in) and steps kept, with why."""

    delete: dict[int, str] = field(default_factory=dict)      # step -> state seen
    keep: dict[int, str] = field(default_factory=dict)        # step -> why kept
    protected: int | None = None                               # the newest certified step


def decide(states: dict[int, str], keep: int) -> Plan:
    """Pure: {step: state} of the checkpoints on disk -> Plan. No I/O, no ledger."""
    if keep < 1:
        raise BadInput(f"--keep must be at least 1 (got {keep}): the newest certified checkpoint is never deleted")
    certified = sorted((s for s, st in states.items() if st == "certified"), reverse=True)
    newest = certified[0] if certified else None
    kept_certified = set(certified[:keep])
    delete: dict[int, str] = {}
    why: dict[int, str] = {}
    for step, state in sorted(states.items()):
        if state == "deleted":
            delete[step] = state                      # a crash between ledger and rmtree: finish the removal
        elif state == "quarantined":
            why[step] = "quarantined"
        elif step in kept_certified:
            why[step] = "newest certified" if step == newest else "certified"
        elif state in AWAITING and (newest is None or step > newest):
            why[step] = "awaiting evidence"
        else:
            delete[step] = state
    return Plan(delete=delete, keep=why, protected=newest)


def partial(root: Path) -> list[dict]:
    """Temp dirs of saves with their owner and whether it is alive (True, False: provably dead, None: unknown)."""
    out = []
    for tmp in layout.list_tmp_dirs(root):
        owner = layout.read_owner(tmp)
        out.append({"path": str(tmp), "owner": owner, "alive": owner_alive(owner)})
    return out


def plan(ledger: Ledger, root: Path, keep: int) -> dict:
    """{"delete": [steps], "keep": [steps], "protected": step|None, "reasons": {step: why kept},
    "partial": [{"path", "owner", "alive"}]}; no side effects. Directories the ledger does not know (e.g.
    foreign step-N folders) are left alone: not ours to delete."""
    on_disk = layout.list_checkpoint_dirs(root)
    states = {r["step"]: r["state"] for r in ledger.checkpoints() if r["step"] in on_disk}
    p = decide(states, keep)
    return {"delete": sorted(p.delete), "keep": sorted(p.keep), "protected": p.protected,
            "reasons": {str(s): w for s, w in sorted(p.keep.items())}, "partial": partial(Path(root)),
            "seen": {str(s): st for s, st in p.delete.items()}}


def apply(ledger: Ledger, root: Path, keep: int, *, dry_run: bool = False) -> dict:
    """Carry out plan(). Temp dirs are listed, not removed: one may belong to a save in flight; the checkpointer
    removes those whose owner is provably dead at its next start. A step whose row changed since the plan (the
    compare-and-set refuses) or whose directory another process removed first is skipped, not an error."""
    result = plan(ledger, root, keep)
    if dry_run:
        return {**result, "dry_run": True}
    paths = {r["step"]: r["path"] for r in ledger.checkpoints()}
    deleted = []
    for step in result["delete"]:
        seen = result["seen"][str(step)]
        if seen != "deleted" and not ledger.transition(step, "deleted", [{"code": "retention", "keep": keep}],
                                                       source="gc", expect=seen):
            continue
        try:
            layout.remove_dir(Path(root) / paths[step])
        except FileNotFoundError:
            pass  # a concurrent gc removed it first
        deleted.append(step)
    return {**result, "delete": deleted, "dry_run": False}
