"""Non-DCP checkpoint folders in a scout-ckpt ledger: the Hugging Face Trainer's `checkpoint-N` (safetensors,
`.pt` pickles, JSON) under ROOT = the Trainer's `output_dir`. Torch-free: `latest_clean` and the CLI run here.

Such a folder is written in place by the framework (no temp dir + rename), so the publishing step scout-ckpt
controls is the manifest: a `checkpoint-N` counts as a checkpoint only once its `scout-manifest.json` is written
and the ledger row is committed. A folder whose save was interrupted (ledger row still `writing`, no manifest of
that attempt) is rejected with `save_interrupted` and removed by `settle_writing`, so that neither scout-ckpt
nor the framework's own "newest folder" resume can pick it up.

The ledger row's path is the folder name relative to ROOT ("checkpoint-N"), so `scout-ckpt ls/explain/resume`
read it like a DCP step. The run's policy carries `"layout": "hf-trainer"`: a folder has no DCP `.metadata`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from scout_ckpt import manifest as manifest_mod
from scout_ckpt import policy
from scout_ckpt.digests import relpaths
from scout_ckpt.errors import BadInput
from scout_ckpt.layout import MANIFEST_NAME, dir_bytes, remove_dir, scan_dirs
from scout_ckpt.ledger import Ledger
from scout_ckpt.recovery import trusted_manifest
from scout_ckpt.verify import verify_files

LAYOUT = "hf-trainer"
PREFIX = "checkpoint"
FOLDER_RE = re.compile(r"^checkpoint-(\d+)$")


def folder_name(step: int) -> str:
    """The Trainer's own name (transformers.trainer_utils.PREFIX_CHECKPOINT_DIR): not zero-padded."""
    return f"{PREFIX}-{step}"


def parse_folder(name: str) -> int | None:
    m = FOLDER_RE.match(name)
    return int(m.group(1)) if m else None


def list_folders(root: str | os.PathLike) -> dict[int, Path]:
    """Every `checkpoint-N` directory under root, by step."""
    return scan_dirs(root, parse_folder)


def run_policy(world_size: int, invariant_specs: list) -> dict:
    """What "certified" means for a Trainer run: bytes, the configured invariants (finite by default) and, with
    data-parallel replicas, consensus of the live model and optimizer state. One process has no replica to
    compare with: consensus is then not required (and the policy says so)."""
    require = ["bytes"] + (["invariants"] if invariant_specs else []) + (["consensus"] if world_size > 1 else [])
    return {"require": require, "allow_not_applicable": [], "invariants": list(invariant_specs),
            "layout": LAYOUT, "replay_targets": []}


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


# ---- verification ---------------------------------------------------------------------------------------------

def verify_folder(step_dir: Path, files: list[dict]) -> dict:
    """Bytes evidence for a folder: every recorded file present with its size and digest, and nothing else but
    the manifest (verify_files without the DCP `.metadata` requirement, which a Trainer folder cannot meet)."""
    ev = verify_files(step_dir, files, expect_complete=False)
    if not Path(step_dir).is_dir():
        return ev
    recorded = {f["path"] for f in files}
    extra = [{"code": "unexpected_file", "file": p} for p, _ in listing(Path(step_dir)) if p not in recorded]
    if not files:
        extra.append({"code": "no_files_recorded"})
    if extra:
        ev = policy.evidence(policy.FAIL, ev["reasons"] + extra,
                             **{k: v for k, v in ev.items() if k not in ("status", "reasons")})
    return ev


def verify_recorded(root: Path, ledger: Ledger, row: dict) -> dict:
    """Bytes evidence of a recorded folder: files against the ledger, the manifest against its recorded digest."""
    step_dir = Path(root) / row["path"]
    ev = verify_folder(step_dir, ledger.files(row["step"]))
    if step_dir.is_dir():
        _, bad = trusted_manifest(step_dir, row)
        if bad:
            ev = policy.evidence(policy.FAIL, ev["reasons"] + bad,
                                 **{k: v for k, v in ev.items() if k not in ("status", "reasons")})
    return ev


# ---- ledger state changes, across the ledger API change (set_state -> compare-and-set transition) -------------

