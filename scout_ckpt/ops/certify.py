"""Offline re-certification: re-verify bytes (and invariants, where the run configured them), record, decide.

The verdict is recomputed from the run's stored policy with the fresh evidence replacing the old; evidence that
only existed at save time (consensus, replay) is kept as recorded. Hashing takes minutes on a large checkpoint,
so the verdict is applied as compare-and-set on the state and attempt certify read before hashing: a quarantine
or a new save in the meantime wins, and certify's verdict is kept in the history as superseded.

Bytes and invariants come from one streaming pass per file (scan.py: each file read once, its tensor entries
checked from the same reads, files in parallel threads); where that pass cannot vouch for every entry, the
invariants are read back as before (`offline_invariants`).

`writing` rows are first settled by `settle.settle_writing` (the one settler): a save whose owner is alive is
left alone. Quarantined, deleted and rejected steps are left as they are: an operator's override is not for
certify to undo, and nothing raises a rejected attempt back (a re-save is a new attempt).

A step whose bytes could not be checked now (an I/O error other than a missing file: format/verify.py) is left
exactly as it is, evidence and state; its result carries "could_not_check" and the command exits 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from scout_ckpt import object_store, policy
from scout_ckpt.errors import BadInput
from scout_ckpt.format.verify import could_not_check
from scout_ckpt.ledger import Ledger, journal
from scout_ckpt.ledger.transitions import allowed
from scout_ckpt.ops.recovery import verify_checkpoint
from scout_ckpt.ops.settle import settle_writing

LEFT_AS_IS = ("quarantined", "deleted", "rejected", "writing")


def run_policy(ledger: Ledger, row: dict) -> dict:
    run = ledger.run(row["run_id"]) if row.get("run_id") else None
    return (run or {}).get("policy") or policy.FOUNDATION


def offline_invariants(step_dir: Path, specs: list) -> dict | None:
    """Re-run the configured invariants from the saved bytes (imports torch, only when specs exist)."""
    if not specs:
        return None
    from scout_ckpt import invariants
    from scout_ckpt.format.layout import is_folder_dir

    if is_folder_dir(step_dir):  # a Trainer checkpoint-N folder (scout_ckpt.integrations.folders)
        from scout_ckpt.format.folder_tensors import read_tensors as read_folder

        tensors = read_folder(step_dir)
    else:
        from scout_ckpt.format.dcp_files import read_tensors

        tensors = read_tensors(step_dir, include_bytes=True)
    return invariants.run_offline(invariants.parse_specs(specs), tensors)


def _scan_for(step_dir: Path, specs: list):
    """The one-pass scanner (scan.py) for a DCP step dir with invariants to check; None otherwise (bytes only, or a
    Trainer folder, whose tensors are not DCP entries)."""
    if not specs or not step_dir.is_dir():
        return None
    from scout_ckpt.format.layout import is_folder_dir

    if is_folder_dir(step_dir):
        return None
    from scout_ckpt.format.scan import StepScan

    return StepScan(step_dir, specs)


def _summary(ledger: Ledger, step: int, **extra) -> dict:
    row = ledger.checkpoint(step)
    return {
        "step": step,
        "state": row["state"],
        "reasons": row["reasons"],
        "evidence": {k: v["status"] for k, v in ledger.evidence(step).items()},
        **extra,
    }


def certify_step(
    root: Path, ledger: Ledger, step: int, progress: Callable[[int], None] | None = None, store=None
) -> dict:
    """Re-verify one step and record the result; returns {"step", "state", "reasons", "evidence"} (plus
    "skipped" when the step was left as it is, "superseded" when the row changed while certify hashed).
    On an object store (`store`) the bytes and the manifest are re-verified by ranged reads; the invariants
    recorded at save stand (checking them offline would download every tensor)."""
    row = ledger.checkpoint(step)
    if row is None:
        raise BadInput(f"step {step}: no such checkpoint in the ledger")
    if row["state"] in LEFT_AS_IS:
        return _summary(ledger, step, skipped=True)
    seen, attempt = row["state"], row["attempt"]
    run_pol = run_policy(ledger, row)
    specs = run_pol.get("invariants") or []
    scan = _scan_for(root / row["path"], specs) if store is None else None
    ev = {
        "bytes": verify_checkpoint(
            root, ledger, step, progress=progress, store=store, hasher=scan.hasher if scan is not None else None
        )
    }
    if could_not_check(ev["bytes"]):
        # an I/O error is not evidence: nothing recorded, the step keeps its state; certify says so (exit 1)
        return _summary(ledger, step, could_not_check=ev["bytes"]["reasons"])
    if ev["bytes"]["status"] == policy.PASS and store is None:
        inv = scan.invariants() if scan is not None else None
        if inv is None:
            inv = offline_invariants(root / row["path"], specs)
        if inv is not None:
            ev["invariants"] = {**inv, "specs": specs}
    with ledger.write():  # evidence and verdict in one transaction, on the attempt that was hashed
        now = ledger.checkpoint(step)
        if now["attempt"] != attempt or now["state"] != seen:
            # record the verdict as superseded (the CAS below does), but not evidence about another state
            merged = {**ledger.evidence(step), **ev} if now["attempt"] == attempt else ev
        else:
            ledger.put_evidence(step, ev, source="certify")
            merged = ledger.evidence(step)
        verdict = policy.evaluate(run_pol, merged)
        if not allowed(seen, verdict.state, "certify"):
            # e.g. certified -> committed: evidence went missing, nothing was found wrong; the state stays.
            return _summary(ledger, step, refused={"state": verdict.state, "reasons": verdict.reasons})
        applied = journal.record_transition(
            ledger, root, step, verdict.state, verdict.reasons, source="certify", expect=seen, attempt=attempt
        )
    return _summary(
        ledger, step, **({} if applied else {"superseded": {"state": verdict.state, "reasons": verdict.reasons}})
    )


def certify(root: Path, steps: list[int] | None = None, progress_factory=None) -> list[dict]:
    """Certify the given steps (all recorded, non-deleted ones if None), after settling dead saves."""
    root = Path(root)
    store = object_store.bound_store(root)
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
        return [certify_step(root, ledger, s, progress=progress, store=store) for s in steps]
