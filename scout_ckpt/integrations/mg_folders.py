"""Megatron's checkpoint folders in a scout-ckpt ledger: `save_dir/iter_NNNNNNN/` (Megatron-LM's
`get_checkpoint_name`: seven digits) and the `save_dir/latest_checkpointed_iteration.txt` tracker. Torch-free:
the CLI imports it so that `scout-ckpt ls/explain/resume/certify SAVE_DIR` read a Megatron run, and
`latest_clean` runs here.

An `iter_NNNNNNN` folder written by `dist_checkpointing.save` (torch_dist) holds `.metadata`, `__R_I.distcp`,
`common.pt` and `metadata.json`, written in place (no temp dir + rename), so the core reads it as a registered
folder layout whose folders are DCP (`layout.register_folder_layout(..., dcp=True)`); settling, resume and
walk-back are the core's (integrations/folders.py). The tracker is Megatron-LM's own (written by its training
loop, not by megatron-core): the iteration as text, or `release`. Here it only ever names a certified
iteration: `point_tracker` replaces it atomically, and `hide_tracker` moves one that names no certified iteration
aside (to `latest_checkpointed_iteration.txt.scout-uncertified`, kept) instead of letting Megatron-LM load it.

`scout-ckpt adopt SAVE_DIR` takes in `iter_NNNNNNN` folders written without scout-ckpt (registered here with
ops/adopt_layouts.py): a DCP folder whose `common.pt` and `metadata.json` (torch_dist) Megatron's own load needs,
and whose `integrity.json` (Megatron-Core r0.18+, `save(..., verify_integrity=True)`), when usable, gives the
`integrity` evidence: every file's SHA-256 checked against it (ops/adopt_integrity.py). adopt leaves
the tracker alone; the MegatronCheckpointer points it at a certified iteration when the job starts.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from scout_ckpt.format.framework_folders import MEGATRON, register_framework_layouts
from scout_ckpt.format.layout import atomic_write_bytes, fsync_dir
from scout_ckpt.format.safepaths import clip, read_bounded
from scout_ckpt.ops.adopt_layouts import AdoptLayout
from scout_ckpt.ops.adopt_layouts import register as register_adoptable

log = logging.getLogger("scout_ckpt.megatron")

LAYOUT = MEGATRON.name
TRACKER = "latest_checkpointed_iteration.txt"
HIDDEN_TRACKER = TRACKER + ".scout-uncertified"
FOLDER_RE = MEGATRON.pattern
COMMON = "common.pt"  # the common (non-sharded) state, torch.save by rank 0
CONFIG = "metadata.json"  # {"sharded_backend": "torch_dist", ...}: what Megatron's load reads first
INTEGRITY = "integrity.json"  # Megatron-Core r0.18+: {"algorithm": "sha256", "files": {name: hex}}


def folder_name(iteration: int) -> str:
    """Megatron-LM's folder name (`checkpointing.get_checkpoint_name`): iter_{:07d}."""
    return f"iter_{iteration:07d}"


parse_folder = MEGATRON.parse


def config_problems(step_dir: Path) -> list[dict]:
    """Structure reasons from metadata.json: it must say torch_dist, the one format scout-ckpt reads."""
    try:
        config = json.loads(read_bounded(Path(step_dir) / CONFIG, 1 << 20, CONFIG))
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return [{"code": "bad_metadata", "file": CONFIG, "detail": clip(str(e), 160)}]
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if backend != "torch_dist":
        return [
            {
                "code": "unsupported_format",
                "file": CONFIG,
                "detail": f"sharded_backend {clip(backend, 40)}; scout-ckpt reads torch_dist",
            }
        ]
    return []


register_framework_layouts()  # this integration reads and writes the layout: said here, explicitly
register_adoptable(
    AdoptLayout(
        LAYOUT,
        "Megatron iter_NNNNNNN",
        parse_folder,
        required=(COMMON, CONFIG),
        check=config_problems,
        integrity=INTEGRITY,
        extra=lambda iteration: {"iteration": iteration},
    )
)


def read_tracker(save_dir: str | os.PathLike) -> str | None:
    """What the tracker holds (an iteration as text, or `release`), or None when there is no readable tracker."""
    try:
        return (Path(save_dir) / TRACKER).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def point_tracker(save_dir: str | os.PathLike, iteration: int) -> None:
    """tracker := str(iteration), atomically (a crash leaves the old one or the new one, never a torn file)."""
    atomic_write_bytes(Path(save_dir) / TRACKER, str(int(iteration)).encode())


def hide_tracker(save_dir: str | os.PathLike) -> str | None:
    """Move the tracker aside (kept, not deleted); returns what it held, or None when there was none."""
    path = Path(save_dir) / TRACKER
    if not path.is_file():
        return None
    held = read_tracker(save_dir)
    os.replace(path, Path(save_dir) / HIDDEN_TRACKER)
    fsync_dir(save_dir)
    return held


def latest_clean_iteration(save_dir: str | os.PathLike, *, verify: bool = True) -> int | None:
    """The iteration of the newest certified `iter_NNNNNNN` under save_dir whose bytes still verify (core
    `recovery.latest_clean`: re-hashed, walking back past and rejecting any that fail), or None."""
    from scout_ckpt.integrations.folders import latest_clean_row

    found = latest_clean_row(save_dir, verify=verify)
    if not found:
        return None
    return parse_folder(Path(found["path"]).name)


def repoint_tracker(save_dir: str | os.PathLike, *, verify: bool = True) -> int | None:
    """The tracker := the newest certified iteration that verifies; with none, a tracker naming anything else is
    moved aside (hide_tracker), so that Megatron-LM's `--load` starts fresh rather than load uncertified state.
    Returns the iteration the tracker now names, or None."""
    it = latest_clean_iteration(save_dir, verify=verify)
    current = read_tracker(save_dir)
    if it is not None:
        if current != str(it):
            point_tracker(save_dir, it)
            log.warning(
                "scout-ckpt: %s/%s now names %d, the newest certified iteration (it named %s)",
                save_dir,
                TRACKER,
                it,
                current,
            )
        return it
    hidden = hide_tracker(save_dir)
    if hidden is not None:
        log.warning(
            "scout-ckpt: no certified checkpoint under %s: %s (which named %s) moved to %s",
            save_dir,
            TRACKER,
            hidden,
            HIDDEN_TRACKER,
        )
    return None
