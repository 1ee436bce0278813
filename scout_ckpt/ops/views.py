"""How checkpoints, evidence and reasons are shown: the `ls --json` rows and their one-line texts.

Shared by the CLI and the demo's summary so that both say the same thing the same way. No torch, no rich.
"""

from __future__ import annotations

import time
from typing import Callable

STATUS_MARK = {"pass": "✓", "fail": "✗", "inconclusive": "?", "missing": "…", "not_applicable": "-"}
STATE_STYLE = {
    "certified": "green",
    "committed": "yellow",
    "rejected": "red",
    "quarantined": "magenta",
    "writing": "dim",
    "deleted": "dim",
}


def checkpoint_rows(ledger) -> list[dict]:
    """`ls --json` rows: step, state, path, bytes, evidence {kind: status}, reasons."""
    out = []
    evidence = ledger.evidence_summary()
    for r in ledger.checkpoints():
        ev = evidence.get(r["step"], {})
        out.append(
            {
                "step": r["step"],
                "state": r["state"],
                "path": r["path"],
                "bytes": r["bytes"],
                "evidence": {k: v["status"] for k, v in ev.items()},
                "reasons": r["reasons"] or [],
                "run_id": r["run_id"],
                "committed": r["committed"],
                "checked": {k: {"by": v.get("source"), "at": v.get("recorded")} for k, v in ev.items()},
            }
        )
    return out


def list_checkpoints(root) -> tuple[list[dict], str | None]:
    """(`ls --json` rows, None) from the ledger; when the ledger cannot be read now (locked beyond the reader's
    busy timeout, corrupt, WAL on a network filesystem), (rows from the manifests and the journal, why), so
    that restart tooling never blocks on the ledger (disk_view.py)."""
    import sqlite3

    from scout_ckpt.errors import LedgerUnavailable
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.ops import disk_view

    try:
        with Ledger.open(root, readonly=True) as ledger:
            return checkpoint_rows(ledger), None
    except LedgerUnavailable as e:
        why = str(e)
    except sqlite3.DatabaseError as e:
        why = f"ledger unreadable ({type(e).__name__}: {e})"
    return disk_view.checkpoint_rows(root), why


def as_listed(rows: list[dict]) -> list[dict]:
    """The durable rows as `ls --json` lists them: each with its tier, beside the local tier's rows, and its
    evidence level (ops/adopt_step.evidence_level: a scout-ckpt save's, or adopted on foreign evidence)."""
    from scout_ckpt.ops.adopt_step import evidence_level

    return [{**r, "tier": "durable", "evidence_level": evidence_level(r.get("evidence") or {})} for r in rows]


def checked_text(checked: dict | None, now: float) -> str:
    """When a piece of evidence was last checked and by whom: "save 3 min ago", "certify 2 h ago"."""
    if not checked or not checked.get("at"):
        return "-"
    age = max(0.0, now - checked["at"])
    for unit, secs in (("d", 86400), ("h", 3600), ("min", 60)):
        if age >= secs:
            return f"{checked.get('by') or '?'} {age / secs:.0f} {unit} ago"
    return f"{checked.get('by') or '?'} {age:.0f} s ago"


def evidence_marks(evidence: dict[str, str]) -> str:
    """{"bytes": "pass", "replay": "missing"} -> "bytes✓ replay…"."""
    return " ".join(f"{k}{STATUS_MARK.get(v, '?')}" for k, v in sorted(evidence.items())) or "-"


def reason_text(reasons: list[dict]) -> str:
    """One line for a list of reasons: code(file/target/check; missing: ...)[ranks ...], deduplicated."""
    parts: list[str] = []
    for r in reasons:
        extra = ",".join(str(r[k]) for k in ("file", "target", "check", "metric") if r.get(k))
        if r.get("code") == "requirement_not_met":  # which evidence fell short, and how
            extra += f"{r.get('kind')} {r.get('status')}"
        if r.get("event") is not None:  # health_fault / desync: which ledger event decided
            extra += (";" if extra else "") + f"event {r['event']}"
        for k in ("missing", "awaiting"):
            if r.get(k):
                extra += (";" if extra else "") + f"{k}: " + ",".join(map(str, r[k]))
        ranks = r.get("ranks") or ([r["rank"]] if r.get("rank") is not None else [])
        s = r["code"] + (f"({extra})" if extra else "") + (f"[ranks {','.join(map(str, ranks))}]" if ranks else "")
        if s not in parts:
            parts.append(s)
    return "; ".join(parts)


def detail_text(detail: dict) -> str:
    """A person's reading of an event's detail: `key: value` pairs, lists and nested records spelled out, no
    JSON punctuation (the --json document keeps the structure)."""

    def value(v, key: str = "") -> str:
        if isinstance(v, dict):
            return "; ".join(
                f"{k.replace('_', ' ')} {value(x, k)}" if x is not True else str(k)
                for k, x in v.items()
                if x is not None and x is not False and not _noise(k, x)
            )
        if isinstance(v, (list, tuple)):
            if v and all(isinstance(x, dict) and "rank" in x for x in v):  # one record per rank: one clause each
                return " | ".join(f"rank {x['rank']}: " + value({k: y for k, y in x.items() if k != "rank"}) for x in v)
            return ", ".join(value(x, key) for x in v) or "none"
        if isinstance(v, float):
            if _is_time(key, v):
                return time_text(v)
            if key.endswith("_s"):
                return duration_text(v)
            return f"{v:.3g}"
        return str(v)

    parts = [
        str(k).replace("_", " ") if v is True else f"{str(k).replace('_', ' ')}: {value(v, str(k))}"
        for k, v in detail.items()
        if v is not None and v is not False and not _noise(str(k), v)
    ]
    return "; ".join(parts) or "-"


