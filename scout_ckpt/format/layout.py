"""On-disk names under a run's ROOT and the atomic-write helpers every writer uses.

ROOT/
  step-00000120/            a committed checkpoint (DCP files + scout-manifest.json)
  .step-00000130.tmp-<id>/  a save in flight; never read. Holds scout-owner.json (who writes it) until just
                            before the rename; removed at a later start only when that owner is provably dead
  scout-ledger.db           the ledger (WAL)
  .leases/<attempt>.lock    the lease of a save in flight: its coordinator holds an flock on it from before the
                            `writing` row until the commit is recorded (ops/settle.py: namespace-proof liveness)
  .leases/run.owner         the run lease: the coordinator of the job saving here holds an flock on it for the
                            life of its ledger; another job's saves are refused (ops/startup.py, RootInUse)
  .leases/adopt.lock        held by the one `scout-ckpt adopt` running on this ROOT
  reports/                  observer and campaign reports

On an object store (scout_ckpt.object_store) there is no rename: every save attempt writes under its own prefix
URI/step-00000120.attempt-<id>/ and is published by writing its scout-manifest.json last; the ledger (and the
journal, reports) then live in a local `ledger_dir`, which names the URI in scout-storage.json.

Commit protocol for anything we write: write to a temp name in the same directory, fsync the file,
rename over the final name, fsync the directory. A SIGKILL at any line leaves the old or the new state.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

STEP_DIGITS = 8
STEP_RE = re.compile(r"^step-(\d+)$")
TMP_RE = re.compile(r"^\.step-(\d+)\.tmp-([0-9a-zA-Z_-]+)$")
TRASH_RE = re.compile(r"^\.trash-")
ATTEMPT_RE = re.compile(r"^step-(\d+)\.attempt-([0-9a-zA-Z_-]+)$")
LEDGER_NAME = "scout-ledger.db"
MANIFEST_NAME = "scout-manifest.json"
REPORTS_DIR = "reports"
DCP_METADATA = ".metadata"
OWNER_NAME = "scout-owner.json"
LEASES_DIR = ".leases"
ATTEMPT_ID_RE = re.compile(r"^[0-9a-zA-Z_-]+$")


def step_dirname(step: int) -> str:
    return f"step-{step:0{STEP_DIGITS}d}"


def step_path(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / step_dirname(step)


def lease_path(root: str | os.PathLike, attempt: str | None) -> Path | None:
    """ROOT/.leases/<attempt>.lock, the lease file of a save attempt; None for an attempt id that is not a plain
    name (a hand-made or hostile row: no lease to look at)."""
    if not isinstance(attempt, str) or not ATTEMPT_ID_RE.match(attempt):
        return None
    return Path(root) / LEASES_DIR / f"{attempt}.lock"


def tmp_dirname(step: int, attempt: str) -> str:
    return f".step-{step:0{STEP_DIGITS}d}.tmp-{attempt}"


def attempt_dirname(step: int, attempt: str) -> str:
    """The prefix of one save attempt on an object store: never reused, so nothing there is ever overwritten."""
    return f"step-{step:0{STEP_DIGITS}d}.attempt-{attempt}"


def parse_attempt_dir(name: str) -> tuple[int, str] | None:
    m = ATTEMPT_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def parse_step_dir(name: str) -> int | None:
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


# ---- folder layouts registered by integrations ---------------------------------------------------------------
# A framework that writes its checkpoints in place as plain files (the Hugging Face Trainer's `checkpoint-N`) has
# no DCP `.metadata`. Its integration registers the folder names here (layout name -> parse(name) -> step | None),
# so that this module, which everything stands on, never imports an integration. The CLI imports the torch-free
# registrations, so `ls`/`resume`/`certify` read such a ROOT; a library caller that reads one imports the
# integration's folders module first (the integration itself always does).
# A layout whose folders are DCP under another name (Megatron-Core's torch_dist `iter_NNNNNNN`) registers with
# dcp=True: listed like the others, but read as DCP (`.metadata` required, tensors read from the DCP entries).
_FOLDER_LAYOUTS: dict[str, Callable[[str], int | None]] = {}
_DCP_LAYOUTS: set[str] = set()


def register_folder_layout(name: str, parse: Callable[[str], int | None], *, dcp: bool = False) -> None:
    """Declare a framework folder layout: `parse` maps a directory name to its step, or None when not of it;
    `dcp`: its folders are DCP checkpoints (a `.metadata` and `__R_I.distcp` files), not plain files."""
    _FOLDER_LAYOUTS[name] = parse
    if dcp:
        _DCP_LAYOUTS.add(name)
    else:
        _DCP_LAYOUTS.discard(name)


def parse_folder_dir(name: str) -> int | None:
    """The step of a directory named by a registered folder layout; None for every other name."""
    for parse in _FOLDER_LAYOUTS.values():
        step = parse(name)
        if step is not None:
            return step
    return None


def is_folder_dir(path: str | os.PathLike) -> bool:
    """A registered framework folder of plain files (e.g. the Trainer's `checkpoint-N`), which has no DCP
    `.metadata`; every other checkpoint directory is DCP (fail closed: an unknown name must have one), a folder
    of a layout registered with dcp=True included."""
    name = Path(path).name
    return any(parse(name) is not None for n, parse in _FOLDER_LAYOUTS.items() if n not in _DCP_LAYOUTS)


def list_checkpoint_dirs(root: str | os.PathLike) -> dict[int, Path]:
    """Every checkpoint directory under root: DCP `step-N` and registered framework folders (DCP wins a tie)."""
    folders = scan_dirs(root, parse_folder_dir) if _FOLDER_LAYOUTS else {}
    return dict(sorted({**folders, **list_step_dirs(root)}.items()))


def scan_dirs(root: str | os.PathLike, parse) -> dict[int, Path]:
    """Every directory under root (symlinks not followed) whose name `parse` maps to a step, by step."""
    out: dict[int, Path] = {}
    root = Path(root)
    with os.scandir(root) as it:
        for entry in it:
            step = parse(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                out[step] = root / entry.name
    return dict(sorted(out.items()))


def list_step_dirs(root: str | os.PathLike) -> dict[int, Path]:
    """Every `step-N` directory under root (any zero padding, TorchTitan's `step-N` included)."""
    return scan_dirs(root, parse_step_dir)


def list_tmp_dirs(root: str | os.PathLike) -> list[Path]:
    root = Path(root)
    return sorted(root / e.name for e in os.scandir(root) if TMP_RE.match(e.name) or TRASH_RE.match(e.name))


def create_tmp_dir(tmp: Path, owner: dict) -> None:
    """The coordinator creates the temp dir of a save and its owner record before any rank writes data, so a
    directory with data always says whose it is (a crash between mkdir and the record leaves an empty directory
    whose owner is unknown: it is left alone and listed by `gc --dry-run`)."""
    tmp.mkdir()
    atomic_write_json(tmp / OWNER_NAME, owner)


def read_owner(tmp: Path) -> dict | None:
    """The owner record of a temp dir; None when absent or unreadable (owner unknown)."""
    try:
        owner = json.loads((Path(tmp) / OWNER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def drop_owner(tmp: Path) -> None:
    """Remove the owner record just before the rename: a published step-* holds only what the manifest lists."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(Path(tmp) / OWNER_NAME)


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, sync_dir: bool = True) -> None:
    """temp + fsync + rename + fsync(dir): readers see the old file or the new one, never a torn one.
    `sync_dir=False` leaves the directory's fsync to the caller, who takes one next anyway (`commit_dir`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def commit_dir(tmp: Path, final: Path) -> None:
    """Atomically publish a fully written temp dir as `final`. An existing `final` (a rejected earlier
    attempt at the same step) is first renamed to a trash name, so `final` is never half-replaced."""
    fsync_dir(tmp)
    if final.exists():
        trash = final.with_name(f".trash-{final.name}-{os.getpid()}")
        os.rename(final, trash)
        fsync_dir(final.parent)
        os.rename(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
        fsync_dir(final.parent)


def remove_dir(path: Path) -> None:
    """Delete a checkpoint directory so that a crash mid-delete never leaves a torn `step-*`:
    rename it out of the `step-*` namespace first, then remove it. FileNotFoundError if it is already gone
    (e.g. a concurrent `gc` took it first)."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass
    return total
