"""The fault timeline drawn: the picture (PNG or SVG, matplotlib) and the self-contained HTML page around it.

Why apart from report.py: report.py folds the ledger into the timeline document (the `report --json` shape) and
must stay cheap and importable without matplotlib or numpy; this module only draws a finished timeline dict and
never opens the ledger. matplotlib and numpy are imported when a picture is drawn, not before.
"""

from __future__ import annotations

import base64
import html
import io
import os
import time
from pathlib import Path

from scout_ckpt.format.layout import atomic_write_bytes
from scout_ckpt.ops.views import detail_text, ranks_text, time_text

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
    "live_fault": ("v", "#e377c2"),
    "divergence": ("h", "#ff7f0e"),
    "corrupt_file": ("d", "#7f7f7f"),
}
OTHER_STYLE = ("*", "#7f7f7f")
DRAW_ORDER = ("deleted", "writing", "committed", "certified", "interrupted", "quarantined", "rejected")
MAX_RANK_LANES = 32  # beyond this, only ranks that have events get a lane


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
    return _render(tl, "png")


def render_svg(tl: dict) -> bytes:
    """The same picture as SVG; its marks carry ids (`run-N`: run N's bar, `kind-K`: the events of kind K,
    `checkpoints-S`: the checkpoints in state S) so that what is drawn where can be read back."""
    return _render(tl, "svg")


_RUN_OFFSETS = (0.0, 0.22, -0.22, 0.11, -0.11)


def run_bar_ys(runs: list[dict]) -> list[float]:
    """The y of each run's bar in the runs lane: 1, or beside it when its steps overlap an earlier run's bar (two
    fresh starts at step 0 would otherwise draw one bar over the other)."""
    placed: list[tuple[float, float, int]] = []
    out = []
    for run in runs:
        start = run.get("resumed_from") or 0
        end = run.get("end_step", run.get("last_step"))
        end = start if end is None else end
        used = {lvl for s, e, lvl in placed if s <= end and start <= e}
        level = next(k for k in range(len(placed) + 1) if k not in used)
        placed.append((start, end, level))
        out.append(1 + _RUN_OFFSETS[level % len(_RUN_OFFSETS)])
    return out


def _render(tl: dict, fmt: str) -> bytes:
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
                ax.scatter(
                    steps,
                    [0] * len(steps),
                    s=80,
                    marker="|",
                    c=edge if face == "none" else face,
                    linewidths=1.0,
                    zorder=3,
                    gid=f"checkpoints-{label}",
                )
            else:
                ax.scatter(
                    steps,
                    [0] * len(steps),
                    s=60,
                    marker="o",
                    facecolors=face,
                    edgecolors=edge,
                    linewidths=1.2,
                    zorder=3,
                    gid=f"checkpoints-{label}",
                )
        # Earlier attempts of a step (interrupted, rejected, then saved again) sit just above its checkpoint.
        earlier = [a for a in tl.get("attempts", []) if not a.get("current")]
        for k, a in enumerate(earlier):
            face, edge = STATE_STYLE.get(a["label"], ("#ffffff", "#000000"))
            ax.scatter(
                [a["step"]], [-0.32], s=28, marker="o", facecolors=face, edgecolors=edge, linewidths=1.0, zorder=3
            )
        # Each incarnation of the job as a bar from where it resumed to where it ended: the step it died at
        # (a crash, an aborted hang) when it died past its last save, else the last step it saved.
        for i, (run, y) in enumerate(zip(tl["runs"], run_bar_ys(tl["runs"]))):
            start = run.get("resumed_from") or 0
            end = run.get("end_step", run.get("last_step"))
            if end is None:
                end = start
            colour = "#1f77b4" if i % 2 == 0 else "#17becf"
            ax.plot(
                [start, max(end, start + 0.01)],
                [y, y],
                color=colour,
                linewidth=6 if y == 1 else 4,
                solid_capstyle="butt",
                zorder=2,
                alpha=0.8,
                gid=f"run-{i + 1}",
            )
            ax.scatter([start], [y], marker="|", s=120, c=colour, zorder=2)
            ax.annotate(
                f"run {i + 1}" + (f" from {run['resumed_from']}" if run.get("resumed_from") else ""),
                (start, y),
                xytext=(2, 7),
                textcoords="offset points",
                fontsize=7,
                color="#333333",
            )
        xs = _event_steps(tl)
        points: dict[str, tuple[list[float], list[float]]] = {}
        for x, e in zip(xs, tl["events"]):
            lanes = [lane_of[r] for r in e["ranks"] if r in lane_of] or [2]  # no ranks: the job lane
            px, py = points.setdefault(e["kind"], ([], []))
            px.extend([x] * len(lanes))
            py.extend(lanes)
        for kind, (px, py) in points.items():
            marker, colour = KIND_STYLE.get(kind, OTHER_STYLE)
            ax.scatter(
                px, py, s=70, marker=marker, c=colour, zorder=4, edgecolors="white", linewidths=0.5, gid=f"kind-{kind}"
            )
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
            ax.text(
                0.5,
                (len(labels) - 1) / 2,
                "no checkpoints and no events recorded",
                ha="center",
                va="center",
                color="#777777",
            )

        # the legend names only what the picture shows
        drawn = {c.get("label") or c.get("state") for c in tl["checkpoints"]} | {
            a.get("label") or a.get("state") for a in tl.get("attempts") or []
        }
        handles = [
            Line2D(
                [],
                [],
                linestyle="",
                marker="o",
                markersize=8,
                markerfacecolor=STATE_STYLE[s][0],
                markeredgecolor=STATE_STYLE[s][1],
                label=s,
            )
            for s in STATE_STYLE
            if s in drawn
        ]
        kinds = [k for k in KIND_STYLE if k in points] + sorted(k for k in points if k not in KIND_STYLE)
        handles += [
            Line2D(
                [],
                [],
                linestyle="",
                marker=KIND_STYLE.get(k, OTHER_STYLE)[0],
                markersize=8,
                color=KIND_STYLE.get(k, OTHER_STYLE)[1],
                label=k,
            )
            for k in kinds
        ]
        if any(r.get("resumed_from") is not None for r in tl["runs"]):
            handles.append(Line2D([], [], color="#1f77b4", linestyle="--", label="restart (resumed from)"))
        if earlier:
            handles.append(
                Line2D(
                    [],
                    [],
                    linestyle="",
                    marker="o",
                    markersize=5,
                    markerfacecolor="none",
                    markeredgecolor="#333333",
                    label="earlier attempt (above)",
                )
            )
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        ax.set_title("scout-ckpt fault timeline", loc="left")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format=fmt, **({"metadata": {"Date": None}} if fmt == "svg" else {}))
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
    ev_rows = "\n".join(
        _row(
            [
                ("", time_text(e["time"])),
                (f"k-{e['kind']}", e["kind"]),
                ("num", "-" if e["step"] is None else str(e["step"])),
                ("", ranks_text(e["ranks"])),
                ("", e["source"]),
            ]
        )[:-5]
        + _detail_cell(e)
        + "</tr>"
        for e in tl["events"]
    )
    tries: dict[int, list[str]] = {}
    for a in tl.get("attempts", []):
        tries.setdefault(a["step"], []).append(a["label"])
    ck_rows = "\n".join(
        _row(
            [
                ("num", str(c["step"])),
                (f"s-{c['state']}", c["label"]),
                ("", time_text(c["time"])),
                ("", c.get("run_id") or "-"),
                ("", ", ".join(c["reasons"])),
                ("", " then ".join(tries.get(c["step"], [])) if len(tries.get(c["step"], [])) > 1 else "1"),
            ]
        )
        for c in reversed(tl["checkpoints"])
    )
    run_rows = "\n".join(
        _row(
            [
                ("num", str(i + 1)),
                ("", r["id"]),
                ("", time_text(r.get("started"))),
                ("", r.get("host") or "-"),
                ("num", str(r.get("world_size") or "-")),
                ("", "fresh start" if r.get("resumed_from") is None else f"step {r['resumed_from']}"),
                ("", "-" if r.get("first_step") is None else f"{r['first_step']}..{r['last_step']}"),
                ("", _ended_text(r.get("died"))),
            ]
        )
        for i, r in enumerate(tl["runs"])
    )
    n_ck = len(tl["checkpoints"])
    ck_open = "" if n_ck > 200 else " open"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_CSS}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>{len(tl["events"])} events ({html.escape(counts)}); {n_ck} checkpoints; {len(tl["runs"])} runs.
