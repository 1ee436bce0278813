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
from scout_ckpt.ledger import Ledger, journal, tiers

EXPLAIN_KINDS = ("bytes", "consensus", "replay", "invariants")


def _row(ledger: Ledger, root: Path, step: int) -> dict:
    row = ledger.checkpoint(step)
    if row is None:
        raise BadInput(f"step {step}: no such checkpoint in {root}")
    return row


def _copy_row(ledger: Ledger, step: int) -> dict | None:
    """The fast tier's row of STEP (its node-local files and peer copies), or None."""
    return tiers.row(ledger, step)


def quarantine(root: str | os.PathLike, step: int, reason: str) -> dict:
    """Move STEP (any state but deleted) to `quarantined`, in every tier that holds it: the durable row and the
    fast tier's row (node-local files, peer copies) alike, since a verdict on a step holds for every copy. A step
    held only by the fast tier is quarantined all the same. Returns {"step", "state", "before", "reason",
    "tiers": {tier: state before}}."""
    root = Path(root)
    with Ledger.open(root) as ledger, ledger.write():
        row, copy = ledger.checkpoint(step), _copy_row(ledger, step)
        live = {
            t: r for t, r in (("durable", row), (tiers.LOCAL, copy)) if r is not None and r["state"] != "deleted"
        }  # quarantined again: the new reason stands
        if row is None and copy is None:
            raise BadInput(f"step {step}: no such checkpoint in {root}")
        if not live:
            held = (row or copy or {}).get("state")
            raise BadInput(f"step {step}: {held}; nothing to quarantine")
        before = {t: r["state"] for t, r in live.items()}
        first = row if row is not None else copy
        assert first is not None  # one of them exists: checked above
        try:  # first: a quarantine the journal cannot hold is not applied (the transaction rolls back)
            journal.append(
                root,
                {
                    "kind": "quarantine",
                    "step": step,
                    "attempt": (row or {}).get("attempt"),
                    "manifest_digest": (row or {}).get("manifest_digest"),
                    "reason": reason,
                    "before": first["state"],
                    "tiers": before,
                },
            )
        except OSError as e:
            raise BadInput(
                f"{journal.path(root)}: cannot record the quarantine ({e.strerror or e}); nothing changed"
            ) from None
        reasons = [{"code": "quarantined", "detail": reason}]
        if "durable" in live:
            assert row is not None
            ledger.transition(step, "quarantined", reasons, source="operator", expect=row["state"])
        if tiers.LOCAL in live:  # its state before is kept in the reason: a release gives it back, never more
            assert copy is not None
            was = next((r for r in copy.get("reasons") or [] if r.get("code") == "quarantined"), None)
            before_local = (
                {"before": was.get("before"), "before_reasons": was.get("before_reasons") or []}
                if copy["state"] == "quarantined" and was is not None
                else {"before": copy["state"], "before_reasons": copy.get("reasons") or []}
            )
            tiers.set_state(ledger, step, "quarantined", [{**reasons[0], **before_local}], expect=copy["state"])
        ledger.add_event("quarantine", step=step, detail={"reason": reason, "before": first["state"], "tiers": before})
    return {"step": step, "state": "quarantined", "before": first["state"], "reason": reason, "tiers": before}


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
        return policy.Verdict(
            "rejected",
            before_reasons + [r for r in v.reasons if r not in before_reasons]
            if v.state == "rejected"
            else before_reasons,
        )
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
            row, copy = ledger.checkpoint(step), _copy_row(ledger, step)
            if row is None and copy is None:
                raise BadInput(f"step {step}: no such checkpoint in {root}")
            held = {
                t: r
                for t, r in (("durable", row), (tiers.LOCAL, copy))
                if r is not None and r["state"] == "quarantined"
            }
            if not held:
                raise BadInput(f"step {step}: not quarantined (it is {(row or copy or {}).get('state')})")
            try:  # the journal line follows the commit: a journal that cannot take it stops the release here
                journal.check_appendable(root)
            except OSError as e:
                raise BadInput(
                    f"{journal.path(root)}: cannot record the release ({e.strerror or e}); nothing changed"
                ) from None
            v: policy.Verdict | None = None
            if "durable" in held:
                assert row is not None
                v = release_state(ledger, row)
                ledger.transition(
                    step, v.state, v.reasons, source="operator", expect="quarantined", attempt=row["attempt"]
                )
            if tiers.LOCAL in held:
                assert copy is not None
                q: dict = next((r for r in copy.get("reasons") or [] if r.get("code") == "quarantined"), {})
                local_v = policy.Verdict(q.get("before") or "committed", list(q.get("before_reasons") or []))
                if v is not None and policy.step_distrusted(v.state, v.reasons):
                    local_v = v  # the step's own verdict holds for its copy too
                tiers.set_state(ledger, step, local_v.state, local_v.reasons, expect="quarantined")
                v = v or local_v
            assert v is not None  # held names the durable row or the local one
            ledger.add_event("release", step=step, detail={"reason": reason, "state": v.state, "tiers": sorted(held)})
        journal.append(
            root,
            {
                "kind": "release",
                "step": step,
                "attempt": (row or {}).get("attempt"),
                "manifest_digest": (row or {}).get("manifest_digest"),
                "state": v.state,
                "reasons": v.reasons,
                "reason": reason,
            },
        )
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
    evidence = {
        k: ev.get(k) or {"status": "required_missing" if k in required else "not_required"} for k in EXPLAIN_KINDS
    }
    evidence.update({k: v for k, v in ev.items() if k not in evidence})
    return {
        "step": step,
        "state": row["state"],
        "path": row["path"],
        "evidence": evidence,
        "reasons": row["reasons"],
        "policy": (run or {}).get("policy"),
        "run_id": row["run_id"],
        "attempt": row["attempt"],
        "history": [
            {
                "time": h["time"],
                "source": h["source"],
                "state": h["state"],
                "attempt": h["attempt"],
                "outcome": h["outcome"] or "applied",
            }
            for h in history
        ],
        "events": events,
    }
