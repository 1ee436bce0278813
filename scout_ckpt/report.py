"""The fault timeline: what went wrong, on which ranks, at which steps.

Faults reach the ledger by several roads: the observer writes `events` rows (hang, straggler, crash, desync,
health, sdc), the replay runner writes `replays` rows, and the save path records verdicts whose reasons name
attributed ranks or an interrupted save. `timeline` folds all of them into one list of events so that an operator
reads one story, not four tables. Read-only: it never writes the ledger, and it never imports torch (the CLI's
`report` runs on machines where a 1.4 s torch import would dominate). matplotlib is imported only by `write_html`.
"""

from __future__ import annotations

import base64
import html
import io
import os
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from scout_ckpt.layout import atomic_write_bytes
from scout_ckpt.ledger import Ledger
from scout_ckpt.views import detail_text

KINDS = ("sdc", "hang", "straggler", "crash", "desync", "health")
SDC_REASONS = ("consensus_attributed", "invariant_failed")
INTERRUPTED = "save_interrupted"

# Picture styles. States as the brief of the report fixes them; kinds each get a marker shape and a colour.
STATE_STYLE = {  # state -> (face colour, edge colour)
    "certified": ("#2ca02c", "#1b651b"),
    "committed": ("#8c8c8c", "#555555"),
    "rejected": ("#d62728", "#8b1a1a"),
    "quarantined": ("#ff7f0e", "#b35900"),
    "deleted": ("#e6e6e6", "#bdbdbd"),
    "writing": ("none", "#333333"),
    "interrupted": ("none", "#d62728"),
}
KIND_STYLE = {  # kind -> (marker, colour)
    "sdc": ("X", "#d62728"),
    "hang": ("s", "#9467bd"),
    "straggler": (">", "#8c564b"),
    "crash": ("P", "#111111"),
    "desync": ("D", "#1f77b4"),
    "health": ("^", "#bcbd22"),
}
OTHER_STYLE = ("*", "#7f7f7f")
DRAW_ORDER = ("deleted", "writing", "committed", "certified", "interrupted", "quarantined", "rejected")
MAX_RANK_LANES = 32  # beyond this, only ranks that have events get a lane


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


def _event(kind: str, ranks: list[int], step: int | None, when: float | None, detail: dict, source: str,
           run_id: str | None = None, **extra) -> dict:
    return {"kind": kind, "ranks": ranks, "step": step, "time": when, "detail": detail, "source": source,
            "run_id": run_id, **extra}


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
        events.append(_event(e["kind"], _ranks(e.get("ranks")), e.get("step"), e.get("time"), detail, "events",
                             e.get("run_id"), event_id=e.get("id")))

    # sdc findings already told, by (step, ranks) -> targets named (None: the whole state). A replay row is a
    # repeat when an sdc event of its step and ranks names its target or no target at all.
    sdc_told: dict[tuple, set] = {}
    for e in events:
        if e["kind"] == "sdc":
            sdc_told.setdefault((e["step"], tuple(e["ranks"])), set()).add(e["detail"].get("target"))

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
        events.append(_event("sdc", ranks, r["step"], r.get("time"), detail, "replay", r.get("run_id"),
                             replay_id=r.get("id")))

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
                ranks = _reason_ranks(reason)
                if sdc_told.get((c["step"], tuple(ranks))):
                    continue
                sdc_told[(c["step"], tuple(ranks))] = {None}
                detail = {"reason": code, "state": c["state"],
                          **{k: v for k, v in reason.items() if k not in ("code", "ranks", "rank")}}
                events.append(_event("sdc", ranks, c["step"], _checkpoint_time(c), detail, "checkpoint",
                                     c.get("run_id")))
            elif code == INTERRUPTED and c["step"] not in interrupted:
                interrupted[c["step"]] = {"ranks": _reason_ranks(reason), "time": c.get("updated") or
                                          c.get("started"), "run_id": c.get("run_id"),
                                          "detail": {k: v for k, v in reason.items() if k not in ("code", "ranks")}}
    for e in interrupted_events:
        interrupted.setdefault(e.get("step"), {"ranks": _ranks(e.get("ranks")), "time": e.get("time"),
                                               "run_id": e.get("run_id"), "detail": e.get("detail") or {}})
    for step, info in interrupted.items():
        if step in crash_steps:
            continue
        events.append(_event("crash", info["ranks"], step, info["time"], {INTERRUPTED: True, **info["detail"]},
                             "checkpoint", info["run_id"]))

    attempts = _attempts(ledger, checkpoints)
    events.sort(key=lambda e: (e["time"] if e["time"] is not None else float("-inf"),
                               e["step"] if e["step"] is not None else -1, e["kind"]))
    summary: dict[str, int] = {}
    for e in events:
        summary[e["kind"]] = summary.get(e["kind"], 0) + 1
    return {
        "events": events,
        "checkpoints": [{"step": c["step"], "state": c["state"], "label": _state_label(c),
                         "time": _checkpoint_time(c), "run_id": c.get("run_id"),
                         "reasons": [r.get("code") for r in c.get("reasons") or [] if isinstance(r, dict)]}
                        for c in checkpoints],
        "attempts": attempts,
        "runs": _runs(ledger.runs(), attempts),
        "summary": summary,
    }


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
            out[key] = {"step": c["step"], "attempt": c.get("attempt"), "time": _checkpoint_time(c),
                        "state": c["state"], "label": _state_label(c), "updated": _checkpoint_time(c)}
    rows = sorted(out.values(), key=lambda a: (a["step"], a["time"] or 0.0))
    for a in rows:
        cur = current.get(a["step"]) or {}
        a["current"] = a["attempt"] == cur.get("attempt") or a is [b for b in rows if b["step"] == a["step"]][-1]
        a["run_id"] = cur.get("run_id") if a["current"] else runs.get(str(a["attempt"]).split("-")[0])
    return rows