def _journal():
    try:
        from scout_ckpt import journal
    except ImportError:  # a core without the journal
        return None
    return journal


def transition(ledger: Ledger, step: int, to: str, reasons: list[dict], *, source: str,
               expect: str | tuple[str, ...], root: Path | None = None) -> bool:
    """Move a row from `expect` to `to`; False when the row was no longer in `expect` (not applied). With `root`,
    an applied change is also journaled beside the data (scout_ckpt.journal, where the core has one)."""
    journal = _journal() if root is not None else None
    if journal is not None and hasattr(ledger, "transition"):
        return journal.record_transition(ledger, root, step, to, reasons, source=source, expect=expect)
    if hasattr(ledger, "transition"):
        return ledger.transition(step, to, reasons, source=source, expect=expect)
    row = ledger.checkpoint(step)
    allowed = (expect,) if isinstance(expect, str) else tuple(expect)
    if row is None or row["state"] not in allowed:
        return False
    ledger.set_state(step, to, reasons, source=source)
    return True


def record_writing(ledger: Ledger, step: int, run_id: str, attempt: str, path: str) -> None:
    """The `writing` row before the data, with this process as its owner where the ledger records owners (so that
    `certify` and `gc` can tell a save in flight from a dead one, scout_ckpt.settle)."""
    try:
        from scout_ckpt.settle import this_process_owner
    except ImportError:  # a ledger without owners
        ledger.record_writing(step, run_id, attempt, path)
        return
    ledger.record_writing(step, run_id, attempt, path, owner=this_process_owner())


def journal_commit(root: Path, step: int, attempt: str, manifest_digest: str, state: str, reasons: list[dict],
                   source: str) -> None:
    """The verdict of a commit the ledger applied, in the journal (so `ledger rebuild` can vouch for it)."""
    journal = _journal()
    if journal is not None:
        journal.journal_verdict(root, step, attempt, manifest_digest, state, reasons, source)


def reject_bytes(ledger: Ledger, row: dict, ev: dict, source: str, root: Path | None = None) -> None:
    """A certified folder whose bytes no longer verify is rejected with the reasons, for good."""
    ledger.put_evidence(row["step"], {"bytes": ev}, source=source)
    transition(ledger, row["step"], "rejected", ev["reasons"], source=source, expect=("certified", "committed"),
               root=root)


# ---- resume ---------------------------------------------------------------------------------------------------

def latest_clean_row(root: str | os.PathLike, *, verify: bool = True) -> dict | None:
    """{"step", "path", "state", "verified", "skipped"} of the newest certified `checkpoint-N` whose bytes verify,
    walking back past (and rejecting in the ledger) any that fail; None when there is none or no ledger yet."""
    root = Path(root)
    if not (root / "scout-ledger.db").exists():
        return None
    skipped: list[dict] = []
    with Ledger.open(root, readonly=True) as ledger:
        below = None
        while True:
            row = ledger.latest("certified", below=below)
            if row is None:
                return None
            below = row["step"]
            if parse_folder(Path(row["path"]).name) is None:
                continue  # not a Trainer folder (a DCP step of another writer): not resumable by the Trainer
            if verify:
                ev = verify_recorded(root, ledger, row)
                if ev["status"] != policy.PASS:
                    with Ledger.open(root) as writer:
                        reject_bytes(writer, row, ev, source="resume", root=root)
                    skipped.append({"step": row["step"], "reasons": ev["reasons"]})
                    continue
            return {"step": row["step"], "path": str((root / row["path"]).resolve()), "state": row["state"],
                    "verified": verify, "skipped": skipped}


# ---- settling saves a crash interrupted ------------------------------------------------------------------------

