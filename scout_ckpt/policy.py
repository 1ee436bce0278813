"""Evidence in, verdict out. Pure functions, no I/O: the one place that decides what "certified" means.

Evidence is a dict keyed by kind ("bytes", "consensus", "replay", "invariants", ...). Each value is
{"status": STATUS, "reasons": [{"code": ..., ...}], ...detail}, STATUS one of:

  pass            the check ran and found nothing wrong
  fail            the check found a fault              -> rejected
  inconclusive    the check could not decide (e.g. C3 without a strict majority) -> rejected: fail closed
  missing         the evidence is not there (yet)      -> committed, never certified
  not_applicable  the check cannot apply here (e.g. consensus without replicas): passes only where the
                  run's policy says it may (`allow_not_applicable`)

A run's policy (stored in the ledger's runs table and each manifest) names the kinds it requires:
  {"require": ["bytes", "invariants", "consensus", "replay"], "allow_not_applicable": ["consensus"]}
"""

from __future__ import annotations

from dataclasses import dataclass, field

PASS, FAIL, INCONCLUSIVE, MISSING, NOT_APPLICABLE = "pass", "fail", "inconclusive", "missing", "not_applicable"

# Reasons that concern one copy's bytes (its files, its manifest, its write), not the state the step holds: a
# step rejected only for these may still be good in another copy (the fast tier's node-local files). Any other
# reason of a rejection (replay, consensus, invariants, shard evidence, lineage, load_mismatch, health) and a
# quarantine concern the step, wherever its bytes live.
COPY_REASONS = frozenset(
    {
        "digest_mismatch",
        "missing_file",
        "missing_dir",
        "truncated_file",
        "unreadable_file",
        "unexpected_file",
        "unsafe_file",
        "manifest_mismatch",
        "bad_manifest",
        "bad_metadata",
        "bad_entry",
        "no_files_recorded",
        "save_interrupted",
        "commit_failed",
        "could_not_check",
        "retention",
    }
)


def step_distrusted(state: str, reasons: list[dict]) -> bool:
    """Does this row's verdict speak against the step itself (a quarantine, or a rejection for anything but one
    copy's bytes), so that no copy of the step may be handed out?"""
    if state == "quarantined":
        return True
    return state == "rejected" and any((r or {}).get("code") not in COPY_REASONS for r in reasons or [{}])


STATUSES = (PASS, FAIL, INCONCLUSIVE, MISSING, NOT_APPLICABLE)

# Policies of the runs scout-ckpt knows; a run may store its own.
BYTES_ONLY = {"require": ["bytes"], "allow_not_applicable": []}
FOUNDATION = {"require": ["bytes", "invariants"], "allow_not_applicable": []}
ADOPTED = {"require": ["bytes", "structure", "invariants"], "allow_not_applicable": ["invariants"]}


@dataclass(frozen=True)
class Verdict:
    state: str  # certified | committed | rejected
    reasons: list[dict] = field(default_factory=list)

    @property
    def certified(self) -> bool:
        return self.state == "certified"


def evidence(status: str, reasons: list[dict] | None = None, **detail) -> dict:
    """Build one piece of evidence in the shape `evaluate` reads."""
    assert status in STATUSES, status
    return {"status": status, "reasons": list(reasons or []), **detail}


def evaluate(policy: dict, ev: dict[str, dict]) -> Verdict:
    """Verdict of a committed checkpoint. Fail closed: only complete, passing evidence certifies.

    Args:
        policy: the run's policy: {"require": [kinds], "allow_not_applicable": [kinds], ...}.
        ev: the evidence by kind: {kind: {"status": "pass" | "fail" | ..., "reasons": [...]}}.
    """
    failures: list[dict] = []
    pending: list[dict] = []
    allow_na = set(policy.get("allow_not_applicable", []))
    for kind in policy.get("require", []):
        item = ev.get(kind)
        status = item.get("status") if item else MISSING
        reasons = list(item.get("reasons") or []) if item else []
        if status == PASS:
            continue
        if status == NOT_APPLICABLE:
            if kind in allow_na:
                continue
            pending.append({"code": f"{kind}_not_applicable", "kind": kind})
        elif status in (FAIL, INCONCLUSIVE):
            failures.extend(reasons or [{"code": f"{kind}_{status}", "kind": kind}])
        else:
            pending.extend(reasons or [{"code": f"{kind}_missing", "kind": kind}])
    # Failures the policy does not require still reject: a fault found is a fault, whoever looked.
    for kind, item in ev.items():
        if kind not in policy.get("require", []) and item.get("status") in (FAIL, INCONCLUSIVE):
            failures.extend(item.get("reasons") or [{"code": f"{kind}_{item['status']}", "kind": kind}])
    if failures:
        return Verdict("rejected", failures + pending)
    if pending:
        return Verdict("committed", pending)
    return Verdict("certified", [])


# Evidence about the files on disk, not the state in memory: a bytes failure leaves the live state as good as it
# was. `lineage` is this module's own verdict on what came before, not new evidence about the state.
NOT_LIVE = ("bytes", "lineage")


def live_faults(ev: dict[str, dict]) -> list[str]:
    """The kinds of evidence that found the live state itself bad (fail or inconclusive): every checkpoint saved
    from that state afterwards descends from it. Sorted; empty when none did."""
    return sorted(
        k
        for k, item in ev.items()
        if k not in NOT_LIVE and isinstance(item, dict) and item.get("status") in (FAIL, INCONCLUSIVE)
    )


def lineage_evidence(tainted: dict | None) -> dict | None:
    """The `lineage` evidence of a save made after a live fault ({"step", "kinds"}) and before a clean load: fail."""
    if tainted is None:
        return None
    return evidence(
        FAIL,
        [
            {
                "code": "lineage_tainted",
                "since": tainted["step"],
                "kinds": list(tainted["kinds"]),
                "detail": f"the state descends from step {tainted['step']}, whose evidence showed the "
                "live state bad; load a clean checkpoint",
            }
        ],
    )
