"""What TorchTitan's next checkpoint manager asks of its checkpoints, answered from the ledger: one definition for
the 0.3 ScoutCheckpointManager (integrations.torchtitan) and for a subclass of the manager on TorchTitan's main
branch. Plain functions of ROOT (TorchTitan's checkpoint folder, where the ledger lives); nothing here imports
torchtitan, so they serve whichever TorchTitan is installed.

TorchTitan main (pytorch/torchtitan b5bcd76c66d0, 2026-08-21) gives `BaseCheckpointManager` a `CheckpointStorage`
protocol (isdir/isfile/listdir/remove). The manager that follows it (the open pull-request stack on top of that
commit, and copies of the later base class) decides three things from hooks a subclass overrides:

  _is_valid_checkpoint(checkpoint_dir)      is this `step-N` a checkpoint retention counts? Its purge deletes a
                                            `step-N` for which this is False outright, as abandoned, without asking
                                            `purge_exempt`: so it must be True for every step scout-ckpt keeps
                                            (certified, awaiting evidence, quarantined, a save in flight) and False
                                            only for what is provably dead (rejected, deleted, a `writing` row whose
                                            owner is provably gone): `is_valid_checkpoint`
  _is_resumable_checkpoint(checkpoint_dir)  may automatic loading pick it? certified and its bytes re-verify:
                                            `is_resumable_checkpoint`
  _find_load_step(folder, max_step)         the newest resumable step <= max_step, -1 if none: `find_load_step`
  purge_exempt: Callable[[int], bool]       a valid step beyond keep_latest_k is deleted unless this says keep it:
                                            `purge_exempt(root, keep)` keeps what core retention keeps
                                            (retention.decide: the newest certified, the keep newest certified,
                                            newer ones awaiting evidence, quarantined ones, saves in flight) and
                                            steps the ledger does not know (not ours); for any other step it moves
                                            the ledger row to `deleted` by compare-and-set first and answers False
                                            only if that applied, then removes the folder itself, so the ledger
                                            never says certified about a folder TorchTitan removed, nor deleted
                                            about one still on disk

`find_load_step` hashes the step's files: called on every rank it would hash them once per rank, and ranks could
disagree if the disk changes between them; `find_load_step_collective` decides on rank 0 and broadcasts.
"""

from __future__ import annotations

import os
from pathlib import Path

from scout_ckpt import policy
from scout_ckpt.format import layout
from scout_ckpt.format.verify import could_not_check
from scout_ckpt.ledger import Ledger, journal
from scout_ckpt.ops import retention
from scout_ckpt.ops.settle import save_alive

__all__ = [
    "find_load_step",
    "find_load_step_collective",
    "is_resumable_checkpoint",
    "is_valid_checkpoint",
    "newest_resumable",
    "purge_exempt",
    "retention_plan",
    "step_of",
]

KEPT_STATES = ("certified", "committed", "quarantined")  # rows retention may keep: never abandoned outright


def step_of(checkpoint_dir: str | os.PathLike) -> int | None:
    """N of a `.../step-N` directory (TorchTitan's name), None for any other name."""
    return layout.parse_step_dir(os.path.basename(os.path.normpath(str(checkpoint_dir))))


def _has_ledger(root: Path) -> bool:
    return (root / layout.LEDGER_NAME).is_file()


def _row_for(ledger: Ledger, root: Path, checkpoint_dir) -> dict | None:
    """The ledger row of this directory: its step's row, if the row names this same directory."""
    step = step_of(checkpoint_dir)
    row = ledger.checkpoint(step) if step is not None else None
    if row is None or not row.get("path"):
        return None
    if (root / row["path"]).resolve() != Path(checkpoint_dir).resolve():
        return None
    return row


# ---- valid: what retention counts and must not delete as abandoned ----------------------------------------------


