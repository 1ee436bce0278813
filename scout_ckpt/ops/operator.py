"""Operator decisions and the explanation of a verdict: the library behind `quarantine`, `release`, `explain`.

A quarantine is an operator's override: the step is never resumed from and never re-saved until released. It
is recorded in the ledger (compare-and-set, history) and in the journal beside the data, so `ledger rebuild`
restores it. The journal line is written inside the ledger's write transaction, before it commits: a crash in
between leaves the journal stricter than the ledger, never laxer. A release goes the other way (it raises
trust), so its journal line follows the ledger's commit.

A release re-evaluates the run's policy on the evidence recorded for the step, so a step quarantined while it
waited for evidence comes back as what that evidence gives today; but it never raises the step above the state
its attempt had when it was quarantined (the verdict history says which). Not every verdict is evidence: a load
mismatch, a settled dead save or a revocation rejects by a transition alone, and re-evaluating the evidence would
certify such a step again. Nothing but evidence raises trust, and a quarantine is not evidence.
"""

from __future__ import annotations

import os
from pathlib import Path

from scout_ckpt import policy
from scout_ckpt.errors import BadInput
from scout_ckpt.ledger import Ledger, journal

EXPLAIN_KINDS = ("bytes", "consensus", "replay", "invariants")


def _row(ledger: Ledger, root: Path, step: int) -> dict:
    row = ledger.checkpoint(step)
    if row is None:
        raise BadInput(f"step {step}: no such checkpoint in {root}")
    return row


def quarantine(root: str | os.PathLike, step: int, reason: str) -> dict:
    """Move STEP (any state but deleted) to `quarantined`; returns {"step", "state", "before", "reason"}."""
    root = Path(root)
    with Ledger.open(root) as ledger, ledger.write():
        row = _row(ledger, root, step)
        if row["state"] == "deleted":
            raise BadInput(f"step {step}: deleted; nothing to quarantine")
        reasons = [{"code": "quarantined", "detail": reason}]
        try:  # first: a quarantine the journal cannot hold is not applied (the transaction rolls back)
            journal.append(root, {"kind": "quarantine", "step": step, "attempt": row["attempt"],
                                  "manifest_digest": row["manifest_digest"], "reason": reason,
                                  "before": row["state"]})
        except OSError as e:
            raise BadInput(f"{journal.path(root)}: cannot record the quarantine ({e.strerror or e}); "
                           "nothing changed") from None
        ledger.transition(step, "quarantined", reasons, source="operator", expect=row["state"])
        ledger.add_event("quarantine", step=step, detail={"reason": reason, "before": row["state"]})
    return {"step": step, "state": "quarantined", "before": row["state"], "reason": reason}


def evidence_state(ledger: Ledger, row: dict) -> policy.Verdict:
    """What the recorded evidence gives under the run's policy. A save that never committed (quarantined while
    writing) goes back to `writing`: `settle.settle_writing` then decides it, as it would have."""
    if row["committed"] is None:
        return policy.Verdict("writing", [])
    run = ledger.run(row["run_id"]) if row.get("run_id") else None
    pol = (run or {}).get("policy") or policy.FOUNDATION
    return policy.evaluate(pol, ledger.evidence(row["step"]))


def state_before_quarantine(ledger: Ledger, row: dict) -> tuple[str | None, list[dict]]:
    """(state, reasons) the row's attempt had when it was quarantined: its last applied verdict in the history
    that is not a quarantine ((None, []) when the history has none, e.g. a ledger that predates it)."""
    state, reasons = None, []
    for h in ledger.certifications(row["step"]):
        if h["attempt"] not in (None, row["attempt"]) or h["state"] == "quarantined":
            continue
        state, reasons = h["state"], list(h["reasons"] or [])
    return state, reasons


def release_state(ledger: Ledger, row: dict) -> policy.Verdict:
    """What a release gives: the evidence's verdict (evidence_state), never above the state before the
    quarantine. A rejection stands with its reasons (and any failure the evidence adds); a committed step stays
    committed (certify or replay raises it later if its evidence passes); a step quarantined while writing is
    what its recorded commit gives."""
    v = evidence_state(ledger, row)
    before, before_reasons = state_before_quarantine(ledger, row)
    if before == "rejected":
        return policy.Verdict("rejected", before_reasons + [r for r in v.reasons if r not in before_reasons]
                              if v.state == "rejected" else before_reasons)
    if before == "committed" and v.state == "certified":
        return policy.Verdict("committed", before_reasons + [{"code": "not_raised_by_release", "before": before}])
    return v


def release(root: str | os.PathLike, step: int, reason: str) -> dict:
    """Release a quarantined STEP to the state its evidence gives, never above the state it had before the
    quarantine (release_state); returns {"step", "state", "reasons", "reason"}. BadInput (exit 2) if the step
    is not quarantined."""
    root = Path(root)
    with Ledger.open(root) as ledger:
        with ledger.write():
            row = _row(ledger, root, step)
            if row["state"] != "quarantined":
                raise BadInput(f"step {step}: not quarantined (it is {row['state']})")
            try:  # the journal line follows the commit: a journal that cannot take it stops the release here
                journal.check_appendable(root)
            except OSError as e:
                raise BadInput(f"{journal.path(root)}: cannot record the release ({e.strerror or e}); "
                               "nothing changed") from None
            v = release_state(ledger, row)
            ledger.transition(step, v.state, v.reasons, source="operator", expect="quarantined",
                              attempt=row["attempt"])
            ledger.add_event("release", step=step, detail={"reason": reason, "state": v.state})
        journal.append(root, {"kind": "release", "step": step, "attempt": row["attempt"],
                              "manifest_digest": row["manifest_digest"], "state": v.state, "reasons": v.reasons,
                              "reason": reason})
    return {"step": step, "state": v.state, "reasons": v.reasons, "reason": reason}


def explain(root: str | os.PathLike, step: int) -> dict:
    """Why STEP is or is not certified: {"step", "state", "path", "evidence": {kind: {...}}, "reasons", "policy",
    "run_id", "history", "events"}. Evidence kinds the policy requires but nobody recorded read
    "required_missing"; those it does not require, "not_required". Read-only."""
    root = Path(root)
    with Ledger.open(root, readonly=True) as ledger:
        row = _row(ledger, root, step)
        run = ledger.run(row["run_id"]) if row["run_id"] else None
        ev = ledger.evidence(step)
        history = ledger.certifications(step, all_outcomes=True)
        events = [e for e in ledger.events() if e["step"] == step]
    required = (run or {}).get("policy", {}).get("require", [])
    evidence = {k: ev.get(k) or {"status": "required_missing" if k in required else "not_required"}
                for k in EXPLAIN_KINDS}
    evidence.update({k: v for k, v in ev.items() if k not in evidence})
    return {"step": step, "state": row["state"], "path": row["path"], "evidence": evidence,
            "reasons": row["reasons"], "policy": (run or {}).get("policy"), "run_id": row["run_id"],
            "attempt": row["attempt"],
            "history": [{"time": h["time"], "source": h["source"], "state": h["state"], "attempt": h["attempt"],
                         "outcome": h["outcome"] or "applied"} for h in history],
            "events": events}
