"""Latest-clean selection: walk back from the newest certified checkpoint, re-verify, explain.

No torch here: restart scripts call this through `scout-ckpt resume`, and `import torch` alone costs 1.4 s.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from scout_ckpt import object_store, policy
from scout_ckpt.errors import BadInput, LedgerError, LedgerUnavailable, NoCleanCheckpoint, ScoutError
from scout_ckpt.format import manifest as manifest_mod
from scout_ckpt.format.framework_folders import register_framework_layouts
from scout_ckpt.format.verify import could_not_check, only_unchecked, unchecked_reason, verify_files
from scout_ckpt.ledger import Ledger, journal
from scout_ckpt.ops import disk_view

# `resume` records when it re-checked the bytes only if the ledger takes the write within this long.
MARK_BUSY_TIMEOUT_S = 1.0


def trusted_manifest(step_dir: Path, row: dict) -> tuple[dict | None, list[dict]]:
    """(manifest, reasons): the step's manifest if it reads and matches the digest the ledger recorded, else the
    reasons not to trust it (manifest_mismatch, bad_manifest)."""
    try:
        m, digest = manifest_mod.read(step_dir)
    except manifest_mod.ManifestUnreadable as e:  # could not check now: not a bad manifest
        return None, [unchecked_reason(e.oserror, manifest_mod.MANIFEST_NAME)]
    except BadInput as e:
        return None, [{"code": "bad_manifest", "detail": str(e)}]
    if row.get("manifest_digest") and digest != row["manifest_digest"]:
        return m, [{"code": "manifest_mismatch"}]
    return m, []


def verify_checkpoint(root: Path, ledger: Ledger, step: int, progress=None, hasher=None, store=None) -> dict:
    """Bytes evidence for a recorded checkpoint: files against the ledger, manifest against its digest.
    `hasher` replaces the plain file hashing (certify's single-pass scanner checks the tensors as it reads);
    `store` (object_store.bound_store(root)) verifies an attempt prefix by parallel ranged reads instead."""
    row = ledger.checkpoint(step)
    bad: list[dict] = []
    if store is not None:
        ev = store.verify(row["path"], ledger.files(step), progress=progress)
        if not (ev["reasons"] and ev["reasons"][0].get("code") == "missing_dir"):
            _, bad = store.trusted_manifest(row)
    else:
        step_dir = Path(root) / row["path"]
        ev = verify_files(step_dir, ledger.files(step), progress=progress, hasher=hasher)
        if step_dir.is_dir():
            _, bad = trusted_manifest(step_dir, row)
    if bad and only_unchecked(bad):  # the manifest could not be read now: at most "could not check"
        if ev["status"] != policy.FAIL:
            ev = policy.evidence(
                policy.MISSING,
                [r for r in ev["reasons"] if r not in bad] + bad,
                **{k: v for k, v in ev.items() if k not in ("status", "reasons")},
                could_not_check=True,
            )
        else:
            ev = {**ev, "reasons": ev["reasons"] + bad}
    elif bad:
        ev = policy.evidence(
            policy.FAIL,
            ev["reasons"] + bad,
            **{k: v for k, v in ev.items() if k not in ("status", "reasons", "could_not_check")},
        )
    return ev


def record_verification_failure(
    ledger: Ledger, step: int, ev: dict, source: str, *, root: str | Path | None = None
) -> list[dict]:
    """A checkpoint whose re-verification failed (files missing or changed, manifest mismatched or unreadable) is
    rejected with the reasons, for good: compare-and-set from the certified or committed attempt that was
    checked, so a quarantine or a new save in between is not overwritten. The verdict is journaled under ROOT
    (default: the ledger's directory). Returns the reasons.

    Evidence that says only "could not check now" (format.verify.could_not_check: an I/O error, no fault found)
    is not a failure: nothing is recorded, the row keeps its state and evidence."""
    row = ledger.checkpoint(step)
    if row is None or could_not_check(ev) or only_unchecked(ev.get("reasons") or []):
        return ev["reasons"]
    with ledger.write():
        if ledger.checkpoint(step)["attempt"] == row["attempt"]:
            ledger.put_evidence(step, {"bytes": ev}, source=source)
        journal.record_transition(
            ledger,
            root or ledger.path.parent,
            step,
            "rejected",
            ev["reasons"],
            source=source,
            expect=("certified", "committed"),
            attempt=row["attempt"],
        )
    return ev["reasons"]


# Deprecated name (it records manifest mismatches too): kept until the checkpointer calls the new one.
record_bytes_failure = record_verification_failure


def _mark_verified(root: Path, step: int, writer: Ledger | None) -> None:
    """Record that the bytes were re-checked now, so `ls`/`explain` can say when; best effort: a ledger that is
    locked or on a read-only mount must not stop a restart."""
    try:
        own = writer is None
        led = writer or Ledger.open(root, busy_timeout=MARK_BUSY_TIMEOUT_S)
        try:
            led.mark_checked(step, ("bytes",), source="resume")
        finally:
            if own:
                led.close()
    except (ScoutError, OSError, sqlite3.DatabaseError):
        pass


def _newer_uncertified(ledger: Ledger, step: int, skipped: list[dict]) -> list[dict]:
    """Checkpoints newer than the one handed out that were not skipped by verification: why each is not it."""
    told = {s["step"] for s in skipped}
    return [
        {"step": r["step"], "state": r["state"], "reasons": r["reasons"] or []}
        for r in ledger.checkpoints(after=step)
        if r["step"] not in told and r["state"] != "deleted"
    ]


# Evidence kinds `require=` can name: a certified step is handed out only where each of them passed outright.
# `source_digests`: the bytes were digested when they were written (a scout-ckpt save, or an adopted folder whose
# framework digest file matched), not only by `adopt` as found; a scout-ckpt save records no such kind (its bytes
# evidence is the writers' own digests), so there its absence passes.
REQUIRABLE = ("bytes", "consensus", "replay", "invariants", "shard_replay", "at_rest", "health", "source_digests")


def unmet(evidence: dict[str, dict], require: tuple[str, ...]) -> list[dict]:
    """The reasons a step's recorded evidence falls short of `require` (each named kind must be `pass`: not
    `not_applicable`, which the run's policy may have accepted, nor anything weaker); [] when it meets them."""
    out = []
    for kind in require:
        ev = evidence.get(kind) or {}
        if kind == "source_digests" and kind not in evidence and "bytes" in evidence:
            ev = {"status": policy.MISSING if evidence["bytes"].get("baseline") == "adoption" else policy.PASS}
        status = ev.get("status") or policy.MISSING
        if status != policy.PASS:
            out.append(
                {
                    "code": "requirement_not_met",
                    "kind": kind,
                    "status": status,
                    **({"reasons": ev["reasons"][:4]} if ev.get("reasons") else {}),
                }
            )
    return out


def check_require(require) -> tuple[str, ...]:
    """`require=` as a tuple of known kinds, or BadInput (exit 2) naming the unknown one."""
    require = tuple(require or ())
    for kind in require:
        if kind not in REQUIRABLE:
            raise BadInput(f"--require {kind!r}: not an evidence kind (one of {', '.join(REQUIRABLE)})")
    return require


def latest_clean(
    root: str | Path,
    *,
    verify: bool = True,
    readonly_ledger: Ledger | None = None,
    fallback: bool = True,
    require: tuple[str, ...] = (),
) -> dict:
    """The newest certified checkpoint whose bytes verify: {"step", "path", "state", "verified", "skipped",
    "newer", "source"}.

    Walks back past any that fail verification and records each failure in the ledger (opened read-write only
    then); re-reads the row right before handing it out, so a step quarantined (or re-saved) while its files were
    being hashed is never returned. Raises NotFound (exit 1) with the reasons when there is none.

    When the ledger cannot be read (locked beyond the reader's busy timeout, corrupt, WAL on a network
    filesystem: LedgerUnavailable, or an SQLite error mid-walk) and `fallback`, the answer comes from the
    manifests and the journal (disk_view.latest_clean): "source" is then "manifests" and "fallback" says why.
    `require` (evidence kinds, see REQUIRABLE): a certified step is walked past unless each of those kinds passed
    outright (e.g. ("replay",): full replay coverage, not a step certified without it); the manifests' fallback
    carries no evidence detail, so a requirement there is refused (NoCleanCheckpoint), never waived.
    A ledger_dir bound to an object store hands out the `s3://` URI, verified by ranged reads (no fallback: its
    manifests are not on this disk).

    Args:
        root: the ROOT (a directory, or an object-store URI with its ledger_dir).
        verify: re-hash the candidate's bytes before handing it out (False: trust the ledger's verdict).
        readonly_ledger: an already open ledger to read (the caller's); None: opened here.
        fallback: without a readable ledger, read the checkpoints' manifests and the journal instead.
        require: evidence kinds the step must have passed outright (e.g. ("replay",), ("consensus",)).
    """
    register_framework_layouts()  # a ROOT may hold the frameworks' own folders: their names, said explicitly
    require = check_require(require)
    store = object_store.bound_store(root)
    try:
        found = _latest_clean_ledger(Path(root), verify, readonly_ledger, store, require)
        found["source"] = "ledger"
        return found
    except (LedgerUnavailable, sqlite3.DatabaseError) as e:
        if not fallback or readonly_ledger is not None or store is not None:
            raise
        why = _unavailable_text(e)
    if require:
        e = NoCleanCheckpoint(
            [
                {
                    "code": "requirement_not_checkable",
                    "require": list(require),
                    "detail": "the ledger is unreadable and the manifests carry no evidence detail",
                }
            ]
        )
        e.fallback = why
        raise e
    try:
        found = disk_view.latest_clean(root, verify=verify)
    except NoCleanCheckpoint as e:
        e.fallback = why
        raise
    found["fallback"] = why
    return found


def _unavailable_text(e: Exception) -> str:
    if isinstance(e, LedgerError):
        return str(e)
    return f"ledger unreadable ({type(e).__name__}: {e})"


def _record_failure(root: Path, writer: Ledger | None, step: int, ev: dict) -> tuple[Ledger | None, bool]:
    """Record a failed re-verification; (writer, recorded). A ledger locked by another writer does not stop the
    walk back: the step is skipped all the same, and `certify` records it later."""
    try:
        writer = writer or Ledger.open(root)
        record_verification_failure(writer, step, ev, source="resume", root=root)
        return writer, True
    except (LedgerError, sqlite3.DatabaseError):
        return writer, False


def _latest_clean_ledger(
    root: Path, verify: bool, readonly_ledger: Ledger | None, store=None, require: tuple[str, ...] = ()
) -> dict:
    ledger = readonly_ledger or Ledger.open(root, readonly=True)
    writer: Ledger | None = None
    skipped: list[dict] = []
    below = None
    try:
        while True:
            row = ledger.latest("certified", below=below)
            if row is None:
                short = all(r.get("code") == "requirement_not_met" for s in skipped for r in s["reasons"])
                reasons = (
                    [{"code": "no_certified_checkpoint"}]
                    if not skipped
                    else [
                        {
                            "code": "no_certified_checkpoint_meets_requirement"
                            if short and require
                            else "all_certified_failed_verification",
                            "skipped": skipped,
                        }
                    ]
                )
                raise NoCleanCheckpoint(reasons)
            step = row["step"]
            short = unmet(ledger.evidence(step), require)
            if short:  # certified under the run's policy, short of what this caller requires
                skipped.append({"step": step, "reasons": short})
                below = step
                continue
            if verify:
                ev = verify_checkpoint(root, ledger, step, store=store)
                if could_not_check(ev):
                    # an I/O error is not evidence: walk past it for this call, record nothing (a later call,
                    # once the storage answers, hands it out again)
                    skipped.append({"step": step, "reasons": ev["reasons"], "could_not_check": True})
                    below = step
                    continue
                if ev["status"] != policy.PASS:
                    writer, recorded = _record_failure(root, writer, step, ev)
                    skipped.append(
                        {"step": step, "reasons": ev["reasons"], **({} if recorded else {"unrecorded": True})}
                    )
                    below = step
                    continue
            # Hashing takes time: an operator may have quarantined the step, or a new save replaced it, meanwhile.
            now = ledger.checkpoint(step)
            if now is None or now["state"] != "certified" or now["attempt"] != row["attempt"]:
                skipped.append(
                    {
                        "step": step,
                        "reasons": [{"code": "changed_during_verification", "state": (now or {}).get("state")}],
                    }
                )
                below = step
                continue
            if verify:
                _mark_verified(root, step, writer)
            path = store.uri_of(row["path"]) if store is not None else str((root / row["path"]).resolve())
            return {
                "step": step,
                "path": path,
                "state": row["state"],
                "verified": verify,
                "skipped": skipped,
                "newer": _newer_uncertified(ledger, step, skipped),
            }
    finally:
        if writer is not None:
            writer.close()
        if readonly_ledger is None:
            ledger.close()
