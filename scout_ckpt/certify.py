"""Offline re-certification: re-verify bytes (and invariants, where the run configured them), record, decide.

The verdict is recomputed from the run's stored policy with the fresh evidence replacing the old; evidence that
only existed at save time (consensus, replay) is kept as recorded. Quarantined and deleted steps are left as
they are: an operator's override is not for certify to undo.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from scout_ckpt import policy
from scout_ckpt.errors import BadInput
from scout_ckpt.ledger import Ledger
from scout_ckpt.recovery import verify_checkpoint

FINAL_STATES = ("quarantined", "deleted")


def run_policy(ledger: Ledger, row: dict) -> dict:
    run = ledger.run(row["run_id"]) if row.get("run_id") else None
    return (run or {}).get("policy") or policy.FOUNDATION


def offline_invariants(step_dir: Path, specs: list) -> dict | None:
    """Re-run the configured invariants from the saved bytes (imports torch, only when specs exist)."""
    if not specs:
        return None
    from scout_ckpt import invariants
    from scout_ckpt.dcp_files import read_tensors

    return invariants.run_offline(invariants.parse_specs(specs), read_tensors(step_dir, include_bytes=True))


def certify_step(root: Path, ledger: Ledger, step: int, progress: Callable[[int], None] | None = None) -> dict:
    """Re-verify one step and record the result; returns {"step", "state", "reasons", "evidence"}."""
    row = ledger.checkpoint(step)
    if row is None:
        raise BadInput(f"step {step}: no such checkpoint in the ledger")
    interrupted = row["state"] == "rejected" and any(r.get("code") == "save_interrupted" for r in row["reasons"])
    if row["state"] in FINAL_STATES or interrupted:  # an interrupted save stays what it was: nothing to re-verify
        return {"step": step, "state": row["state"], "reasons": row["reasons"], "evidence": ledger.evidence(step),
                "skipped": True}
    if row["state"] == "writing":
        reasons = [{"code": "save_incomplete"}]
        ledger.set_state(step, "rejected", reasons, source="certify")
        return {"step": step, "state": "rejected", "reasons": reasons,
                "evidence": {"bytes": policy.evidence(policy.FAIL, reasons)}}
    run_pol = run_policy(ledger, row)
    ev = {"bytes": verify_checkpoint(root, ledger, step, progress=progress)}
    if ev["bytes"]["status"] == policy.PASS:
        specs = run_pol.get("invariants") or []
        inv = offline_invariants(root / row["path"], specs)
        if inv is not None:
            ev["invariants"] = {**inv, "specs": specs}
    ledger.put_evidence(step, ev, source="certify")
    merged = ledger.evidence(step)
    verdict = policy.evaluate(run_pol, merged)
    ledger.set_state(step, verdict.state, verdict.reasons, source="certify")
    return {"step": step, "state": verdict.state, "reasons": verdict.reasons,
            "evidence": {k: v["status"] for k, v in merged.items()}}


def certify(root: Path, steps: list[int] | None = None, progress_factory=None) -> list[dict]:
    """Certify the given steps (all recorded, non-deleted ones if None)."""
    with Ledger.open(root) as ledger:
        rows = ledger.checkpoints()
        if steps is None:
            steps = [r["step"] for r in rows if r["state"] != "deleted"]
        else:
            known = {r["step"] for r in rows}
            for s in steps:
                if s not in known:
                    raise BadInput(f"step {s}: no such checkpoint in the ledger")
        total = sum(r["bytes"] or 0 for r in rows if r["step"] in steps)
        progress = progress_factory(total) if progress_factory else None
        return [certify_step(root, ledger, s, progress=progress) for s in steps]