def is_valid_checkpoint(root: str | os.PathLike, checkpoint_dir: str | os.PathLike) -> bool:
    """Coordinator, local (one ledger read): False only for a `step-N` that is provably not worth keeping: its row
    is rejected or deleted, or `writing` with an owner provably dead (settle.save_alive is False). True for
    certified, committed (awaiting evidence) and quarantined rows and for a save that may be in flight. A folder
    the ledger does not know is judged as TorchTitan's DCP manager does (a `.metadata` file): not ours to judge."""
    root, d = Path(root), Path(checkpoint_dir)
    if step_of(d) is None or not d.is_dir():
        return False
    if not _has_ledger(root):
        return (d / ".metadata").is_file()
    with Ledger.open(root, readonly=True) as ledger:
        row = _row_for(ledger, root, d)
    if row is None:
        return (d / ".metadata").is_file()
    if row["state"] in KEPT_STATES:
        return True
    if row["state"] == "writing":
        return save_alive(root, row) is not False
    return False


# ---- resumable: certified and the bytes re-verify ----------------------------------------------------------------


def _verified(root: Path, ledger: Ledger, row: dict, *, record: bool) -> tuple[bool, dict | None]:
    """(handed out?, failed evidence or None): the bytes of a certified row re-verify and the row is unchanged
    after hashing. A failure is recorded (rejected, journaled) when `record`; "could not check" is neither a pass
    nor recorded."""
    from scout_ckpt.ops.recovery import record_verification_failure, verify_checkpoint

    ev = verify_checkpoint(root, ledger, row["step"])
    if ev["status"] != policy.PASS:
        if record and not could_not_check(ev):
            with Ledger.open(root) as writer:
                record_verification_failure(writer, row["step"], ev, source="resume", root=root)
        return False, ev
    now = ledger.checkpoint(row["step"])
    return (now is not None and now["state"] == "certified" and now["attempt"] == row["attempt"]), None


def is_resumable_checkpoint(root: str | os.PathLike, checkpoint_dir: str | os.PathLike, *, record: bool = True) -> bool:
    """Whether automatic loading may pick this `step-N`: its ledger row is certified, names this directory, and its
    files and manifest re-verify against the digests the ledger recorded (ops.recovery.verify_checkpoint). A
    failure is recorded as the rejection `resume` records (unless `record=False`); an I/O error answers False and
    records nothing. No ledger: False (nothing is certified)."""
    root = Path(root)
    if step_of(checkpoint_dir) is None or not _has_ledger(root):
        return False
    with Ledger.open(root, readonly=True) as ledger:
        row = _row_for(ledger, root, checkpoint_dir)
        if row is None or row["state"] != "certified":
            return False
        return _verified(root, ledger, row, record=record)[0]


def newest_resumable(root: str | os.PathLike, max_step: int | None = None) -> dict | None:
    """{"step", "attempt", "path", "skipped": [steps whose bytes failed or could not be checked]}: the newest
    certified step <= max_step whose bytes re-verify, walking back past (and rejecting) failures; None when there is
    none or no ledger (a fresh run). Without max_step it is the core's `recovery.latest_clean` (with its fallback to
    the manifests when the ledger cannot be read)."""
    from scout_ckpt.integrations.folders import latest_clean_row

    root = Path(root)
    if max_step is None:
        found = latest_clean_row(root)
        if found is None:
            return None
        with Ledger.open(root, readonly=True) as ledger:
            row = ledger.checkpoint(found["step"])
        return {
            "step": found["step"],
            "attempt": row["attempt"] if row else None,
            "path": found["path"],
            "skipped": [s["step"] for s in found["skipped"]],
        }
    if not _has_ledger(root):
        return None
    skipped: list[int] = []
    below = max_step + 1
    with Ledger.open(root, readonly=True) as ledger:
        while (row := ledger.latest("certified", below=below)) is not None:
            below = row["step"]
            ok, _ = _verified(root, ledger, row, record=True)
            if ok:
                return {
                    "step": row["step"],
                    "attempt": row["attempt"],
                    "path": str((root / row["path"]).resolve()),
                    "skipped": skipped,
                }
            skipped.append(row["step"])
    return None


