"""The checkpoint state machine: which state may follow which (docs/design.md, "States and transitions").

The ledger enforces this table as compare-and-set (`Ledger.transition`): a verdict computed on a row that
changed meanwhile (an operator quarantined it while certify was hashing, a new save attempt replaced it) is not
applied but kept in the history as 'superseded'. Nothing but evidence raises trust, so no edge leads back from
`rejected`; a re-save of a rejected step is a new attempt (`Ledger.record_writing`), not a transition.

The operator is the one exception: `quarantine` moves any state but `deleted` to `quarantined`, and `release`
moves `quarantined` to whatever its evidence gives; both pass source="operator".
"""

from __future__ import annotations

STATES = ("writing", "committed", "certified", "rejected", "quarantined", "deleted")
OPERATOR = "operator"

ALLOWED: dict[str, set[str]] = {
    "writing": {"committed", "rejected", "quarantined", "deleted"},
    "committed": {"certified", "rejected", "quarantined", "deleted"},
    "certified": {"rejected", "quarantined", "deleted"},
    "rejected": {"quarantined", "deleted"},
    "quarantined": set(),  # leaves only by an operator release
    "deleted": set(),  # final: the row stays, the directory is gone
}

# Outcomes of a verdict in the history (certifications.outcome).
APPLIED, SUPERSEDED, REFUSED = "applied", "superseded", "refused"


def allowed(frm: str, to: str, source: str) -> bool:
    """May `frm` become `to`? The same state again is allowed (a verdict re-affirmed with fresh reasons)."""
    if frm == to:
        return frm != "deleted"
    if source == OPERATOR:
        if to == "quarantined":
            return frm != "deleted"
        return frm == "quarantined" or to in ALLOWED[frm]
    return to in ALLOWED[frm]


def deletable() -> tuple[str, ...]:
    """The states retention may move to `deleted` (every one but quarantined and deleted itself)."""
    return tuple(s for s in STATES if "deleted" in ALLOWED[s])
