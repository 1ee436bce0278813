"""The fleet commands: `suspects` (which devices to drain, and the evidence behind one) and `fleet import`.
Read from the fleet store (scout_ckpt/fleet/operator.py); `suspects` never writes and never imports torch.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from scout_ckpt.commands.output import console, emit, escape
from scout_ckpt.errors import BadInput
from scout_ckpt.fleet import operator
from scout_ckpt.fleet import suspects as rule

FORMATS = ("slurm", "k8s")


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def suspects(
    store: Path | None, since: str | None, min_score: float, as_json: bool, fmt: str | None, explain: str | None
) -> int:
    if fmt is not None and fmt not in FORMATS:
        raise BadInput(f"--format must be one of {', '.join(FORMATS)} (got {fmt!r})")
    if fmt is not None and (explain is not None or as_json):
        raise BadInput("--format prints drain commands: not with --explain or --json")
    if explain is not None:
        return _explain(store, explain, since, as_json)
    out = operator.suspects(store, since, min_score)
    if fmt is not None:  # printed, never run
        for line in (rule.slurm if fmt == "slurm" else rule.k8s)(out["suspects"]):
            print(line)
        return 0
    if as_json:
        emit(out)
        return 0
    from rich.table import Table

    table = Table(box=None, show_edge=False)
    for col in ("host", "local", "device", "class", "score", "jobs", "verdicts", "first seen", "last seen"):
        table.add_column(col)
    for s in out["suspects"]:
        kinds = ", ".join(f"{k} {sum(v.values())}" for k, v in s["verdicts"].items())
        table.add_row(
            escape(str(s["host"])),
            str(s["local_rank"]),
            escape(s["device"]),
            s["class"],
            f"{s['score']:g}",
            str(len(s["jobs"])),
            kinds,
            _when(s["first_seen"]),
            _when(s["last_seen"]),
        )
    con = console()
    if out["suspects"]:
        con.print(table)
    else:
        con.print("no suspect device" + (f" at score >= {min_score:g}" if min_score else ""))
    if out["not_hardware"]:
        con.print(
            f"{len(out['not_hardware'])} verdict(s) triaged not_hardware (reproduced on another rank): no device blamed"
        )
    return 0


def _explain(store: Path | None, device: str, since: str | None, as_json: bool) -> int:
    out = operator.explain(store, device, since)
    if as_json:
        emit(out)
        return 0
    con = console()
    for v in out["verdicts"]:
        con.print(
            f"{_when(v['time'])}  {v['kind']:<9} {v['class'] or 'untriaged':<11} step {v['step']}  rank "
            f"{v['rank']}  {escape(str(v['host']))}:{v['local_rank']}  job {escape(str(v['job']))}  "
            f"{escape(str(v['root']))}" + (f"  ({v['source']})" if v.get("source") else "")
        )
    return 0


def fleet_import(store: Path | None, roots: list[Path], as_json: bool) -> int:
    out = operator.import_roots(store, roots)
    if as_json:
        emit(out)
    else:
        for r in out["roots"]:
            print(f"{r['root']}: {r['added']} verdict record(s) added")
        print(f"fleet store {out['store']}: {out['added']} added")
    return 0
