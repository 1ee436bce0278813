"""How checkpoints, evidence and reasons are shown: the `ls --json` rows and their one-line texts.

Shared by the CLI and the demo's summary so that both say the same thing the same way. No torch, no rich.
"""

from __future__ import annotations

STATUS_MARK = {"pass": "✓", "fail": "✗", "inconclusive": "?", "missing": "…", "not_applicable": "-"}
STATE_STYLE = {"certified": "green", "committed": "yellow", "rejected": "red", "quarantined": "magenta",
               "writing": "dim", "deleted": "dim"}


def checkpoint_rows(ledger) -> list[dict]:
    """`ls --json` rows: step, state, path, bytes, evidence {kind: status}, reasons."""
    out = []
    for r in ledger.checkpoints():
        ev = ledger.evidence(r["step"])
        out.append({"step": r["step"], "state": r["state"], "path": r["path"], "bytes": r["bytes"],
                    "evidence": {k: v["status"] for k, v in ev.items()}, "reasons": r["reasons"] or [],
                    "run_id": r["run_id"], "committed": r["committed"]})
    return out


def evidence_marks(evidence: dict[str, str]) -> str:
    """{"bytes": "pass", "replay": "missing"} -> "bytes✓ replay…"."""
    return " ".join(f"{k}{STATUS_MARK.get(v, '?')}" for k, v in sorted(evidence.items())) or "-"


def reason_text(reasons: list[dict]) -> str:
    """One line for a list of reasons: code(file/target/check; missing: ...)[ranks ...], deduplicated."""
    parts: list[str] = []
    for r in reasons:
        extra = ",".join(str(r[k]) for k in ("file", "target", "check") if r.get(k))
        for k in ("missing", "awaiting"):
            if r.get(k):
                extra += (";" if extra else "") + f"{k}: " + ",".join(map(str, r[k]))
        ranks = r.get("ranks") or ([r["rank"]] if r.get("rank") is not None else [])
        s = r["code"] + (f"({extra})" if extra else "") + (f"[ranks {','.join(map(str, ranks))}]" if ranks else "")
        if s not in parts:
            parts.append(s)
    return "; ".join(parts)
