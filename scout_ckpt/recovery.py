"""Latest-clean selection: walk back from the newest certified checkpoint, re-verify, explain.

No torch here: restart scripts call this through `scout-ckpt resume`, and `import torch` alone costs 1.4 s.
"""

from __future__ import annotations

from pathlib import Path

from scout_ckpt import journal
from scout_ckpt import manifest as manifest_mod
from scout_ckpt import policy
from scout_ckpt.errors import BadInput, NotFound
from scout_ckpt.ledger import Ledger
from scout_ckpt.verify import verify_files


class NoCleanCheckpoint(NotFound):
    def __init__(self, reasons: list[dict]):
        super().__init__("no certified checkpoint to resume from" + (
            f" ({len(reasons[0].get('skipped', []))} failed re-verification)" if reasons and reasons[0].get("skipped")
            else ""))
        self.reasons = reasons


def trusted_manifest(step_dir: Path, row: dict) -> tuple[dict | None, list[dict]]:
    """(manifest, reasons): the step's manifest if it reads and matches the digest the ledger recorded, else the
    reasons not to trust it (manifest_mismatch, bad_manifest)."""
    try:
        m, digest = manifest_mod.read(step_dir)
    except BadInput as e:
        return None, [{"code": "bad_manifest", "detail": str(e)}]
    if row.get("manifest_digest") and digest != row["manifest_digest"]:
        return m, [{"code": "manifest_mismatch"}]
    return m, []


def verify_checkpoint(root: Path, ledger: Ledger, step: int, progress=None) -> dict:
    """Bytes evidence for a recorded checkpoint: files against the ledger, manifest against its digest."""
    row = ledger.checkpoint(step)
    step_dir = Path(root) / row["path"]
    ev = verify_files(step_dir, ledger.files(step), progress=progress)
    if step_dir.is_dir():
        _, bad = trusted_manifest(step_dir, row)
        if bad:
            ev = policy.evidence(policy.FAIL, ev["reasons"] + bad,
                                 **{k: v for k, v in ev.items() if k not in ("status", "reasons")})
    return ev


def record_verification_failure(ledger: Ledger, step: int, ev: dict, source: str, *,
                                root: str | Path | None = None) -> list[dict]:
    """A checkpoint whose re-verification failed (files missing or changed, manifest mismatched or unreadable) is
    rejected with the reasons, for good: compare-and-set from the certified or committed attempt that was
    checked, so a quarantine or a new save in between is not overwritten. The verdict is journaled under ROOT
    (default: the ledger's directory). Returns the reasons."""
    row = ledger.checkpoint(step)
    if row is None:
        return ev["reasons"]
    with ledger.write():
        if ledger.checkpoint(step)["attempt"] == row["attempt"]:
            ledger.put_evidence(step, {"bytes": ev}, source=source)
        journal.record_transition(ledger, root or ledger.path.parent, step, "rejected", ev["reasons"],
                                  source=source, expect=("certified", "committed"), attempt=row["attempt"])
    return ev["reasons"]


# Deprecated name (it records manifest mismatches too): kept until the checkpointer calls the new one.
record_bytes_failure = record_verification_failure


def latest_clean(root: str | Path, *, verify: bool = True, readonly_ledger: Ledger | None = None) -> dict:
    """The newest certified checkpoint whose bytes verify: {"step", "path", "state", "verified", "skipped"}.

    Walks back past any that fail verification and records each failure in the ledger (opened read-write only
    then); re-reads the row right before handing it out, so a step quarantined (or re-saved) while its files were
    being hashed is never returned. Raises NotFound (exit 1) with the reasons when there is none.
    """
    root = Path(root)
    ledger = readonly_ledger or Ledger.open(root, readonly=True)
    writer: Ledger | None = None
    skipped: list[dict] = []
    below = None
    try:
        while True:
            row = ledger.latest("certified", below=below)
            if row is None:
                reasons = [{"code": "no_certified_checkpoint"}] if not skipped else [
                    {"code": "all_certified_failed_verification", "skipped": skipped}]
                raise NoCleanCheckpoint(reasons)
            step = row["step"]
            if verify:
                ev = verify_checkpoint(root, ledger, step)
                if ev["status"] != policy.PASS:
                    writer = writer or Ledger.open(root)
                    record_verification_failure(writer, step, ev, source="resume", root=root)
                    skipped.append({"step": step, "reasons": ev["reasons"]})
                    below = step
                    continue
            # Hashing takes time: an operator may have quarantined the step, or a new save replaced it, meanwhile.
            now = ledger.checkpoint(step)
            if now is None or now["state"] != "certified" or now["attempt"] != row["attempt"]:
                below = step
                continue
            return {"step": step, "path": str((root / row["path"]).resolve()), "state": row["state"],
                    "verified": verify, "skipped": skipped}
    finally:
        if writer is not None:
            writer.close()
        if readonly_ledger is None:
            ledger.close()
