"""`resume --latest-clean` and `certify` for a ledger_dir bound to an object store: the same walk-back and the
same compare-and-set verdicts as recovery.py and certify.py, with the bytes verified by parallel ranged reads of
the attempt prefix instead of a local directory, and the `s3://` URI handed out.

Why separate functions: recovery.py and certify.py join ROOT/path on the local disk; on a bound ledger_dir that
directory does not exist, and they would reject every checkpoint as `missing_dir`. The CLI sends a bound ROOT
here. Certify re-verifies bytes (and the manifest) only: offline invariants would need the tensors downloaded,
so the invariants evidence recorded at save stands, as consensus and replay evidence always do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from scout_ckpt import journal, policy
from scout_ckpt.errors import BadInput, ScoutError
from scout_ckpt.ledger import Ledger
from scout_ckpt.ledger.transitions import allowed
from scout_ckpt.recovery import NoCleanCheckpoint, record_verification_failure

LEFT_AS_IS = ("quarantined", "deleted", "rejected", "writing")


def verify_checkpoint(store, ledger: Ledger, step: int, progress: Callable[[int], None] | None = None) -> dict:
    """Bytes evidence for a recorded checkpoint on the store: files against the ledger, manifest against its
    digest (recovery.verify_checkpoint's contract)."""
    row = ledger.checkpoint(step)
    ev = store.verify(row["path"], ledger.files(step), progress=progress)
    if ev["reasons"] and ev["reasons"][0].get("code") == "missing_dir":
        return ev
    _, bad = store.trusted_manifest(row)
    if bad:
        ev = policy.evidence(policy.FAIL, ev["reasons"] + bad,
                             **{k: v for k, v in ev.items() if k not in ("status", "reasons")})
    return ev


def latest_clean(root: str | Path, store, *, verify: bool = True) -> dict:
    """recovery.latest_clean for a bound ledger_dir: {"step", "path" (the s3:// URI), "state", "verified",
    "skipped", "newer"}; failures are recorded (rejected, journaled in the ledger_dir) and walked past."""
    root = Path(root)
    ledger = Ledger.open(root, readonly=True)
    writer: Ledger | None = None
    skipped: list[dict] = []
    below = None
    try:
        while True:
            row = ledger.latest("certified", below=below)
            if row is None:
                raise NoCleanCheckpoint([{"code": "no_certified_checkpoint"}] if not skipped else [
                    {"code": "all_certified_failed_verification", "skipped": skipped}])
            step = row["step"]
            if verify:
                ev = verify_checkpoint(store, ledger, step)
                if ev["status"] != policy.PASS:
                    writer = writer or Ledger.open(root)
                    record_verification_failure(writer, step, ev, source="resume", root=root)
                    skipped.append({"step": step, "reasons": ev["reasons"]})
                    below = step
                    continue
            now = ledger.checkpoint(step)
            if now is None or now["state"] != "certified" or now["attempt"] != row["attempt"]:
                skipped.append({"step": step, "reasons": [{"code": "changed_during_verification",
                                                           "state": (now or {}).get("state")}]})
                below = step
                continue
            if verify:
                _mark_verified(root, step, writer)
            told = {s["step"] for s in skipped}
            newer = [{"step": r["step"], "state": r["state"], "reasons": r["reasons"] or []}
                     for r in ledger.checkpoints()
                     if r["step"] > step and r["step"] not in told and r["state"] != "deleted"]
            return {"step": step, "path": store.uri_of(row["path"]), "state": row["state"], "verified": verify,
                    "skipped": skipped, "newer": newer}
    finally:
        if writer is not None:
            writer.close()
        ledger.close()


def _mark_verified(root: Path, step: int, writer: Ledger | None) -> None:
    """Record that the bytes were re-checked now; best effort: a locked ledger must not stop a restart."""
    try:
        led = writer or Ledger.open(root)
        try:
            led.mark_checked(step, ("bytes",), source="resume")
        finally:
            if led is not writer:
                led.close()
    except (ScoutError, OSError):
        pass


def _summary(ledger: Ledger, step: int, **extra) -> dict:
    row = ledger.checkpoint(step)
    return {"step": step, "state": row["state"], "reasons": row["reasons"],
            "evidence": {k: v["status"] for k, v in ledger.evidence(step).items()}, **extra}


def _run_policy(ledger: Ledger, row: dict) -> dict:
    run = ledger.run(row["run_id"]) if row.get("run_id") else None
    return (run or {}).get("policy") or policy.FOUNDATION


def certify_step(root: Path, store, ledger: Ledger, step: int, progress=None) -> dict:
    """certify.certify_step on the store: bytes re-verified by ranged reads, verdict by compare-and-set on the
    state and attempt read before hashing."""
    row = ledger.checkpoint(step)
    if row is None:
        raise BadInput(f"step {step}: no such checkpoint in the ledger")
    if row["state"] in LEFT_AS_IS:
        return _summary(ledger, step, skipped=True)
    seen, attempt = row["state"], row["attempt"]
    run_pol = _run_policy(ledger, row)
    ev = {"bytes": verify_checkpoint(store, ledger, step, progress=progress)}
    with ledger.write():
        now = ledger.checkpoint(step)
        if now["attempt"] != attempt or now["state"] != seen:
            merged = {**ledger.evidence(step), **ev} if now["attempt"] == attempt else ev
        else:
            ledger.put_evidence(step, ev, source="certify")
            merged = ledger.evidence(step)
        verdict = policy.evaluate(run_pol, merged)
        if not allowed(seen, verdict.state, "certify"):
            return _summary(ledger, step, refused={"state": verdict.state, "reasons": verdict.reasons})
        applied = journal.record_transition(ledger, root, step, verdict.state, verdict.reasons, source="certify",
                                            expect=seen, attempt=attempt)
    return _summary(ledger, step, **({} if applied else {"superseded": {"state": verdict.state,
                                                                       "reasons": verdict.reasons}}))


def certify(root: str | Path, store, steps: list[int] | None = None, progress_factory=None) -> list[dict]:
    """certify.certify for a bound ledger_dir: settle dead saves (against the store), then certify each step."""
    from scout_ckpt.settle import settle_writing

    root = Path(root)
    with Ledger.open(root) as ledger:
        rows = ledger.checkpoints()
        if steps is None:
            steps = [r["step"] for r in rows if r["state"] != "deleted"]
        else:
            known = {r["step"] for r in rows}
            for s in steps:
                if s not in known:
                    raise BadInput(f"step {s}: no such checkpoint in the ledger")
        settle_writing(ledger, root, source="certify", store=store)
        total = sum(r["bytes"] or 0 for r in rows if r["step"] in steps)
        progress = progress_factory(total) if progress_factory else None
        return [certify_step(root, store, ledger, s, progress=progress) for s in steps]
