"""What the checkpoints say of themselves, for `ls` and `resume` when the ledger cannot be read.

On a shared filesystem the ledger can be locked by a writer on another host (or by a dead client whose lock lease
has not expired), or damaged; restart tooling must not block on it. Everything a reader needs is also on disk:
each published `step-N/` carries its scout-manifest.json (files, sizes, digests, the save's evidence), and
ROOT/scout-journal.jsonl holds every verdict the ledger applied after the save (certify, replay confirmation, a
failed re-verification, a load mismatch) and every operator quarantine, each keyed by the manifest's digest.

The state of a step here is the last journal verdict for that very manifest digest (a manifest edited since has
another digest and no verdict), then a quarantine on record for the step, which overrides it; a journal whose
hash chain is broken (ledger/journal.py) certifies nothing. A step with no
verdict on record is `committed` (reason `no_verdict_on_record`): never more trusted than the record shows.
Temp dirs are never listed (a save in flight or a dead one), and a directory without a readable manifest is
`rejected` (`bad_manifest`). Nothing is written here: a fallback reader has no lock to take.
"""

from __future__ import annotations

from pathlib import Path

from scout_ckpt import policy
from scout_ckpt.errors import BadInput, NoCleanCheckpoint
from scout_ckpt.format import manifest as manifest_mod
from scout_ckpt.format.layout import dir_bytes, list_checkpoint_dirs
from scout_ckpt.format.verify import verify_files
from scout_ckpt.ledger import journal
from scout_ckpt.ledger.transitions import STATES

SOURCE = "manifests"
NO_VERDICT = "no_verdict_on_record"


BROKEN = "journal_chain_broken"


def journal_state(
    records: list[dict], step: int, digest: str, intact: bool = True
) -> tuple[str | None, list[dict], dict | None]:
    """(state, reasons, quarantine record) the journal gives a step with this manifest digest (journal.standing:
    the last verdict for that digest, a rejection outliving any certification; the last quarantine not released).
    A journal whose chain is broken (`intact` False, journal.verify) certifies nothing: `committed`, reason
    `journal_chain_broken`."""
    s = journal.standing(records, step, digest)
    if not intact and s["state"] == "certified":
        return "committed", [{"code": BROKEN}], s["quarantine"]
    return s["state"], s["reasons"], s["quarantine"]


def _row(root: Path, step: int, step_dir: Path, records: list[dict], *, sizes: bool, intact: bool = True) -> dict:
    base = {
        "step": step,
        "path": step_dir.name,
        "bytes": dir_bytes(step_dir) if sizes else None,
        "run_id": None,
        "committed": None,
        "checked": {},
        "source": SOURCE,
        "manifest": None,
    }
    try:
        m, digest = manifest_mod.read(step_dir)
    except BadInput as e:
        return {**base, "state": "rejected", "evidence": {}, "reasons": [{"code": "bad_manifest", "detail": str(e)}]}
    state, reasons, quarantine = journal_state(records, step, digest, intact)
    if state is None or state not in STATES:
        state, reasons = "committed", [{"code": NO_VERDICT}]
    if quarantine is not None:
        state, reasons = "quarantined", [{"code": "quarantined", "detail": quarantine.get("reason")}]
    ev = m.get("evidence")
    if not isinstance(ev, dict):
        ev = {}
    return {
        **base,
        "state": state,
        "reasons": reasons,
        "run_id": m.get("run_id"),
        "committed": m.get("created"),
        "evidence": {k: v.get("status") for k, v in ev.items() if isinstance(v, dict)},
        "manifest": {"digest": digest, "files": m["files"]},
    }


def checkpoint_rows(root: str | Path, *, sizes: bool = True) -> list[dict]:
    """`ls --json` rows built from the manifests and the journal, oldest first; each has "source": "manifests"."""
    root = Path(root)
    if not root.is_dir():
        raise BadInput(f"{root}: {'not a directory' if root.exists() else 'no such directory'}")
    records = journal.read(root)
    intact = journal.verify(records)["intact"]
    rows = [_row(root, step, d, records, sizes=sizes, intact=intact) for step, d in list_checkpoint_dirs(root).items()]
    for r in rows:
        r.pop("manifest")
    return rows


def latest_clean(root: str | Path, *, verify: bool = True) -> dict:
    """The newest step the record calls certified whose bytes match its manifest (verify=False: not re-hashed):
    {"step", "path", "state", "verified", "skipped", "newer", "source"}. A failed verification is reported in
    "skipped", not recorded (no ledger to record it in). NoCleanCheckpoint (exit 1) when there is none."""
    root = Path(root)
    if not root.is_dir():
        raise BadInput(f"{root}: {'not a directory' if root.exists() else 'no such directory'}")
    records = journal.read(root)
    intact = journal.verify(records)["intact"]
    dirs = list_checkpoint_dirs(root)
    skipped: list[dict] = []
    newer: list[dict] = []
    for step in sorted(dirs, reverse=True):
        row = _row(root, step, dirs[step], records, sizes=False, intact=intact)
        if row["state"] != "certified":
            newer.append({"step": step, "state": row["state"], "reasons": row["reasons"]})
            continue
        if verify:
            ev = verify_files(dirs[step], row["manifest"]["files"])
            if ev["status"] != policy.PASS:
                skipped.append({"step": step, "reasons": ev["reasons"]})
                continue
        return {
            "step": step,
            "path": str(dirs[step].resolve()),
            "state": "certified",
            "verified": verify,
            "skipped": skipped,
            "newer": newer,
            "source": SOURCE,
        }
    raise NoCleanCheckpoint(
        [{"code": "no_certified_checkpoint", "source": SOURCE}]
        if not skipped
        else [{"code": "all_certified_failed_verification", "skipped": skipped, "source": SOURCE}]
    )
