"""Which checkpoints may be deleted: a pure plan over (step, state) rows, then an apply that goes through the
ledger's compare-and-set.

Rules (`keep=N` counts certified checkpoints):
  * the N newest certified checkpoints are kept; the newest certified one always (it is what a restart loads);
  * every committed (or still `writing`) checkpoint newer than the newest certified one is kept: it is awaiting
    evidence (replay coverage, certify) and may become the next latest clean; deleting it would strand the run;
  * quarantined checkpoints are kept: an operator decision is not retention's to undo (the state table forbids
    quarantined -> deleted);
  * a `writing` row whose owner may be alive (settle.save_alive: alive or cannot tell) is kept whatever its step:
    it is a save in flight, e.g. a re-save of an older step after a walk-back, whose commit would otherwise land
    on a `deleted` row. Retention never deletes on a possibly-live owner;
  * everything else goes: rejected ones, committed ones older than the newest certified, certified ones beyond N.

Retention runs only after a new commit is durable, and its errors never fail a save (the checkpointer records them
as events). Deleting first moves the ledger row to `deleted` by compare-and-set on the state the plan saw (so a
concurrent quarantine or verdict wins), then renames the directory out of the `step-*` namespace and removes it;
a crash in between leaves a `deleted` row whose directory the next apply removes.

On an object store (a ROOT bound to a URI, scout_ckpt.object_store) the same plan runs over the attempts that
have a manifest (a step without one is never listed); the row's move to `deleted` is the recorded intent, and
only then are the attempt's objects removed, manifest first. `gc` there also aborts dead attempts' multipart
uploads and removes their objects (object_store.attempts.sweep), each recorded in the ledger before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from scout_ckpt.errors import BadInput
from scout_ckpt.format import layout
from scout_ckpt.ledger import Ledger
from scout_ckpt.ops.settle import save_alive, tmp_dir_alive

AWAITING = ("committed", "writing")


@dataclass(frozen=True)
class Plan:
    """The outcome of `decide`: steps to delete (with the state each was seen in) and steps kept, with why."""

    delete: dict[int, str] = field(default_factory=dict)  # step -> state seen
    keep: dict[int, str] = field(default_factory=dict)  # step -> why kept
    protected: int | None = None  # the newest certified step


def decide(states: dict[int, str], keep: int, in_flight: frozenset[int] | set[int] = frozenset()) -> Plan:
    """Pure: {step: state} of the checkpoints on disk -> Plan. No I/O, no ledger. `in_flight`: the `writing`
    steps whose save may still be running (`saves_in_flight`), kept whatever their step."""
    if keep < 1:
        raise BadInput(f"--keep must be at least 1 (got {keep}): the newest certified checkpoint is never deleted")
    certified = sorted((s for s, st in states.items() if st == "certified"), reverse=True)
    newest = certified[0] if certified else None
    kept_certified = set(certified[:keep])
    delete: dict[int, str] = {}
    why: dict[int, str] = {}
    for step, state in sorted(states.items()):
        if state == "deleted":
            delete[step] = state  # a crash between ledger and rmtree: finish the removal
        elif state == "quarantined":
            why[step] = "quarantined"
        elif state == "writing" and step in in_flight:
            why[step] = "save in flight"
        elif step in kept_certified:
            why[step] = "newest certified" if step == newest else "certified"
        elif state in AWAITING and (newest is None or step > newest):
            why[step] = "awaiting evidence"
        else:
            delete[step] = state
    return Plan(delete=delete, keep=why, protected=newest)


def saves_in_flight(rows: list[dict], root: str | os.PathLike) -> set[int]:
    """The steps of `writing` rows whose owner may be alive (settle.save_alive is not False)."""
    return {r["step"] for r in rows if r["state"] == "writing" and save_alive(root, r) is not False}


def partial(root: Path, store=None, ledger: Ledger | None = None) -> list[dict]:
    """Temp dirs of saves with their owner and whether it is alive (True, False: provably dead, None: unknown).
    On an object store: attempts without a manifest, with the owner of the ledger row that names them."""
    out = []
    if store is not None:
        rows = {r["path"]: r for r in ledger.checkpoints()} if ledger is not None else {}
        for name, has in sorted(store.attempts().items()):
            if has:
                continue
            r = rows.get(name) or {}
            owner = {"host": r.get("owner_host"), "pid": r.get("owner_pid"), "start": r.get("owner_start")}
            out.append(
                {"path": store.uri_of(name), "owner": owner if r else None, "alive": save_alive(root, r) if r else None}
            )
        return out
    for tmp in layout.list_tmp_dirs(root):
        out.append({"path": str(tmp), "owner": layout.read_owner(tmp), "alive": tmp_dir_alive(root, tmp)})
    return out


def _on_store(ledger: Ledger, store) -> dict[int, str]:
    """{step: state} of the rows whose attempt has a manifest on the store (or whose removal is unfinished)."""
    committed = {name for names in store.committed().values() for name in names}
    present = set(store.attempts())
    return {
        r["step"]: r["state"]
        for r in ledger.checkpoints()
        if r["path"] in committed or (r["state"] == "deleted" and r["path"] in present)
    }


def plan(ledger: Ledger, root: Path, keep: int, store=None) -> dict:
    """{"delete": [steps], "keep": [steps], "protected": step|None, "reasons": {step: why kept},
    "partial": [{"path", "owner", "alive"}]}; no side effects. Directories the ledger does not know (e.g.
    foreign step-N folders) are left alone: not ours to delete."""
    rows = ledger.checkpoints()
    if store is not None:
        states = _on_store(ledger, store)
    else:
        on_disk = layout.list_checkpoint_dirs(root)
        states = {r["step"]: r["state"] for r in rows if r["step"] in on_disk}
    p = decide(states, keep, saves_in_flight(rows, root))
    attempts = {r["step"]: r["attempt"] for r in rows}
    return {
        "delete": sorted(p.delete),
        "keep": sorted(p.keep),
        "protected": p.protected,
        "reasons": {str(s): w for s, w in sorted(p.keep.items())},
        "partial": partial(Path(root), store, ledger),
        "seen": {str(s): st for s, st in p.delete.items()},
        "seen_attempt": {str(s): attempts.get(s) for s in p.delete},
    }


def apply(ledger: Ledger, root: Path, keep: int, *, dry_run: bool = False, store=None, sweep: bool = True) -> dict:
    """Carry out plan(). Temp dirs are listed, not removed: one may belong to a save in flight; the checkpointer
    removes those whose owner is provably dead at its next start. A step whose row changed since the plan (the
    compare-and-set refuses) or whose directory another process removed first is skipped, not an error.
    A ROOT bound to an object store is detected (or `store` given); there `sweep` (gc: yes; after each save:
    no, start-up does it) also clears dead attempts first."""
    if store is None:
        from scout_ckpt.object_store import bound_store

        store = bound_store(root)
    swept = None
    if store is not None and sweep:
        from scout_ckpt.object_store.attempts import sweep as sweep_attempts

        swept = sweep_attempts(ledger, store, source="gc", dry_run=dry_run)
    result = plan(ledger, root, keep, store)
    if swept is not None:
        result["swept"] = swept
    if dry_run:
        result.pop("seen_attempt")
        return {**result, "dry_run": True}
    paths = {r["step"]: r["path"] for r in ledger.checkpoints()}
    deleted = []
    seen_attempt = result.pop("seen_attempt")
    for step in result["delete"]:
        seen = result["seen"][str(step)]
        # compare-and-set on the state and the attempt the plan saw: a save of the step begun since wins
        if seen != "deleted" and not ledger.transition(
            step,
            "deleted",
            [{"code": "retention", "keep": keep}],
            source="gc",
            expect=seen,
            attempt=seen_attempt[str(step)],
        ):
            continue
        try:
            if store is not None:
                store.delete_attempt(paths[step])
            else:
                layout.remove_dir(Path(root) / paths[step])
        except FileNotFoundError:
            pass  # a concurrent gc removed it first
        deleted.append(step)
    return {**result, "delete": deleted, "dry_run": False}


def gc(root: str | os.PathLike, keep: int, *, dry_run: bool = False) -> dict:
    """`scout-ckpt gc ROOT --keep N [--dry-run]`: apply() on ROOT's ledger (read-only for a dry run), on the object
    store ROOT is bound to if any (scout_ckpt.ops.roots: an `s3://` ROOT or a bad one is BadInput, exit 2)."""
    from scout_ckpt.ops import roots

    store = roots.store_for(root)
    with Ledger.open(root, readonly=dry_run) as ledger:
        return apply(ledger, Path(root), keep, dry_run=dry_run, store=store)


def decide_local(states: dict[int, str], keep: int) -> list[int]:
    """The fast tier's plan (pure): the local steps to delete, given {step: state} of the local tier and its
    `keep`.

    Only certified steps count toward `keep`, so a run of rejected local saves never pushes out the only
    certified local step newer than the newest durable certified one (the state a restart would otherwise lose:
    the durable tier does not have it). Kept: the `keep` newest certified local steps, and every `committed` one
    newer than the newest certified (still awaiting evidence). Deleted: rejected ones, certified ones beyond
    `keep`, and committed ones older than the newest certified."""
    certified = sorted((s for s, st in states.items() if st == "certified"), reverse=True)
    kept = set(certified[:keep])
    newest = certified[0] if certified else None
    drop = []
    for s, st in sorted(states.items()):
        if s in kept or st == "deleted":
            continue
        if st == "committed" and (newest is None or s > newest):
            continue
        drop.append(s)
    return drop