def _runs(runs: list[dict], attempts: list[dict]) -> list[dict]:
    """Each incarnation of the job: where it resumed from and the steps it saved."""
    out = []
    for r in runs:
        steps = [a["step"] for a in attempts if a.get("run_id") == r["id"]]
        out.append({"id": r["id"], "started": r.get("started"), "world_size": r.get("world_size"),
                    "resumed_from": r.get("resumed_from"), "host": r.get("host"),
                    "first_step": min(steps) if steps else None, "last_step": max(steps) if steps else None})
    return out


# ---- text ---------------------------------------------------------------------------------------------------

def _fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _fmt_ranks(ranks: list[int]) -> str:
    if not ranks:
        return "-"
    if len(ranks) > 8:
        return f"{','.join(map(str, ranks[:8]))},… ({len(ranks)})"
    return ",".join(map(str, ranks))


def render_table(tl: dict) -> Table:
    """The events as a rich Table (the CLI's plain output)."""
    counts = ", ".join(f"{k} {n}" for k, n in sorted(tl.get("summary", {}).items())) or "none"
    table = Table(title=f"fault timeline ({len(tl['events'])} events: {counts})", title_justify="left")
    for col, kw in (("time", {}), ("kind", {"style": "bold"}), ("step", {"justify": "right"}), ("ranks", {}),
                    ("detail", {"overflow": "fold"})):
        table.add_column(col, **kw)
    for e in tl["events"]:
        table.add_row(_fmt_time(e["time"]), e["kind"], "-" if e["step"] is None else str(e["step"]),
                      _fmt_ranks(e["ranks"]), detail_text(e["detail"]))
    return table


# ---- the picture and the page ------------------------------------------------------------------------------

def _lanes(tl: dict) -> tuple[list[int], bool]:
    """The rank lanes to draw, and whether a 'job' lane is needed for events without ranks."""
    event_ranks = sorted({r for e in tl["events"] for r in e["ranks"]})
    world = max([r.get("world_size") or 0 for r in tl["runs"]] + [0])
    if world and world <= MAX_RANK_LANES:
        ranks = sorted(set(range(world)) | set(event_ranks))
    else:
        ranks = event_ranks
    return ranks, any(not e["ranks"] for e in tl["events"])


def _event_steps(tl: dict) -> list[float]:
    """x of each event: its step, or for an event without one, the step interpolated from checkpoint times."""
    import numpy as np

    known = sorted((c["time"], c["step"]) for c in tl["checkpoints"] if c["time"] is not None)
    xs = []
    for e in tl["events"]:
        if e["step"] is not None:
            xs.append(float(e["step"]))
        elif known and e["time"] is not None:
            xs.append(float(np.interp(e["time"], [t for t, _ in known], [s for _, s in known])))
        else:
            xs.append(0.0)
    return xs


