"""The read-only commands: ls, explain, resume, report. They never write a ROOT and never import torch (a 1.4 s
import would dominate them; tests/test_cli.py::test_read_only_commands_do_not_import_torch runs each, and
tests/test_layers.py checks that nothing they import at module level imports it).

Each takes the command line's options and returns its exit code: 0, or 1 when the step asked about is not
certified or no certified checkpoint exists. A ledger that cannot be read is answered from the checkpoints'
manifests and the journal, with a warning on stderr and the same exit codes.
"""

from __future__ import annotations

import sqlite3
import sys
import time
from pathlib import Path

from scout_ckpt.commands.output import console, emit, escape, human_bytes
from scout_ckpt.errors import BadInput
from scout_ckpt.ledger.journal import JOURNAL_NAME
from scout_ckpt.ops import roots
from scout_ckpt.ops.adopt_step import evidence_level
from scout_ckpt.ops.aside_view import sentence as aside_sentence
from scout_ckpt.ops.steps import copies_text, steps_of, with_copies
from scout_ckpt.ops.steps import step_view as steps_view
from scout_ckpt.ops.steps import steps as all_steps
from scout_ckpt.ops.tier_views import copies_sentence, where_text
from scout_ckpt.ops.views import (
    STATE_STYLE,
    as_listed,
    checked_text,
    evidence_marks,
    explain_lines,
    list_checkpoints,
    reason_text,
    time_text,
)


def ls(root: Path, as_json: bool) -> int:
    rows, fallback = list_checkpoints(root)
    if fallback:  # exit code unchanged (0): the rows are what the manifests and the journal record
        print(
            f"scout-ckpt: warning: {fallback}; listed from the checkpoints' manifests and {JOURNAL_NAME}",
            file=sys.stderr,
        )
    local = [] if fallback else _local_rows(root)
    aside = [] if fallback else _aside_rows(root)
    rows = [{**r, "evidence_level": evidence_level(r.get("evidence") or {})} for r in rows]
    if as_json:
        views = [] if fallback else steps_of(root)
        emit(
            {
                "checkpoints": with_copies(as_listed(rows), views),
                "local": local,
                "set_aside": aside,
                "steps": views,
                "source": "manifests" if fallback else "ledger",
                "fallback": fallback,
                **(
                    {"local_note": "the local tier's steps are recorded in the ledger only: not listed"}
                    if fallback
                    else {}
                ),
            }
        )
        return 0
    from rich.table import Table

    t = Table(box=None, pad_edge=False)
    for h in ("step", "tier", "state", "evidence", "bytes checked", "size", "reasons", "where"):
        t.add_column(h, justify="right" if h in ("step", "size") else "left")
    now = time.time()
    merged = sorted([(r["step"], 0, r) for r in rows] + [(r["step"], 1, r) for r in local], key=lambda x: (x[0], x[1]))
    for _, is_local, r in merged:
        ev = evidence_marks(r["evidence"])
        checked = f"save {time_text(r['committed'])}" if is_local else checked_text(r["checked"].get("bytes"), now)
        state = f"[{STATE_STYLE.get(r['state'], 'white')}]{r['state']}[/]" + _level_word(r)
        t.add_row(
            str(r["step"]),
            "local" if is_local else "durable",
            state,
            ev,
            checked,
            human_bytes(r["bytes"]),
            escape(reason_text(r["reasons"])),
            escape(where_text(r) if is_local else str(r["path"])),
        )
    con = console()
    con.print(t)
    for r in reversed(local):  # oldest first, as in the table
        if r["state"] != "deleted":
            con.print(escape(copies_sentence(r)))
    for r in aside:
        con.print(escape(aside_sentence(r)))
    if fallback:
        con.print("[dim]The local tier's steps are recorded in the ledger only: not listed while it cannot be read.[/]")
    if rows or local:
        con.print(
            "[dim]evidence as last checked; `scout-ckpt certify ROOT` re-checks bytes and invariants now, "
            "`resume` re-checks the bytes of the step it returns[/]"
        )
    return 0


def _local_rows(root: Path) -> list[dict]:
    """The local tier's rows ([] when the ledger has none); read after list_checkpoints found the ledger
    readable. A ledger that turned unreadable in between costs the local rows (a warning), never the listing."""
    from scout_ckpt.errors import LedgerUnavailable
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.ops.tier_views import local_rows

    try:
        with Ledger.open(root, readonly=True) as ledger:
            return local_rows(ledger)
    except (LedgerUnavailable, sqlite3.DatabaseError) as e:
        print(f"scout-ckpt: warning: the local tier's steps not listed: {e}", file=sys.stderr)
        return []


