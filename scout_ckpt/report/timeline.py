"""The fault timeline: what went wrong, on which ranks, at which steps.

Faults reach the ledger by several roads: the observer writes `events` rows (hang, straggler, crash, desync,
health, sdc), the replay runner writes `replays` rows, and the save path records verdicts whose reasons name
attributed ranks or an interrupted save. `timeline` folds all of them into one list of events so that an operator
reads one story, not four tables. Read-only: it never writes the ledger, and it never imports torch (the CLI's
`report` runs on machines where a 1.4 s torch import would dominate). The picture and the HTML page are drawn by
report/page.py (matplotlib imported only there, only when drawing); `render_html`, `render_png`, `render_svg` and
`write_html` are re-exported here for callers of `report.write_html`.
"""

from __future__ import annotations

import os
from typing import Any

from rich.markup import escape
from rich.table import Table

from scout_ckpt.ledger import Ledger, tiers
from scout_ckpt.ops.views import detail_text, ranks_text, time_text
from scout_ckpt.report.page import (  # noqa: F401  (re-exported: the page and its styles)
    DRAW_ORDER,
    KIND_STYLE,
    MAX_RANK_LANES,
    OTHER_STYLE,
    STATE_STYLE,
    render_html,
    render_png,
    render_svg,
    write_html,
)
from scout_ckpt.report.sentences import event_sentence

KINDS = ("sdc", "divergence", "hang", "straggler", "crash", "desync", "health", "live_fault", "corrupt_file")
# a checkpoint's bytes found damaged on disk (by certify, resume or a job's load): an event of the storage
BYTES_CODES = ("digest_mismatch", "truncated_file", "size_mismatch", "missing_file", "unexpected_file")
SDC_REASONS = ("consensus_attributed", "invariant_failed")
INTERRUPTED = "save_interrupted"


# ---- the timeline ------------------------------------------------------------------------------------------


def _ranks(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (int, float)):
        return [int(v)]
    return sorted({int(r) for r in v})


def _reason_ranks(reason: dict) -> list[int]:
    return _ranks(reason.get("ranks", reason.get("rank")))


def _checkpoint_time(c: dict) -> float | None:
    return c.get("committed") or c.get("updated") or c.get("started")


def _state_label(c: dict) -> str:
    """The checkpoint's state, with interrupted saves told apart from rejected ones (the picture draws them
    hollow, like a save still in flight: there is no state on disk to judge)."""
    codes = {r.get("code") for r in c.get("reasons") or [] if isinstance(r, dict)}
    if INTERRUPTED in codes and c["state"] in ("rejected", "writing"):
        return "interrupted"
    return c["state"]


def _event(
    kind: str,
    ranks: list[int],
    step: int | None,
    when: float | None,
    detail: dict,
    source: str,
    run_id: str | None = None,
    **extra,
) -> dict:
    return {
        "kind": kind,
        "ranks": ranks,
        "step": step,
        "time": when,
        "detail": detail,
        "source": source,
        "run_id": run_id,
        **extra,
    }


