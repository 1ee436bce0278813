"""DeepSpeed's checkpoint folders in a scout-ckpt ledger: `save_dir/global_stepN/` (DeepSpeed's default tag) and the
`save_dir/latest` pointer. Torch-free: the CLI imports it so that `scout-ckpt ls/explain/resume/certify SAVE_DIR`
read a DeepSpeed run, and `latest_clean` runs here.

DeepSpeed writes a tag folder in place (no temp dir + rename), like the Hugging Face Trainer, so the core reads it
as a registered folder layout (`layout.register_folder_layout`: no DCP `.metadata`); settling, resume and walk-back
are the core's (integrations/folders.py). What is DeepSpeed's own is `latest`: a file that holds the tag, no
newline, read by `engine.load_checkpoint(save_dir)` when no tag is given. Here it only ever names a certified tag:
`point_latest` replaces it atomically (temp + fsync + rename), and `hide_latest` moves a `latest` that names no
certified tag aside (to `latest.scout-uncertified`, so nothing is lost) instead of letting DeepSpeed load it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from scout_ckpt.format.framework_folders import DEEPSPEED, register_framework_layouts
from scout_ckpt.format.layout import atomic_write_bytes, fsync_dir

log = logging.getLogger("scout_ckpt.deepspeed")

LAYOUT = DEEPSPEED.name
LATEST = "latest"
HIDDEN_LATEST = "latest.scout-uncertified"
FOLDER_RE = DEEPSPEED.pattern


def folder_name(step: int) -> str:
    """DeepSpeed's default tag (`engine.save_checkpoint(dir)` without `tag=`): f"global_step{engine.global_steps}"."""
    return f"global_step{step}"


parse_folder = DEEPSPEED.parse


register_framework_layouts()  # this integration reads and writes the layout: said here, explicitly


def read_latest(save_dir: str | os.PathLike) -> str | None:
    """The tag `latest` names, or None when there is no readable `latest`."""
    try:
        return (Path(save_dir) / LATEST).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def point_latest(save_dir: str | os.PathLike, tag: str) -> None:
    """`latest` := tag, atomically (a crash leaves the old pointer or the new one, never a torn file); no newline,
    as DeepSpeed writes it."""
    atomic_write_bytes(Path(save_dir) / LATEST, tag.encode())


def hide_latest(save_dir: str | os.PathLike) -> str | None:
    """Move `latest` aside to `latest.scout-uncertified` (kept, not deleted); returns the tag it named, or None."""
    path = Path(save_dir) / LATEST
    if not path.is_file():
        return None
    tag = read_latest(save_dir)
    os.replace(path, Path(save_dir) / HIDDEN_LATEST)
    fsync_dir(save_dir)
    return tag


def latest_clean_tag(save_dir: str | os.PathLike, *, verify: bool = True) -> str | None:
    """The tag (folder name) of the newest certified checkpoint under save_dir whose bytes still verify (core
    `recovery.latest_clean`: re-hashed, walking back past and rejecting any that fail), or None (none, or a fresh
    run without a ledger)."""
    from scout_ckpt.integrations.folders import latest_clean_row

    found = latest_clean_row(save_dir, verify=verify)
    return Path(found["path"]).name if found else None


def repoint_latest(save_dir: str | os.PathLike, *, verify: bool = True) -> str | None:
    """Coordinator, at start-up: `latest` := the newest certified tag that verifies; with none, a `latest` naming
    anything else is moved aside (hide_latest), so that `engine.load_checkpoint(save_dir)` starts fresh rather
    than load uncertified state. Returns the tag `latest` now names, or None."""
    tag = latest_clean_tag(save_dir, verify=verify)
    current = read_latest(save_dir)
    if tag is not None:
        if current != tag:
            point_latest(save_dir, tag)
            log.warning(
                "scout-ckpt: %s/latest now names %s, the newest certified checkpoint (it named %s)",
                save_dir,
                tag,
                current,
            )
        return tag
    hidden = hide_latest(save_dir)
    if hidden is not None:
        log.warning(
            "scout-ckpt: no certified checkpoint under %s: `latest` (which named %s) moved to %s; "
            "load_checkpoint starts fresh",
            save_dir,
            hidden,
            HIDDEN_LATEST,
        )
    return None