def _aside_rows(root: Path, step: int | None = None) -> list[dict]:
    """The quarantined attempts set aside to save their step anew (ops/aside_view.py); [] when the ledger cannot
    be read now (a warning: the listing stands)."""
    from scout_ckpt.errors import LedgerUnavailable, ScoutError
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.ops import aside_view

    try:
        with Ledger.open(root, readonly=True) as ledger:
            return aside_view.rows(ledger, root, step)
    except (LedgerUnavailable, sqlite3.DatabaseError) as e:
        print(f"scout-ckpt: warning: the set-aside attempts not listed: {e}", file=sys.stderr)
    except (ScoutError, OSError):
        pass  # no ledger here (an answer from elsewhere): nothing recorded to list
    return []


def explain(root: Path, step: int, as_json: bool) -> int:
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.ledger.tiers import row as tier_row
    from scout_ckpt.ops.operator import explain as explain_step
    from scout_ckpt.ops.tier_views import explain_local, explain_local_lines

    try:
        out = explain_step(root, step)
    except BadInput:
        out = None  # no durable row: a step the local tier alone holds is explained below
    with Ledger.open(root, readonly=True) as ledger:
        local = explain_local(ledger, step)
    if out is None and local is None:
        raise BadInput(f"step {step}: no such checkpoint in {root} (neither tier)")
    if out is None:  # the durable document's keys, from the local row
        out = {
            "step": step,
            "state": local["state"],
            "path": local["dir"],
            "evidence": local["evidence"],
            "reasons": local["reasons"],
            "policy": None,
            "run_id": local["run_id"],
            "attempt": None,
            "history": [],
            "events": local["events"],
            "tier": "local",
        }
        tiers = ["local"]
    else:
        out["tier"] = "durable"
        tiers = ["durable"] + (["local"] if local is not None else [])
    out["local"], out["tiers"] = local, tiers
    with Ledger.open(root, readonly=True) as ledger:
        view = steps_view(
            ledger.checkpoint(step), tier_row(ledger, step), ((ledger.evidence(step).get("bytes") or {}).get("status"))
        )
    # the step's own verdict (a quarantine or a step-level rejection in either tier holds for every copy) and
    # each copy with its bytes evidence; "state" stays the durable row's, as it always was
    out["step_state"], out["copies"] = view["state"], view["copies"]
    out["set_aside"] = _aside_rows(root, step)  # earlier attempts of the step, quarantined and kept aside
    if as_json:
        emit(out)
    else:
        con = console()
        if "durable" in tiers:
            from scout_ckpt.object_store import location

            for line in explain_lines(out, location(root, out["path"]), time.time(), escape):
                con.print(line)
        if local is not None:
            for line in explain_local_lines(local, escape, both="durable" in tiers):
                con.print(line)
        con.print(escape(copies_text(view)))
        for r in out["set_aside"]:
            con.print(escape(aside_sentence(r)))
    if out["state"] != "certified":
        what = "" if tiers == ["durable"] else f" in the {tiers[0]} tier"
        print(
            f"scout-ckpt: step {step} is {out['state']}{what}"
            + (f": {reason_text(out['reasons'])}" if out["reasons"] else ""),
            file=sys.stderr,
        )
        return 1
    return 0