def timeline(ledger: Ledger | str | os.PathLike) -> dict:
    """Every fault of a run's ledger as one time-ordered list, plus the checkpoints and runs to draw them against.

    `ledger` is an open Ledger or a ROOT (opened read-only). Shape (the `report --json` document):
    {"events": [{"kind", "ranks", "step", "time", "detail", "source", "run_id"}], "checkpoints": [{"step",
    "state", "time", "run_id", "reasons"}], "runs": [...], "summary": {kind: count}}.
    """
    if not isinstance(ledger, Ledger):
        with Ledger.open(ledger, readonly=True) as opened:
            return timeline(opened)

    events: list[dict] = []
    interrupted_events: list[dict] = []
    for e in ledger.events():
        if e["kind"] == INTERRUPTED:  # the save path's own record: reported as a crash below unless one exists
            interrupted_events.append(e)
            continue
        detail = e.get("detail") if isinstance(e.get("detail"), dict) else {}
        events.append(
            _event(
                e["kind"],
                _ranks(e.get("ranks")),
                e.get("step"),
                e.get("time"),
                detail,
                "events",
                e.get("run_id"),
                event_id=e.get("id"),
            )
        )

    # sdc findings already told, by (step, ranks) -> targets named (None: the whole state). A replay row is a
    # repeat when an sdc event of its step and ranks names its target or no target at all.
    sdc_told: dict[tuple, set] = {}
    for e in events:
        if e["kind"] == "sdc":
            sdc_told.setdefault((e["step"], tuple(e["ranks"])), set()).add(e["detail"].get("target"))
    # a divergence (every rank failed the invariant) already tells each rank's invariant failure at that step
    diverged = {e["step"] for e in events if e["kind"] == "divergence"}

    for r in ledger.replays():
        if r.get("status") not in ("ATTRIBUTED", "INCONCLUSIVE"):
            continue
        ranks = _ranks(r.get("ranks"))
        told = sdc_told.setdefault((r["step"], tuple(ranks)), set())
        if None in told or r.get("target") in told:
            continue
        told.add(r.get("target"))
        detail = {"recipe": r.get("recipe"), "target": r.get("target"), **(r.get("detail") or {})}
        if r["status"] == "INCONCLUSIVE":
            detail["inconclusive"] = True
        events.append(
            _event("sdc", ranks, r["step"], r.get("time"), detail, "replay", r.get("run_id"), replay_id=r.get("id"))
        )

    # Checkpoint verdicts: attributed ranks and interrupted saves.
    checkpoints = ledger.checkpoints()
    crash_steps = {e["step"] for e in events if e["kind"] == "crash"}
    interrupted: dict[int, dict] = {}
    for c in checkpoints:
        for reason in c.get("reasons") or []:
            if not isinstance(reason, dict):
                continue
            code = reason.get("code")
            if code in SDC_REASONS:
                if code == "invariant_failed" and c["step"] in diverged:
                    continue
                ranks = _reason_ranks(reason)
                if sdc_told.get((c["step"], tuple(ranks))):
                    continue
                sdc_told[(c["step"], tuple(ranks))] = {None}
                detail = {
                    "reason": code,
                    "state": c["state"],
                    **{k: v for k, v in reason.items() if k not in ("code", "ranks", "rank")},
                }
                events.append(
                    _event("sdc", ranks, c["step"], _checkpoint_time(c), detail, "checkpoint", c.get("run_id"))
                )
            elif code in BYTES_CODES:
                events.append(
                    _event(
                        "corrupt_file",
                        _reason_ranks(reason),
                        c["step"],
                        c.get("updated") or _checkpoint_time(c),
                        {
                            "reason": code,
                            "state": c["state"],
                            **{k: v for k, v in reason.items() if k not in ("code", "ranks", "rank")},
                        },
                        "checkpoint",
                        c.get("run_id"),
                    )
                )
            elif code == INTERRUPTED and c["step"] not in interrupted:
                interrupted[c["step"]] = {
                    "ranks": _reason_ranks(reason),
                    "time": c.get("updated") or c.get("started"),
                    "run_id": c.get("run_id"),
                    "detail": {k: v for k, v in reason.items() if k not in ("code", "ranks")},
                }
    # a save interrupted by a crash and saved again by the next generation: the row is certified now, its
    # history keeps the interrupted attempt (without an observer that is the only record of the crash)
    attempts = _attempts(ledger, checkpoints)
    for a in attempts:
        if a.get("label") == "interrupted" and a["step"] not in interrupted:
            interrupted[a["step"]] = {
                "ranks": [],
                "time": a.get("updated") or a.get("time"),
                "run_id": a.get("run_id"),
                "detail": {"attempt": a.get("attempt")},
            }
    for e in interrupted_events:
        interrupted.setdefault(
            e.get("step"),
            {
                "ranks": _ranks(e.get("ranks")),
                "time": e.get("time"),
                "run_id": e.get("run_id"),
                "detail": e.get("detail") or {},
            },
        )
    # a save the observer's abort interrupted is that incident's consequence, not a second fault: the run's end is
    # told by the hang or desync that ended it (the attempt stays in `attempts`, labelled interrupted)
    aborted_runs = {e["run_id"] for e in events if e.get("run_id") and e["kind"] != "crash" and _ended_by(e)}
    for step, info in interrupted.items():
        if step in crash_steps or (info["run_id"] and info["run_id"] in aborted_runs):
            continue
        events.append(
            _event(
                "crash",
                info["ranks"],
                step,
                info["time"],
                {INTERRUPTED: True, **info["detail"]},
                "checkpoint",
                info["run_id"],
            )
        )

    events.sort(
        key=lambda e: (
            e["time"] if e["time"] is not None else float("-inf"),
            e["step"] if e["step"] is not None else -1,
            e["kind"],
        )
    )
    summary: dict[str, int] = {}
    hosts: dict[str | None, dict[int, str]] = {}
    for e in events:
        summary[e["kind"]] = summary.get(e["kind"], 0) + 1
        if e.get("run_id") not in hosts:
            hosts[e.get("run_id")] = {
                p["rank"]: p["host"] for p in ledger.rank_places(e.get("run_id")) if p.get("host")
            }
        e["summary"] = event_sentence(e, hosts[e.get("run_id")])
        if isinstance(e["detail"].get("reason"), str):  # the observer's own account first among the fields
            e["detail"] = {"reason": e["detail"]["reason"], **e["detail"]}
    return {
        "events": events,
        "checkpoints": [
            {
                "step": c["step"],
                "state": c["state"],
                "label": _state_label(c),
                "time": _checkpoint_time(c),
                "run_id": c.get("run_id"),
                "reasons": [r.get("code") for r in c.get("reasons") or [] if isinstance(r, dict)],
            }
            for c in checkpoints
        ],
        "attempts": attempts,
        "runs": _runs(ledger.runs(), attempts, events),
        "summary": summary,
        "local": local_summary(ledger),
    }


