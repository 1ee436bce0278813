"""Framework pointers follow the verdicts: after a command that changes one (`certify`, `resume`, `quarantine`,
`release`, `gc`, `ledger rebuild`), each pointer a framework reads on its own names the newest certified step, or
is moved aside when there is none. Torch-free: the CLI calls `refresh(ROOT)` once the command's verdicts are
durable in the ledger.

  DeepSpeed    `save_dir/latest` (read by `engine.load_checkpoint(save_dir)` and `zero_to_fp32.py`): the newest
               certified `global_stepN`, or moved to `latest.scout-uncertified` (ds_folders)
  Megatron     `save_dir/latest_checkpointed_iteration.txt` (read by Megatron-LM's `--load`): the newest
               certified `iter_NNNNNNN`, or moved to `....scout-uncertified` (mg_folders); a tracker holding
               `release` is left alone (a release checkpoint is not one of the run's iterations)

The same rule as the integrations apply when a job starts (`install`, `MegatronCheckpointer`), with the ledger's
verdicts as they stand: the command that changed them has just re-verified what it judged, and the job re-hashes
the step it loads. The Lightning strategy's pointer files (`last.ckpt`, ModelCheckpoint's names) and the Trainer's
`checkpoint-N` folders are not pointers of this kind: loading through them goes through the walk-back
(`ckpt_path="latest_clean"`, `latest_clean(output_dir)`), which never hands out an uncertified step."""

from __future__ import annotations

import os
from pathlib import Path

from scout_ckpt.format.layout import LEDGER_NAME, scan_dirs
from scout_ckpt.integrations import ds_folders, mg_folders


def refresh(root: str | os.PathLike) -> list[str]:
    """Point every framework pointer under ROOT at its newest certified step (or move it aside when there is
    none); returns one line per pointer that changed. A local ROOT with a ledger only; nothing else is touched."""
    root = Path(root)
    if not (root / LEDGER_NAME).is_file():
        return []
    out = []
    if (root / ds_folders.LATEST).is_file() or scan_dirs(root, ds_folders.parse_folder):
        out += _repoint(root, ds_folders.LATEST, ds_folders.read_latest(root), ds_folders.latest_clean_tag,
                        lambda tag: ds_folders.point_latest(root, tag), lambda: ds_folders.hide_latest(root),
                        ds_folders.HIDDEN_LATEST)
    if (root / mg_folders.TRACKER).is_file() or scan_dirs(root, mg_folders.parse_folder):
        if mg_folders.read_tracker(root) != "release":
            out += _repoint(root, mg_folders.TRACKER, mg_folders.read_tracker(root),
                            lambda r, verify: _str(mg_folders.latest_clean_iteration(r, verify=verify)),
                            lambda it: mg_folders.point_tracker(root, int(it)), lambda: mg_folders.hide_tracker(root),
                            mg_folders.HIDDEN_TRACKER)
    return out


def _str(x) -> str | None:
    return None if x is None else str(x)


def _repoint(root: Path, name: str, current: str | None, newest, point, hide, hidden_name: str) -> list[str]:
    """`name` := newest(root) (the ledger's newest certified, not re-hashed here), or hidden when there is none."""
    want = newest(root, verify=False)
    if want is not None:
        if current == want:
            return []
        point(want)
        return [f"{root / name} now names {want}, the newest certified checkpoint (it named {current or 'nothing'})"]
    held = hide()
    if held is None:
        return []
    return [f"{root / name} (which named {held}) moved to {hidden_name}: no certified checkpoint under {root}"]


def refresh_quietly(root: str | os.PathLike, say) -> None:
    """`refresh`, each change said through `say` (the CLI: one stderr line each); an error here is said, never
    raised: the command's own outcome and exit code stand."""
    try:
        for line in refresh(root):
            say(f"scout-ckpt: {line}")
    except Exception as e:  # noqa: BLE001 - the verdicts are recorded; the pointer is the next job start's to fix
        say(f"scout-ckpt: warning: could not update the framework pointers under {root}: {type(e).__name__}: {e}")
