"""What the demo reports after the job: read back from the ledger and the demo's own records, and printed.

Nothing here watches or restarts the job (torchrun's agent does that, launch.py starts it): this is the part
torchrun cannot do. The final `certify` re-verifies every committed checkpoint offline, so the on-disk bitflip of
`--inject bitflip` is caught there if no restart's load caught it first.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from scout_ckpt.demo.faults import MARKER_DIR, fired_records


def certify_committed(root: Path) -> list[dict]:
    """Re-verify every committed or certified checkpoint offline (what `scout-ckpt certify` does)."""
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.ops.certify import certify

    with Ledger.open(root, readonly=True) as ledger:
        steps = [c["step"] for c in ledger.checkpoints(states=("committed", "certified"))]
    return certify(root, steps=steps) if steps else []


def checkpoint_rows(root: Path) -> list[dict]:
    """The `ls --json` rows."""
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.ops.steps import steps, with_copies
    from scout_ckpt.ops.views import as_listed
    from scout_ckpt.ops.views import checkpoint_rows as rows

    with Ledger.open(root, readonly=True) as ledger:
        return with_copies(as_listed(rows(ledger)), steps(ledger, root))


def rejections(root: Path) -> list[dict]:
    """Every verdict of `rejected` in the ledger's history, including those a later re-save replaced (a
    bitflipped step caught at load time is re-saved by the restarted job)."""
    from scout_ckpt.ledger import Ledger

    with Ledger.open(root, readonly=True) as ledger:
        return [
            {
                "step": c["step"],
                "source": c["source"],
                "time": c["time"],
                "reasons": [r.get("code") for r in c["reasons"] or [] if isinstance(r, dict)],
            }
            for c in ledger.certifications()
            if c["state"] == "rejected"
        ]


def events(root: Path) -> list[dict]:
    from scout_ckpt.report.timeline import timeline

    return [
        {"kind": e["kind"], "ranks": e["ranks"], "step": e["step"], "time": e["time"], "detail": e["detail"]}
        for e in timeline(root)["events"]
    ]


def losses(root: Path) -> dict:
    """The loss per step, from the rank-0 logs; a step redone after a restart keeps its latest value."""
    by_step: dict[int, tuple[int, float]] = {}
    for path in sorted((root / MARKER_DIR).glob("log-gen*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by SIGKILL
            if "loss" in rec and (rec["step"] not in by_step or rec["generation"] >= by_step[rec["step"]][0]):
                by_step[rec["step"]] = (rec["generation"], rec["loss"])
    curve = [[s, by_step[s][1]] for s in sorted(by_step)]
    return {"first": curve[0][1] if curve else None, "last": curve[-1][1] if curve else None, "curve": curve}


def injections(root: Path, faults) -> list[dict]:
    fired: dict[str, list[dict]] = {}
    for rec in fired_records(root):
        fired.setdefault(rec["spec"], []).append(rec)
    return [{**f.to_json(), "fired": fired.get(f.spec, [])} for f in faults]


def print_summary(result: dict, console=None) -> None:
    """The human summary of a demo run: checkpoints, events, restarts, loss, final digest."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from scout_ckpt.ops.views import STATE_STYLE, evidence_marks, reason_text

    console = console or Console()
    table = Table(title=f"scout-ckpt demo: {result['ranks']} ranks, {result['steps']} steps ({result['mode']})")
    for col in ("step", "state", "evidence", "bytes", "reasons"):
        table.add_column(col, justify="right" if col in ("step", "bytes") else "left")
    for c in result["checkpoints"]:
        reasons = escape(reason_text(c["reasons"])) or "-"
        state = f"[{STATE_STYLE.get(c['state'], 'white')}]{c['state']}[/]"
        table.add_row(
            str(c["step"]), state, evidence_marks(c["evidence"]), f"{c['bytes']:,}" if c["bytes"] else "-", reasons
        )
    console.print(table)
    if result["events"]:
        ev_table = Table(title="events")
        for col in ("time", "kind", "ranks", "step", "detail"):
            ev_table.add_column(col)
        for e in result["events"]:
            when = datetime.datetime.fromtimestamp(e["time"]).strftime("%H:%M:%S") if e["time"] else "-"
            detail = {k: v for k, v in (e["detail"] or {}).items() if k not in ("log_tail", "progress")}
            ev_table.add_row(
                when,
                e["kind"],
                ",".join(map(str, e["ranks"] or [])) or "-",
                "-" if e["step"] is None else str(e["step"]),
                json.dumps(detail)[:70],
            )
        console.print(ev_table)
    for r in result.get("rejections", []):
        console.print(f"step {r['step']} rejected by {r['source']}: {', '.join(r['reasons']) or '?'}")
    losses = result["losses"]
    loss = f"{losses['first']:.3f} -> {losses['last']:.3f}" if losses["first"] is not None else "-"
    for f in result["injections"]:
        console.print(f"injected {f['spec']}: " + (f"fired {len(f['fired'])}x" if f["fired"] else "did not fire"))
    for g in result.get("generations", []):
        what = "completed" if g["outcome"] == "ok" else g["outcome"]
        if g["outcome"] != "ok":
            by = {
                "observer": "its observers",
                "previous_generation": "the next generation's observer",
                "checkpointer": "its save, which ended the generation",
            }
            ranks = ",".join(map(str, g["ranks"] or []))
            what += (
                f": {g['event']} "
                + (f"on rank(s) {ranks}" if ranks else "(no rank named)")
                + f" at step {g['step']}, recorded by {by.get(g['detected_by'], g['detected_by'])}"
                if g.get("event")
                else ": no incident recorded in the ledger"
            )
        start = f"resumed from step {g['resumed_from']}" if g.get("resumed_from") else "fresh start"
        console.print(f"generation {g['generation']} (torchrun restart {g['generation']}, {start}): {escape(what)}")
    limit = (result.get("launcher") or {}).get("max_restarts")
    of = f" (torchrun --max-restarts {limit})" if limit is not None else ""
    console.print(f"restarts: {result['restarts']}{of}    loss: {loss}    wall: {result['wall_s']:.1f} s")
    console.print(f"final digest: {result['final_digest'] or '(job did not complete)'}")
    console.print(f"dir: {result['dir']}")