def local_summary(ledger: Ledger) -> dict:
    """The fast tier's saves: {"saves": rows of the local tier (one per step: a step saved again by a later
    incarnation counts once, with its newest save), "states": {state: count}, "rejected": local steps now
    rejected (at save, or when a restart re-verified them), "rejected_at_restart": `local_rejected` events,
    "steps": [{"step", "state", "time", "run_id", "reasons"}]}. A step retention removed is `deleted`, whatever
    its verdict was (the row keeps retention's reason)."""
    rows = sorted(tiers.rows(ledger), key=lambda r: r["step"])
    states: dict[str, int] = {}
    for r in rows:
        states[r["state"]] = states.get(r["state"], 0) + 1
    return {
        "saves": len(rows),
        "states": states,
        "rejected": states.get("rejected", 0),
        "rejected_at_restart": len(ledger.events(kinds=("local_rejected",))),
        "steps": [
            {
                "step": r["step"],
                "state": r["state"],
                "time": r.get("committed"),
                "run_id": r.get("run_id"),
                "reasons": [x.get("code") for x in r.get("reasons") or [] if isinstance(x, dict)],
            }
            for r in rows
        ],
    }


def local_text(local: dict | None) -> str | None:
    """One sentence for the report's caption: how many local saves, in which states, how many rejected."""
    if not local or not local.get("saves"):
        return None
    states = ", ".join(f"{n} {s}" for s, n in sorted(local["states"].items()))
    again = local.get("rejected_at_restart") or 0
    return (
        f"Local tier: {local['saves']} step(s) saved ({states}); {local['rejected']} now rejected; "
        f"{again} rejection(s) when a restart re-verified the files (event local_rejected)."
    )


def _attempt_label(state: str, reasons: list) -> str:
    codes = {r.get("code") for r in reasons or [] if isinstance(r, dict)}
    return "interrupted" if INTERRUPTED in codes and state in ("rejected", "writing") else state