def find_load_step(root: str | os.PathLike, max_step: int | None = None) -> int:
    """TorchTitan's `_find_load_step(folder, max_step)`: the newest resumable step <= max_step, -1 for none."""
    found = newest_resumable(root, max_step)
    return found["step"] if found else -1


def find_load_step_collective(root: str | os.PathLike, max_step: int | None = None, group=None) -> int:
    """Collective under torch.distributed (local otherwise): rank 0 of `group` runs `find_load_step` and broadcasts
    the step, so every rank loads the same step and the files are hashed once. An error on rank 0 is broadcast as
    -1 only after being raised there: the other ranks then see -1, rank 0 the error."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return find_load_step(root, max_step)
    box: list = [None]
    err = None
    if dist.get_rank(group) == 0:
        try:
            box[0] = find_load_step(root, max_step)
        except Exception as e:  # noqa: BLE001 -- re-raised below, after the other ranks are released
            err, box[0] = e, -1
    dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    if err is not None:
        raise err
    return int(box[0])


# ---- retention: purge_exempt --------------------------------------------------------------------------------------


def retention_plan(ledger: Ledger, root: str | os.PathLike, keep: int) -> tuple[retention.Plan, dict[int, dict]]:
    """(core retention.decide over the `step-N` folders the ledger knows, their rows)."""
    dirs = layout.list_step_dirs(root)
    rows = {r["step"]: r for r in ledger.checkpoints() if r["step"] in dirs}
    plan = retention.decide(
        {s: r["state"] for s, r in rows.items()}, max(1, keep), retention.saves_in_flight(list(rows.values()), root)
    )
    return plan, rows


def apply_retention(ledger: Ledger, root: str | os.PathLike, keep: int, also_keep=None) -> dict:
    """The 0.3 manager's retention: integrations.folders.apply_retention over the `step-N` folders (the same plan
    as `retention_plan`), deletions through the ledger's compare-and-set. `also_keep`: a callable step -> bool
    (a user's own `purge_exempt`, e.g. milestone steps) whose steps are kept besides."""
    from scout_ckpt.integrations.folders import apply_retention as apply

    dirs = layout.list_step_dirs(root)
    extra = {s for s in dirs if also_keep(s)} if callable(also_keep) else set()
    return apply(ledger, Path(root), keep, dirs=dirs, also_keep=extra)


def purge_exempt(root: str | os.PathLike, keep: int):
    """The callable for TorchTitan's `purge_exempt` (keep = its keep_latest_k). Called on the purging rank for a
    valid step beyond keep_latest_k: True keeps it. True for what core retention keeps and for a step the ledger
    does not know; otherwise the row moves to `deleted` (compare-and-set on the state and attempt the plan saw,
    journaled), then its folder is removed and the answer is False: the ledger records a deletion before the
    folder goes, and never says `deleted` about a folder still there, whoever called it; a row that changed
    meanwhile (a quarantine, a new verdict, a re-save) is kept."""
    root = Path(root)

    def exempt(step: int) -> bool:
        if not _has_ledger(root):
            return True
        with Ledger.open(root) as ledger:
            plan, rows = retention_plan(ledger, root, keep)
            if step not in rows or step in plan.keep:
                return True
            seen = plan.delete.get(step)
            if seen != "deleted" and not journal.record_transition(
                ledger,
                root,
                step,
                "deleted",
                [{"code": "retention", "keep": keep}],
                source="gc",
                expect=seen,
                attempt=rows[step]["attempt"],
            ):
                return True  # the row changed since the plan (a quarantine, a verdict, a re-save): kept
        # the row says deleted: the folder goes now, whoever asked (TorchTitan's purge, which then finds nothing to
        # remove -- its local rmtree ignores a missing path -- or a script asking), so that the ledger and the disk
        # never disagree about it
        folder = root / rows[step]["path"]
        if folder.is_dir():
            layout.remove_dir(folder)
        return False

    exempt.__qualname__ = f"purge_exempt({str(root)!r}, keep={keep})"
    return exempt