def render_png(tl: dict) -> bytes:
    """The timeline picture: steps across, a checkpoint lane on top, one lane per rank below."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    ranks, job_lane = _lanes(tl)
    labels = ["checkpoints", "runs"] + (["job (no rank)"] if job_lane else []) + [f"rank {r}" for r in ranks]
    first_rank_lane = 2 + job_lane
    lane_of = {r: i + first_rank_lane for i, r in enumerate(ranks)}
    height = min(12.0, max(3.6, 2.2 + 0.32 * len(labels)))  # room for the legend
    fig, ax = plt.subplots(figsize=(12, height), dpi=100)
    try:
        by_label: dict[str, list[int]] = {}
        for c in tl["checkpoints"]:
            by_label.setdefault(c["label"], []).append(c["step"])
        # Dense runs overlap: draw thin ticks, and the states that matter last so they stay visible.
        many = len(tl["checkpoints"]) > 500
        order = [s for s in DRAW_ORDER if s in by_label] + sorted(set(by_label) - set(DRAW_ORDER))
        for label in order:
            steps = by_label[label]
            face, edge = STATE_STYLE.get(label, ("#ffffff", "#000000"))
            if many:
                ax.scatter(steps, [0] * len(steps), s=80, marker="|", c=edge if face == "none" else face,
                           linewidths=1.0, zorder=3)
            else:
                ax.scatter(steps, [0] * len(steps), s=60, marker="o", facecolors=face, edgecolors=edge,
                           linewidths=1.2, zorder=3)
        # Earlier attempts of a step (interrupted, rejected, then saved again) sit just above its checkpoint.
        earlier = [a for a in tl.get("attempts", []) if not a.get("current")]
        for k, a in enumerate(earlier):
            face, edge = STATE_STYLE.get(a["label"], ("#ffffff", "#000000"))
            ax.scatter([a["step"]], [-0.32], s=28, marker="o", facecolors=face, edgecolors=edge, linewidths=1.0,
                       zorder=3)
        # Each incarnation of the job as a bar from where it resumed to the last step it saved.
        for i, run in enumerate(tl["runs"]):
            start = run.get("resumed_from") or 0
            end = run.get("last_step")
            if end is None:
                end = start
            colour = "#1f77b4" if i % 2 == 0 else "#17becf"
            ax.plot([start, max(end, start + 0.01)], [1, 1], color=colour, linewidth=6, solid_capstyle="butt",
                    zorder=2, alpha=0.8)
            ax.scatter([start], [1], marker="|", s=120, c=colour, zorder=2)
            ax.annotate(f"run {i + 1}" + (f" from {run['resumed_from']}" if run.get("resumed_from") else ""),
                        (start, 1), xytext=(2, 7), textcoords="offset points", fontsize=7, color="#333333")
        xs = _event_steps(tl)
        points: dict[str, tuple[list[float], list[float]]] = {}
        for x, e in zip(xs, tl["events"]):
            lanes = [lane_of[r] for r in e["ranks"] if r in lane_of] or [2]  # no ranks: the job lane
            px, py = points.setdefault(e["kind"], ([], []))
            px.extend([x] * len(lanes))
            py.extend(lanes)
        for kind, (px, py) in points.items():
            marker, colour = KIND_STYLE.get(kind, OTHER_STYLE)
            ax.scatter(px, py, s=70, marker=marker, c=colour, zorder=4, edgecolors="white", linewidths=0.5)
        for run in tl["runs"]:
            if run.get("resumed_from") is not None:
                ax.axvline(run["resumed_from"], color="#1f77b4", linestyle="--", linewidth=0.8, zorder=1)

        ax.set_yticks(range(len(labels)), labels)
        ax.set_ylim(len(labels) - 0.5, -0.6)
        ax.set_xlabel("step")
        ax.grid(axis="x", color="#eeeeee", zorder=0)
        for y in range(len(labels)):
            ax.axhline(y, color="#f2f2f2", linewidth=0.8, zorder=0)
        if not tl["checkpoints"] and not tl["events"]:
            ax.set_xlim(0, 1)
            ax.text(0.5, (len(labels) - 1) / 2, "no checkpoints and no events recorded", ha="center",
                    va="center", color="#777777")

        handles = [Line2D([], [], linestyle="", marker="o", markersize=8, markerfacecolor=STATE_STYLE[s][0],
                          markeredgecolor=STATE_STYLE[s][1], label=s) for s in STATE_STYLE]
        kinds = list(KIND_STYLE) + sorted(k for k in points if k not in KIND_STYLE)
        handles += [Line2D([], [], linestyle="", marker=KIND_STYLE.get(k, OTHER_STYLE)[0], markersize=8,
                           color=KIND_STYLE.get(k, OTHER_STYLE)[1], label=k) for k in kinds]
        if any(r.get("resumed_from") is not None for r in tl["runs"]):
            handles.append(Line2D([], [], color="#1f77b4", linestyle="--", label="restart (resumed from)"))
        if earlier:
            handles.append(Line2D([], [], linestyle="", marker="o", markersize=5, markerfacecolor="none",
                                  markeredgecolor="#333333", label="earlier attempt (above)"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        ax.set_title("scout-ckpt fault timeline", loc="left")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.k-sdc { color: #d62728; font-weight: bold; } .k-crash { font-weight: bold; }
.s-certified { color: #1b651b; } .s-rejected { color: #d62728; } .s-quarantined { color: #b35900; }
.s-deleted { color: #aaa; } img { max-width: 100%; }
"""