def resume(root: Path, latest_clean: bool, no_verify: bool, as_json: bool, require: list[str] | None = None) -> int:
    """stdout is the path alone (restart scripts read it); why newer steps were not chosen goes to stderr."""
    from scout_ckpt.ops.recovery import NoCleanCheckpoint, check_require
    from scout_ckpt.ops.recovery import latest_clean as find

    if not latest_clean:
        raise BadInput("resume needs --latest-clean")
    require = check_require(require)  # an unknown kind: exit 2 before anything is read
    roots.store_for(root)  # a mangled s3:// ROOT: exit 2 (a bound ledger_dir is handled by latest_clean)
    try:
        found = find(root, verify=not no_verify, require=require)
    except NoCleanCheckpoint as e:
        _say_fallback(getattr(e, "fallback", None))
        if as_json:
            emit({"step": None, "path": None, "reasons": e.reasons, "fallback": getattr(e, "fallback", None)})
        for r in e.reasons:
            for s in r.get("skipped") or []:
                print(f"scout-ckpt: skipped step {s['step']}: {reason_text(s['reasons'])}", file=sys.stderr)
        print(f"scout-ckpt: {e}", file=sys.stderr)
        return 1
    _say_fallback(found.get("fallback"))
    for s in found["skipped"]:
        print(f"scout-ckpt: skipped step {s['step']}: {reason_text(s['reasons'])}", file=sys.stderr)
    for s in found.get("newer") or []:
        print(
            f"scout-ckpt: newer step {s['step']} is {s['state']}: {reason_text(s['reasons']) or '-'}", file=sys.stderr
        )
    newer_local = [] if found.get("fallback") else _newer_local(root, found["step"])
    if newer_local:
        print(
            f"scout-ckpt: newer local step(s) {', '.join(str(r['step']) for r in newer_local)} certified in the "
            f"fast tier: a job restarted on the same layout loads the newest one every rank re-verifies; this "
            f"command cannot read other nodes' local directories",
            file=sys.stderr,
        )
    aside = [] if found.get("fallback") else _aside_rows(root, found["step"])
    for r in aside:  # the answer is the new attempt; the quarantined one is kept, never handed out
        print(f"scout-ckpt: {aside_sentence(r)}", file=sys.stderr)
    found["evidence_level"] = _found_level(root, found)
    if found["evidence_level"] == "adopted":
        print(
            f"scout-ckpt: step {found['step']} is adopted: its bytes are vouched for only by adopt's own digests "
            "of the folder as found, not digests written at save; `--require source_digests` walks past such "
            "steps",
            file=sys.stderr,
        )
    if as_json:
        # the CLI reads the durable tier (design.md, "Fast tier"); newer certified local steps are named beside it
        emit({**found, "tier": found.get("tier", "durable"), "local_newer": newer_local, "set_aside": aside})
    else:
        print(found["path"])
    return 0


def _level_word(row: dict) -> str:
    """` adopted` after the state of a step certified on foreign evidence (ops/adopt_step.evidence_level)."""
    level = row.get("evidence_level", "scout-ckpt")
    return "" if level == "scout-ckpt" or row.get("tier") == "local" else f" [dim]({level})[/]"


def _found_level(root: Path, found: dict) -> str:
    """The evidence level of the step resume hands out (the ledger's evidence; "scout-ckpt" when the answer came
    from the manifests, which carry no evidence detail)."""
    if found.get("source") != "ledger":
        return "scout-ckpt"
    from scout_ckpt.ledger import Ledger

    try:
        with Ledger.open(root, readonly=True) as ledger:
            statuses = {k: v["status"] for k, v in ledger.evidence(found["step"]).items()}
    except Exception:  # noqa: BLE001 - the answer stands; the word is what could not be read
        return "unknown"
    return evidence_level(statuses)


def _newer_local(root: Path, step: int) -> list[dict]:
    """Certified local steps newer than the durable answer, newest first ([] when none or unreadable now)."""
    from scout_ckpt.errors import ScoutError
    from scout_ckpt.ledger import Ledger, tiers

    try:
        with Ledger.open(root, readonly=True) as ledger:
            return [
                {"step": r["step"], "state": r["state"], "run_id": r.get("run_id"), "dir": r.get("dir")}
                for r in tiers.rows(ledger)
                if r["state"] == "certified" and r["step"] > step
            ]
    except (ScoutError, OSError, sqlite3.DatabaseError):
        return []


def _say_fallback(why: str | None) -> None:
    """The ledger could not be read: the answer came from the manifests and the journal (same exit codes)."""
    if why:
        print(
            f"scout-ckpt: warning: {why}; answered from the checkpoints' manifests and {JOURNAL_NAME}", file=sys.stderr
        )


def report(root: Path, as_json: bool, html: Path | None) -> int:
    from scout_ckpt.report import timeline as fault_timeline

    with roots.open_ledger(root) as ledger:
        tl = fault_timeline.timeline(ledger)
        tl["steps"] = all_steps(ledger, root)  # each step's verdict and its copies, beside the events
    if html is not None:
        fault_timeline.write_html(tl, html)
    if as_json:
        emit(tl)
    else:
        console().print(fault_timeline.render_table(tl))
        if html is not None:
            print(f"wrote {html}", file=sys.stderr)
    return 0


__all__ = ["explain", "ls", "report", "resume"]