def settle_writing(ledger: Ledger, root: Path, *, source: str = "settle", parse=parse_folder,
                   verify=None) -> list[dict]:
    """Coordinator, at start-up (no save of this run in flight): finish or reject every `writing` folder row.

    The manifest of the same attempt exists and the bytes verify: the save finished but its ledger write was
    lost: record it from the manifest. Otherwise the save was interrupted: reject it (`save_interrupted`) and
    remove the folder, which holds whatever part of the Trainer's write happened. `parse` picks the rows by
    directory name and `verify(step_dir, files)` checks the bytes (TorchTitan's DCP `step-N`: verify_files)."""
    verify = verify or verify_folder
    out = []
    for row in ledger.checkpoints(states=("writing",)):
        if parse(Path(row["path"]).name) is None:
            continue
        step_dir = Path(root) / row["path"]
        m = digest = None
        if step_dir.is_dir():
            try:
                m, digest = manifest_mod.read(step_dir)
            except BadInput:
                m = None
        if m is not None and m.get("attempt") == row["attempt"]:
            ev = dict(m["evidence"])
            ev["bytes"] = verify(step_dir, m["files"])
            v = policy.evaluate(m["policy"], ev)
            applied = ledger.record_commit(row["step"], run_id=m.get("run_id"), path=row["path"],
                                           nbytes=dir_bytes(step_dir), manifest_digest=digest, files=m["files"],
                                           evidence=ev, state=v.state, reasons=v.reasons, source=source,
                                           attempt=row["attempt"])
            if applied is not False:  # None: a ledger without compare-and-set (it always applies)
                journal_commit(root, row["step"], row["attempt"], digest, v.state, v.reasons, source)
            out.append({"step": row["step"], "state": v.state})
            continue
        reasons = [{"code": "save_interrupted", "attempt": row["attempt"], "removed": step_dir.is_dir()}]
        if transition(ledger, row["step"], "rejected", reasons, source=source, expect="writing", root=Path(root)):
            if step_dir.is_dir():
                remove_dir(step_dir)
            out.append({"step": row["step"], "state": "rejected"})
    return out


# ---- retention (the Trainer's save_total_limit, taken over) ---------------------------------------------------

def retention_plan(states: dict[int, str], limit: int, *, also_keep: set[int] = frozenset()) -> dict:
    """Pure: which folders to delete so that at most `limit` remain, never the newest certified one, nor one newer
    still awaiting evidence (committed/writing), nor a quarantined one, nor `also_keep` (the Trainer's best
    model). Rejected folders go first, then the oldest. {"delete": [...], "keep": {step: why}, "protected"}."""
    if limit < 1:
        raise BadInput(f"save_total_limit must be at least 1 (got {limit})")
    certified = [s for s, st in states.items() if st == "certified"]
    newest = max(certified) if certified else None
    why: dict[int, str] = {}
    for s, st in states.items():
        if s == newest:
            why[s] = "newest certified"
        elif st in ("committed", "writing") and (newest is None or s > newest):
            why[s] = "awaiting evidence"
        elif st == "quarantined":
            why[s] = "quarantined"
        elif s in also_keep:
            why[s] = "best model"
    candidates = sorted((s for s in states if s not in why), key=lambda s: (states[s] != "rejected", s))
    excess = max(0, len(states) - limit)
    delete = sorted(candidates[:excess])
    for s in states:
        if s not in delete and s not in why:
            why[s] = "within limit"
    return {"delete": delete, "keep": dict(sorted(why.items())), "protected": newest}


def apply_retention(ledger: Ledger, root: Path, limit: int, *, also_keep: set[int] = frozenset(),
                    dirs: dict[int, Path] | None = None) -> dict:
    """Carry out retention_plan over the folders on disk that the ledger knows (others are not ours). The row
    goes to `deleted` (compare-and-set on the state the plan saw) before the folder is removed. `dirs`: the
    directories to consider ({step: path}; default the Trainer folders under root)."""
    on_disk = list_folders(root) if dirs is None else dirs
    rows = {r["step"]: r for r in ledger.checkpoints() if r["step"] in on_disk and r["state"] != "deleted"}
    plan = retention_plan({s: r["state"] for s, r in rows.items()}, limit, also_keep=also_keep)
    deleted = []
    for step in plan["delete"]:
        if not transition(ledger, step, "deleted", [{"code": "retention", "save_total_limit": limit}],
                          source="gc", expect=rows[step]["state"], root=Path(root)):
            continue
        try:
            remove_dir(on_disk[step])
        except FileNotFoundError:
            pass
        deleted.append(step)
    return {**plan, "delete": deleted}
