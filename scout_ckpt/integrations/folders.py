"""Non-DCP checkpoint folders in a scout-ckpt ledger: the Hugging Face Trainer's `checkpoint-N` (safetensors,
`.pt` pickles, JSON) under ROOT = the Trainer's `output_dir`. Torch-free: `latest_clean` and the CLI run here.

Such a folder is written in place by the framework (no temp dir + rename), so the publishing step scout-ckpt
controls is the manifest: a `checkpoint-N` counts as a checkpoint only once its `scout-manifest.json` is written
and the ledger row is committed. The core reads these folders like DCP steps (`layout.is_folder_dir`: no `.metadata`
required), so settling, resume and retention are the core's functions; what is here is what only a framework that
writes in place needs on top of them:

  settle_folders   core `settle.settle_writing`, then the folder of a save it rejected as interrupted is removed,
                   so that the framework's own "newest folder" resume cannot pick up the half-written folder
  latest_clean_row core `recovery.latest_clean` (verify, walk back, reject failures), None on a fresh run
  apply_retention  core `retention.decide` over the framework's folders, also keeping the folders the framework
                   must keep (the Trainer's best model), applied by compare-and-set through the journal

The ledger row's path is the folder name relative to ROOT ("checkpoint-N"), so `scout-ckpt ls/explain/resume`
read it like a DCP step. The run's policy carries `"layout": "hf-trainer"`.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

from scout_ckpt.errors import NotFound
from scout_ckpt.format.digests import relpaths
from scout_ckpt.format.framework_folders import HF_TRAINER, register_framework_layouts
from scout_ckpt.format.layout import MANIFEST_NAME, remove_dir, scan_dirs
from scout_ckpt.ledger import Ledger, journal
from scout_ckpt.ops import retention
from scout_ckpt.ops.settle import settle_writing

LAYOUT = HF_TRAINER.name
PREFIX = "checkpoint"
FOLDER_RE = HF_TRAINER.pattern


def folder_name(step: int) -> str:
    """The Trainer's own name (transformers.trainer_utils.PREFIX_CHECKPOINT_DIR): not zero-padded."""
    return f"{PREFIX}-{step}"


parse_folder = HF_TRAINER.parse


def list_folders(root: str | os.PathLike) -> dict[int, Path]:
    """Every `checkpoint-N` directory under root, by step."""
    return scan_dirs(root, parse_folder)


register_framework_layouts()  # this integration reads and writes the layout: said here, explicitly


def run_policy(world_size: int, invariant_specs: list) -> dict:
    """What "certified" means for a Trainer run: bytes, the configured invariants (finite by default) and, with
    data-parallel replicas, consensus of the live model and optimizer state. One process has no replica to
    compare with: consensus is then not required (and the policy says so)."""
    require = ["bytes"] + (["invariants"] if invariant_specs else []) + (["consensus"] if world_size > 1 else [])
    return {
        "require": require,
        "allow_not_applicable": [],
        "invariants": list(invariant_specs),
        "layout": LAYOUT,
        "replay_targets": [],
    }


# ---- file digests split across ranks --------------------------------------------------------------------------


def assign_shares(files: list[tuple[str, int]], world: int) -> list[list[str]]:
    """Pure: split files over `world` ranks so that each reads about the same number of bytes (largest first,
    each to the least loaded rank; ties to the lower rank). The same answer on every rank for the same input."""
    load = [0] * world
    shares: list[list[str]] = [[] for _ in range(world)]
    for path, size in sorted(files, key=lambda f: (-f[1], f[0])):
        r = min(range(world), key=lambda i: (load[i], i))
        shares[r].append(path)
        load[r] += size
    return [sorted(s) for s in shares]


def listing(step_dir: Path) -> list[tuple[str, int]]:
    """(relative path, size) of every file in the folder but the manifest (and its temp files)."""
    out = []
    for rel in relpaths(step_dir):
        name = rel.rsplit("/", 1)[-1]
        if rel == MANIFEST_NAME or name.startswith(f".{MANIFEST_NAME}.tmp-"):
            continue
        out.append((rel, os.lstat(step_dir / rel).st_size))
    return out


# ---- settle, resume, retention: the core's, plus what in-place writers need ----------------------------------


def settle_folders(ledger: Ledger, root: Path, *, source: str = "startup") -> list[dict]:
    """Coordinator, at start-up: core `settle.settle_writing` (rows whose owner is provably dead: completed from
    the manifest of the same attempt, or rejected `save_interrupted`), then the folder of each save it rejected is
    removed: the framework wrote it in place, so it holds whatever part of the write happened."""
    out = settle_writing(ledger, root, source=source)
    paths = {r["step"]: r["path"] for r in ledger.checkpoints()}
    for s in out:
        if s["why"] == "save_interrupted" and paths.get(s["step"]):
            step_dir = Path(root) / paths[s["step"]]
            if step_dir.is_dir():
                remove_dir(step_dir)
    return out


def latest_clean_row(root: str | os.PathLike, *, verify: bool = True) -> dict | None:
    """Core `recovery.latest_clean` ({"step", "path", "state", "verified", "skipped", "newer"}: the newest certified
    checkpoint whose bytes verify, walking back past and rejecting any that fail), or None when there is none or
    no ledger yet (a fresh run)."""
    from scout_ckpt.format.layout import LEDGER_NAME, MANIFEST_NAME, list_checkpoint_dirs
    from scout_ckpt.ops.disk_view import latest_clean as from_manifests
    from scout_ckpt.ops.recovery import latest_clean

    root = Path(root)
    try:
        if (root / LEDGER_NAME).exists():
            return latest_clean(root, verify=verify)
        # No ledger: a fresh run only if no checkpoint carries a manifest. A ledger lost beside checkpoints is
        # answered from the manifests and the journal (read-only, fail closed), as `scout-ckpt resume` does;
        # the run's start then rebuilds the ledger (ops/startup.py): never a fresh start over them.
        if not root.is_dir() or not any((d / MANIFEST_NAME).is_file() for d in list_checkpoint_dirs(root).values()):
            return None
        return from_manifests(root, verify=verify)
    except NotFound:
        return None


def apply_retention(
    ledger: Ledger, root: Path, keep: int, *, dirs: dict[int, Path], also_keep: Collection[int] = frozenset()
) -> dict:
    """Core `retention.decide` over `dirs` ({step: directory} of the framework's checkpoints that the ledger
    knows; others are not ours): the `keep` newest certified kept, the newest always, newer ones awaiting evidence
    and quarantined ones kept, rejected ones deleted first. `also_keep` steps are kept besides (the Trainer's best
    model). Each deletion moves the row to `deleted` by compare-and-set on the state the plan saw (journaled), then
    removes the directory. Returns {"delete": [steps deleted], "keep": {step: why}, "protected"}."""
    rows = {r["step"]: r for r in ledger.checkpoints() if r["step"] in dirs}
    plan = retention.decide(
        {s: r["state"] for s, r in rows.items()}, keep, retention.saves_in_flight(list(rows.values()), root)
    )
    kept = dict(plan.keep)
    deleted = []
    for step, seen in sorted(plan.delete.items()):
        if step in also_keep:
            kept[step] = "best model"
            continue
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
            continue  # the row changed since the plan: a quarantine or a verdict wins
        try:
            remove_dir(dirs[step])
        except FileNotFoundError:
            pass
        deleted.append(step)
    return {"delete": deleted, "keep": dict(sorted(kept.items())), "protected": plan.protected}
