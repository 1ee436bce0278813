"""Framework pointers follow the verdicts: after a command that changes one (`certify`, `resume`, `quarantine`,
`release`, `gc`, `ledger rebuild`), no pointer a framework reads on its own names a step that is not certified: one
that does is pointed at the newest certified step, or moved aside when there is none. Torch-free: the CLI calls
`refresh(ROOT)` once the command's verdicts are recorded in the ledger.

  DeepSpeed    `save_dir/latest` (read by `engine.load_checkpoint(save_dir)` and `zero_to_fp32.py`): a certified
               `global_stepN`, or moved to `latest.scout-uncertified` (ds_folders)
  Megatron     `save_dir/latest_checkpointed_iteration.txt` (read by Megatron-LM's `--load`): a certified
               `iter_NNNNNNN`, or moved to `....scout-uncertified` (mg_folders); a tracker holding `release` is left
               alone (a release checkpoint is not one of the run's iterations)

  HF Trainer   the folder names themselves: `resume_from_checkpoint=True` loads transformers'
               `get_last_checkpoint(output_dir)`, the `checkpoint-N` directory of highest N, with no other check. While
               that folder's step is rejected or quarantined, it is renamed `checkpoint-N.scout-STATE-ATTEMPT` (a
               name neither `get_last_checkpoint` nor the Trainer's rotation, `checkpoint-*` + a number, reads as
               the step's) and its ledger row's path follows it (`Ledger.move_path`, in the history as "moved"):
               nothing is deleted, `explain`, `gc` and `certify` find it there. Only the newest folders are moved,
               as far down as the first one the Trainer may load; a step released later keeps the new name
               (`latest_clean(output_dir)` returns it).

A pointer that names a certified step stays (the job's next start advances it to the newest, as `install` and
`MegatronCheckpointer` do), and none is created where the run keeps none. The ledger's verdicts are taken as they
stand: the command that changed them has just re-verified what it judged, and the job re-hashes the step it loads.
The Lightning strategy's pointer files (`last.ckpt`, ModelCheckpoint's names) are not pointers of this kind:
loading through them goes through the walk-back (`ckpt_path="latest_clean"`), which never hands out an uncertified
step.

A crash between a folder's rename and its row's update leaves the row naming the old path, which no longer exists;
the next refresh finds the folder by its attempt and completes the update (a rejected or quarantined row is never
loaded, so nothing reads the stale path meanwhile)."""

from __future__ import annotations

import os
from pathlib import Path

from scout_ckpt.format.layout import LEDGER_NAME
from scout_ckpt.integrations import ds_folders, folders, mg_folders


def refresh(root: str | os.PathLike) -> list[str]:
    """Every framework pointer under ROOT that names a step which is not certified (now rejected, quarantined,
    deleted, never certified) is pointed at the newest certified step, or moved aside when there is none; one moved
    aside earlier comes back when a step is certified again. A pointer that names a certified step is left as it is
    (the job's next start advances it to the newest), and none is created where the run keeps none. Returns one line
    per pointer changed. A local ROOT with a ledger only."""
    root = Path(root)
    if not (root / LEDGER_NAME).is_file():
        return []
    out = []
    if (root / ds_folders.LATEST).is_file() or (root / ds_folders.HIDDEN_LATEST).is_file():
        out += _repoint(
            root,
            ds_folders.LATEST,
            ds_folders.HIDDEN_LATEST,
            ds_folders.read_latest(root),
            ds_folders.parse_folder,
            ds_folders.latest_clean_tag,
            lambda tag: ds_folders.point_latest(root, tag),
            lambda: ds_folders.hide_latest(root),
        )
    if (root / mg_folders.TRACKER).is_file() or (root / mg_folders.HIDDEN_TRACKER).is_file():
        held = mg_folders.read_tracker(root)
        if held != "release":  # a release checkpoint is not one of the run's iterations
            out += _repoint(
                root,
                mg_folders.TRACKER,
                mg_folders.HIDDEN_TRACKER,
                held,
                _iteration,
                lambda r, verify: _str(mg_folders.latest_clean_iteration(r, verify=verify)),
                lambda it: mg_folders.point_tracker(root, int(it)),
                lambda: mg_folders.hide_tracker(root),
            )
    out += _set_aside_hf(root)
    return out


SET_ASIDE = ("rejected", "quarantined")  # verdicts a framework's own resume must never load


def _set_aside_hf(root: Path) -> list[str]:
    """The Trainer's newest `checkpoint-N` folders, while their steps are rejected or quarantined, renamed aside
    with their ledger rows following (see the module docstring)."""
    from scout_ckpt.ledger import Ledger

    found = folders.list_folders(root)
    if not found and not any(root.glob(f"{folders.PREFIX}-*.scout-*")):
        return []
    out = []
    with Ledger.open(root) as ledger:
        rows = {r["step"]: r for r in ledger.checkpoints()}
        for step, row in rows.items():  # a move a crash interrupted: the folder renamed, the row not yet
            name = row.get("path") or ""
            if row["state"] in SET_ASIDE and row.get("attempt") and not (root / name).exists():
                moved = sorted(root.glob(f"{name}.scout-*-{row['attempt']}"))
                if len(moved) == 1 and ledger.move_path(step, name, moved[0].name, source="pointers"):
                    out.append(f"{root / moved[0].name} is step {step}'s folder (a move completed)")
        for step in sorted(found, reverse=True):
            held, folder = rows.get(step), found[step]
            if held is None or held["state"] not in SET_ASIDE or held.get("path") != folder.name:
                break  # the Trainer may load this one: certified, awaiting evidence, in flight or not scout's
            new = f"{folder.name}.scout-{held['state']}-{held.get('attempt') or 'none'}"
            if (root / new).exists():
                break  # never over another folder
            os.rename(folder, root / new)
            ledger.move_path(step, folder.name, new, source="pointers")
            out.append(
                f"{folder} ({held['state']}) moved to {new}: the Trainer's resume_from_checkpoint=True passes it over"
            )
    return out


def _iteration(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def _str(x) -> str | None:
    return None if x is None else str(x)


def _certified(root: Path) -> set[int]:
    from scout_ckpt.ledger import Ledger

    with Ledger.open(root, readonly=True) as ledger:
        return {r["step"] for r in ledger.checkpoints(states=("certified",))}


def _repoint(root: Path, name: str, hidden_name: str, current: str | None, step_of, newest, point, hide) -> list[str]:
    """`name` := newest(root) (the ledger's newest certified, not re-hashed here) unless it names a certified step;
    hidden when there is none."""
    if current is not None and step_of(current) in _certified(root):
        return []
    want = newest(root, verify=False)
    if want is not None:
        point(want)
        return [f"{root / name} now names {want}, the newest certified checkpoint (it named {current or 'nothing'})"]
    held = hide() if current is not None else None
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