def _attempts(ledger: Ledger, checkpoints: list[dict]) -> list[dict]:
    """Every save attempt of every step, oldest first: {"step", "attempt", "state", "label", "time", "run_id",
    "current"}. A step saved again after a walk-back has several; only the newest is the checkpoint on disk.
    History rows carry their attempt id (ledger schema v2); older ledgers give one attempt per step."""
    current = {c["step"]: c for c in checkpoints}
    runs = {r["id"].rsplit("-", 1)[-1]: r["id"] for r in ledger.runs()}
    out: dict[tuple, dict] = {}
    for h in ledger.certifications():
        if h.get("outcome") not in (None, "applied"):
            continue  # a verdict that lost a race was never the attempt's state
        key = (h["step"], h.get("attempt") or (current.get(h["step"]) or {}).get("attempt"))
        entry = out.setdefault(key, {"step": h["step"], "attempt": key[1], "time": h.get("time")})
        entry.update(state=h["state"], label=_attempt_label(h["state"], h.get("reasons")), updated=h.get("time"))
    for c in checkpoints:  # rows with no history yet (a save in flight)
        key = (c["step"], c.get("attempt"))
        if key not in out:
            out[key] = {
                "step": c["step"],
                "attempt": c.get("attempt"),
                "time": _checkpoint_time(c),
                "state": c["state"],
                "label": _state_label(c),
                "updated": _checkpoint_time(c),
            }
    rows = sorted(out.values(), key=lambda a: (a["step"], a["time"] or 0.0))
    for a in rows:
        cur = current.get(a["step"]) or {}
        a["current"] = a["attempt"] == cur.get("attempt") or a is [b for b in rows if b["step"] == a["step"]][-1]
        a["run_id"] = cur.get("run_id") if a["current"] else runs.get(str(a["attempt"]).split("-")[0])
    return rows


def _ended_by(e: dict) -> bool:
    """An event that ended its run's generation: a crash, or an incident the observer aborted the job for."""
    return e["kind"] == "crash" or (e["kind"] in ("hang", "desync") and e["detail"].get("action") == "abort")


def _runs(runs: list[dict], attempts: list[dict], events: list[dict]) -> list[dict]:
    """Each incarnation of the job: where it resumed from, the steps it saved, and where it died if it did
    (`died`: the event that ended it, its step and time; `end_step`: where its bar in the picture ends, the
    step it died at when that is past its last save)."""
    out = []
    for r in runs:
        steps = [a["step"] for a in attempts if a.get("run_id") == r["id"]]
        last = max(steps) if steps else None
        ends = [e for e in events if e.get("run_id") == r["id"] and _ended_by(e)]
        died = None
        if ends:  # the first such event: what follows it (a teardown's victims, a settled crash) is its consequence
            e = min(ends, key=lambda e: e["time"] if e["time"] is not None else float("inf"))
            died = {"kind": e["kind"], "step": e["step"], "time": e["time"], "ranks": e["ranks"]}
        candidates = [x for x in (last, died and died["step"]) if x is not None]
        out.append(
            {
                "id": r["id"],
                "started": r.get("started"),
                "world_size": r.get("world_size"),
                "resumed_from": r.get("resumed_from"),
                "host": r.get("host"),
                "first_step": min(steps) if steps else None,
                "last_step": last,
                "died": died,
                "end_step": max(candidates) if candidates else None,
            }
        )
    return out


# ---- text ---------------------------------------------------------------------------------------------------


def render_table(tl: dict) -> Table:
    """The events as a rich Table (the CLI's plain output)."""
    counts = ", ".join(f"{k} {n}" for k, n in sorted(tl.get("summary", {}).items())) or "none"
    table = Table(title=f"fault timeline ({len(tl['events'])} events: {counts})", title_justify="left")
    for col, kw in (
        ("time", {}),
        ("kind", {"style": "bold"}),
        ("step", {"justify": "right"}),
        ("ranks", {}),
        ("detail", {"overflow": "fold"}),
    ):
        table.add_column(col, **kw)
    for e in tl["events"]:
        said = e.get("summary")
        fields = detail_text(e["detail"])
        table.add_row(
            time_text(e["time"]),
            e["kind"],
            "-" if e["step"] is None else str(e["step"]),
            ranks_text(e["ranks"]),
            f"{escape(said)}\n[dim]{escape(fields)}[/]" if said else escape(fields),
        )
    restarts = [r for r in tl.get("runs") or [] if r.get("resumed_from") is not None]
    runs = tl.get("runs") or []
    if runs:
        said = [f"{len(runs)} run(s)"] + [
            f"run {i + 1} started {time_text(r.get('started'))}"
            + (f", resumed from step {r['resumed_from']}" if r in restarts else "")
            for i, r in enumerate(runs)
            if i > 0
        ]
        table.caption, table.caption_justify = "; ".join(said), "left"
    local = local_text(tl.get("local"))
    if local:
        table.caption = (f"{table.caption}. " if table.caption else "") + local
        table.caption_justify = "left"
    return table