Generated {html.escape(time_text(time.time()))}.</p>
<img alt="timeline: checkpoints by state and faults per rank" src="data:image/png;base64,{png}">
<h2>Events</h2>
<table><thead><tr><th>time</th><th>kind</th><th>step</th><th>ranks</th><th>source</th><th>detail</th></tr></thead>
<tbody>
{ev_rows or '<tr><td colspan="6">no events</td></tr>'}
</tbody></table>
<h2>Runs (incarnations of the job)</h2>
<table><thead><tr><th>#</th><th>run</th><th>started</th><th>host</th><th>ranks</th><th>resumed from</th>
<th>steps saved</th><th>ended</th></tr></thead>
<tbody>
{run_rows or '<tr><td colspan="8">no runs</td></tr>'}
</tbody></table>
<h2>Checkpoints</h2>
<details{ck_open}><summary>{n_ck} checkpoints, newest first</summary>
<table><thead><tr><th>step</th><th>state</th><th>time</th><th>run</th><th>reasons</th><th>attempts</th></tr></thead>
<tbody>
{ck_rows or '<tr><td colspan="6">no checkpoints</td></tr>'}
</tbody></table></details>
</body></html>
"""


def _detail_cell(e: dict) -> str:
    """The event's one sentence, its recorded fields behind a disclosure."""
    fields = html.escape(detail_text(e["detail"]))
    said = e.get("summary")
    if not said:
        return f"<td>{fields}</td>"
    return f"<td>{html.escape(said)}<details><summary>fields</summary>{fields}</details></td>"


def _ended_text(died: dict | None) -> str:
    """How a run ended, for its row: where and when it died, or nothing recorded (a clean end, or still running)."""
    if not died:
        return "-"
    where = f" at step {died['step']}" if died.get("step") is not None else ""
    who = f" (rank {ranks_text(died['ranks'])})" if died.get("ranks") else ""
    return f"{died['kind'].replace('crash', 'died')}{where}{who}, {time_text(died.get('time'))}"


def write_html(tl: dict, path: str | os.PathLike) -> Path:
    """Write the page atomically (a reader never sees half a report)."""
    path = Path(path)
    atomic_write_bytes(path, render_html(tl).encode("utf-8"))
    return path