def _is_time(key: str, v: float) -> bool:
    """A recorded wall time (seconds since the epoch) rather than a measure."""
    return v > 1e9 and (
        key in ("time", "wall", "last_heartbeat", "t_update", "t_start", "t_cseq") or key.endswith(("_at", "_time"))
    )


def _noise(key: str, v) -> bool:
    """Fields that say nothing to a person: an all-zero fingerprint (no traced collective yet)."""
    return key == "fp" and isinstance(v, str) and set(v) <= {"0"}


def duration_text(s: float) -> str:
    """0.42 -> "0.42 s", 75 -> "1 min 15 s", 7300 -> "2 h 1 min"."""
    if s < 60:
        return f"{s:.3g} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"


def explain_lines(out: dict, where: str, now: float, escape: Callable[[str], str]) -> list[str]:
    """`explain`'s text (rich markup, one string a line) from `operator.explain`'s document: the state and where
    it lies, what the policy requires, each piece of evidence with when and by whom it was checked, its reasons
    and replay coverage, the row's reasons and the events. `escape` quotes recorded text for the markup (the CLI
    passes rich's: this module stays free of rich)."""
    step, state = out["step"], out["state"]
    lines = [f"step {step}: [{STATE_STYLE.get(state, 'white')}]{state}[/]  ({where})"]
    required = (out["policy"] or {}).get("require", [])
    if required:
        lines.append(f"policy requires: {', '.join(required)}")
    for kind, item in out["evidence"].items():
        status = item.get("status")
        checked = checked_text({"by": item.get("source"), "at": item.get("recorded")}, now)
        lines.append(f"  {kind:<11} {status:<15} " + (f"[dim]checked by {checked}[/]" if checked != "-" else ""))
        for r in item.get("reasons") or []:
            lines.append(f"      - {escape(reason_text([r]))}")
            for said in ([r["detail"]] if isinstance(r.get("detail"), str) else []) + (
                [f"not vouched for: {'; '.join(map(str, r['state']))}"] if isinstance(r.get("state"), list) else []
            ):
                lines.append(f"        {escape(said)}")  # what --json holds: why, and which state (single owner)
        for key, label in (("vouched_by", "vouched for by"), ("not_used", "not used")):  # adopt's bytes evidence
            if item.get(key):
                lines.append(f"      {label}: {escape(str(item[key]))}")
        if item.get("live_checked_ranks") is not None:
            lines.append(
                f"      live step checked: rank(s) {ranks_text(item['live_checked_ranks'])}"
                + (f" ({item['live_rotation']})" if item.get("live_rotation") else "")
            )
        cov = item.get("coverage")
        after = item.get("confirmed_after") or {}
        disagreed: dict = {}
        for r in item.get("reasons") or []:
            if r.get("code") in ("replay_sdc", "replay_inconclusive") and r.get("target"):
                disagreed.setdefault(r["target"], r)
        if isinstance(cov, dict):
            for target, last in cov.items():
                text = f"clean at step {last}" if last is not None else "NOT COVERED"
                if target in disagreed:
                    r = disagreed[target]
                    who = ranks_text(r.get("ranks") or [])
                    text = (
                        f"replicas DISAGREED at step {r.get('step')}: "
                        + (
                            f"rank(s) {who} computed differently from the majority"
                            if r["code"] == "replay_sdc"
                            else f"no strict majority among ranks {who}, no rank can be blamed"
                        )
                        + ("; the replays agree with each other, not with the live step" if r.get("live_step") else "")
                        + (f"; clean before at step {last}" if last is not None else "")
                    )
                    lines.append(f"      {target:<14} {text}")
                    continue
                if target in after:
                    if after[target] is None:
                        text += ", awaiting its first replay after the save"
                    elif after[target] != last:
                        text += f", clean again at step {after[target]} (after the save)"
                lines.append(f"      {target:<14} {text}")
    if out["reasons"]:
        lines.append(f"reasons: {escape(reason_text(out['reasons']))}")
    for e in out["events"]:
        lines.append(escape(f"event: {e['kind']} ranks {e['ranks']}: {detail_text(e['detail'])}"))
    lines.append("[dim]bytes and invariants as last checked; `scout-ckpt certify ROOT --step N` re-checks them now[/]")
    return lines


def time_text(t: float | None) -> str:
    """A recorded time as local "YYYY-MM-DD HH:MM:SS", or "-"."""
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def ranks_text(ranks: list[int]) -> str:
    """ "0,3", "-" for none, the first 8 and the count beyond that."""
    if not ranks:
        return "-"
    if len(ranks) > 8:
        return f"{','.join(map(str, ranks[:8]))},… ({len(ranks)})"
    return ",".join(map(str, ranks))