def _row(cells: list[tuple[str, str]]) -> str:
    return "<tr>" + "".join(f'<td class="{cls}">{html.escape(text)}</td>' for cls, text in cells) + "</tr>"


def render_html(tl: dict, title: str = "scout-ckpt fault timeline") -> str:
    """One self-contained page: the picture inline (base64 PNG), then the events and checkpoints tables."""
    png = base64.b64encode(render_png(tl)).decode()
    counts = ", ".join(f"{k}: {n}" for k, n in sorted(tl.get("summary", {}).items())) or "no fault events"
    ev_rows = "\n".join(_row([("", _fmt_time(e["time"])), (f"k-{e['kind']}", e["kind"]),
                              ("num", "-" if e["step"] is None else str(e["step"])),
                              ("", _fmt_ranks(e["ranks"])), ("", e["source"]),
                              ("", detail_text(e["detail"]))]) for e in tl["events"])
    tries: dict[int, list[str]] = {}
    for a in tl.get("attempts", []):
        tries.setdefault(a["step"], []).append(a["label"])
    ck_rows = "\n".join(_row([("num", str(c["step"])), (f"s-{c['state']}", c["label"]),
                              ("", _fmt_time(c["time"])), ("", c.get("run_id") or "-"),
                              ("", ", ".join(c["reasons"])),
                              ("", " then ".join(tries.get(c["step"], [])) if len(tries.get(c["step"], [])) > 1
                               else "1")]) for c in reversed(tl["checkpoints"]))
    run_rows = "\n".join(_row([("num", str(i + 1)), ("", r["id"]), ("", _fmt_time(r.get("started"))),
                               ("", r.get("host") or "-"), ("num", str(r.get("world_size") or "-")),
                               ("", "fresh start" if r.get("resumed_from") is None else f"step {r['resumed_from']}"),
                               ("", "-" if r.get("first_step") is None else f"{r['first_step']}..{r['last_step']}")])
                         for i, r in enumerate(tl["runs"]))
    n_ck = len(tl["checkpoints"])
    ck_open = "" if n_ck > 200 else " open"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_CSS}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>{len(tl['events'])} events ({html.escape(counts)}); {n_ck} checkpoints; {len(tl['runs'])} runs.
Generated {html.escape(_fmt_time(time.time()))}.</p>
<img alt="timeline: checkpoints by state and faults per rank" src="data:image/png;base64,{png}">
<h2>Events</h2>
<table><thead><tr><th>time</th><th>kind</th><th>step</th><th>ranks</th><th>source</th><th>detail</th></tr></thead>
<tbody>
{ev_rows or '<tr><td colspan="6">no events</td></tr>'}
</tbody></table>
<h2>Runs (incarnations of the job)</h2>
<table><thead><tr><th>#</th><th>run</th><th>started</th><th>host</th><th>ranks</th><th>resumed from</th>
<th>steps saved</th></tr></thead>
<tbody>
{run_rows or '<tr><td colspan="7">no runs</td></tr>'}
</tbody></table>
<h2>Checkpoints</h2>
<details{ck_open}><summary>{n_ck} checkpoints, newest first</summary>
<table><thead><tr><th>step</th><th>state</th><th>time</th><th>run</th><th>reasons</th><th>attempts</th></tr></thead>
<tbody>
{ck_rows or '<tr><td colspan="6">no checkpoints</td></tr>'}
</tbody></table></details>
</body></html>
"""


def write_html(tl: dict, path: str | os.PathLike) -> Path:
    """Write the page atomically (a reader never sees half a report)."""
    path = Path(path)
    atomic_write_bytes(path, render_html(tl).encode("utf-8"))
    return path
