"""`scout-ckpt`: a thin command line over the library. Every command takes --json.

Exit codes: 0 success; 1 the thing asked about is not clean / not found / failed verification; 2 bad input,
with one line on stderr and no traceback. Read-only commands (ls, explain, resume, report) never import torch.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from scout_ckpt.errors import BadInput, ScoutError
from scout_ckpt.integrations import folders as _folders  # noqa: F401  registers the Trainer's checkpoint-N layout
from scout_ckpt.integrations import ds_folders as _ds_folders  # noqa: F401  and DeepSpeed's global_stepN
from scout_ckpt.integrations import mg_folders as _mg_folders  # noqa: F401  and Megatron's iter_NNNNNNN
from scout_ckpt.ledger.journal import JOURNAL_NAME
from scout_ckpt.ops import roots
from scout_ckpt.ops.views import (
    STATE_STYLE,
    checked_text,
    evidence_marks,
    explain_lines,
    list_checkpoints,
)
from scout_ckpt.ops.views import reason_text as _reason_text

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Certified checkpoints for torch.distributed.checkpoint: resume only from known-good state.")
ledger_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Ledger maintenance.")
app.add_typer(ledger_app, name="ledger")

JSON_OPT = typer.Option(False, "--json", help="Print one JSON document on stdout.")


def _emit(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")


def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 120)  # pipes and logs get full rows, not 80 columns


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# ---- ls --------------------------------------------------------------------------------------------------------

@app.command("ls")
def ls_cmd(root: Path = typer.Argument(..., help="The run's checkpoint root."), as_json: bool = JSON_OPT):
    """One row per checkpoint: step, state, evidence (✓ pass, ✗ fail, ? inconclusive, … missing, - n/a), size,
    reasons."""
    rows, fallback = list_checkpoints(root)
    if fallback:  # exit code unchanged (0): the rows are what the manifests and the journal record
        print(f"scout-ckpt: warning: {fallback}; listed from the checkpoints' manifests and {JOURNAL_NAME}",
              file=sys.stderr)
    if as_json:
        _emit({"checkpoints": rows, "source": "manifests" if fallback else "ledger", "fallback": fallback})
        return
    from rich.table import Table

    t = Table(box=None, pad_edge=False)
    for h in ("step", "state", "evidence", "bytes checked", "size", "reasons"):
        t.add_column(h, justify="right" if h in ("step", "size") else "left")
    now = time.time()
    for r in rows:
        ev = evidence_marks(r["evidence"])
        t.add_row(str(r["step"]), f"[{STATE_STYLE.get(r['state'], 'white')}]{r['state']}[/]", ev,
                  checked_text(r["checked"].get("bytes"), now), _human_bytes(r["bytes"]),
                  _escape(_reason_text(r["reasons"])))
    con = _console()
    con.print(t)
    if rows:
        con.print("[dim]evidence as last checked; `scout-ckpt certify ROOT` re-checks bytes and invariants now, "
                  "`resume` re-checks the bytes of the step it returns[/]")


# ---- explain ---------------------------------------------------------------------------------------------------

@app.command("explain")
def explain_cmd(root: Path = typer.Argument(...), step: int = typer.Argument(...), as_json: bool = JSON_OPT):
    """Why STEP is or is not certified: every piece of evidence, missing replay coverage, attributed ranks."""
    from scout_ckpt.ops.operator import explain

    out = explain(root, step)
    if as_json:
        _emit(out)
    else:
        from scout_ckpt.object_store import location

        con = _console()
        for line in explain_lines(out, location(root, out["path"]), time.time(), _escape):
            con.print(line)
    if out["state"] != "certified":
        print(f"scout-ckpt: step {step} is {out['state']}" +
              (f": {_reason_text(out['reasons'])}" if out["reasons"] else ""), file=sys.stderr)
        raise typer.Exit(1)


# ---- certify ---------------------------------------------------------------------------------------------------

@app.command("certify")
def certify_cmd(root: Path = typer.Argument(...), step: Optional[int] = typer.Option(None, "--step"),
                all_: bool = typer.Option(False, "--all", help="Every recorded checkpoint (the default)."),
                as_json: bool = JSON_OPT):
    """Re-verify bytes (and invariants) offline and record the result; exit 0 only if all are certified."""
    from scout_ckpt.ops.certify import certify

    if step is not None and all_:
        raise BadInput("--step and --all are mutually exclusive")
    # bad ROOT / ledger: exit 2 before anything else (read-write: an older schema is migrated, nothing else written)
    roots.check_writable(root)
    with _progress(not as_json and sys.stderr.isatty()) as progress_factory:
        results = certify(root, [step] if step is not None else None, progress_factory=progress_factory)
    ok = all(r["state"] == "certified" and not r.get("could_not_check") for r in results)
    if as_json:
        _emit({"results": results, "certified": ok})
    else:
        for r in results:
            print(f"step {r['step']}: {r['state']}" + (f"  {_reason_text(r['reasons'])}" if r["reasons"] else "")
                  + (f"  (could not check now: {_reason_text(r['could_not_check'])}; left as it was)"
                     if r.get("could_not_check") else ""))
    if not ok:
        bad = [r for r in results if r["state"] != "certified" or r.get("could_not_check")]
        first = bad[0]
        what = (f"could not be checked now ({_reason_text(first['could_not_check'])}); it is still {first['state']}"
                if first.get("could_not_check") else
                f"is {first['state']}" + (f" ({_reason_text(first['reasons'])})" if first["reasons"] else ""))
        print(f"scout-ckpt: {len(bad)} of {len(results)} step(s) not certified now; first: step {first['step']} "
              f"{what}", file=sys.stderr)
        raise typer.Exit(1)


@contextlib.contextmanager
def _progress(enabled: bool):
    """A factory for certify's byte counter: a rich bar on stderr when hashing at least 64 MiB on a terminal,
    stopped (and erased) when the block ends."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    bar = Progress("[progress.description]verifying", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   transient=True, console=Console(stderr=True))

    def make(total: int):
        if total < (64 << 20):
            return None
        bar.start()
        task = bar.add_task("verify", total=total)
        return lambda n: bar.advance(task, n)

    try:
        yield make
    finally:
        bar.stop()


# ---- resume ----------------------------------------------------------------------------------------------------

@app.command("resume")
def resume_cmd(root: Path = typer.Argument(...),
               latest_clean: bool = typer.Option(False, "--latest-clean", help="The newest certified checkpoint."),
               no_verify: bool = typer.Option(False, "--no-verify", help="Skip re-hashing its files."),
               as_json: bool = JSON_OPT):
    """Print the path of the newest certified checkpoint, re-verified; exit 1 if none."""
    from scout_ckpt.ops.recovery import NoCleanCheckpoint
    from scout_ckpt.ops.recovery import latest_clean as find

    if not latest_clean:
        raise BadInput("resume needs --latest-clean")
    roots.store_for(root)   # a mangled s3:// ROOT: exit 2 (a bound ledger_dir is handled by latest_clean)
    try:
        found = find(root, verify=not no_verify)
    except NoCleanCheckpoint as e:
        _say_fallback(getattr(e, "fallback", None))
        if as_json:
            _emit({"step": None, "path": None, "reasons": e.reasons, "fallback": getattr(e, "fallback", None)})
        for r in e.reasons:
            for s in r.get("skipped") or []:
                print(f"scout-ckpt: skipped step {s['step']}: {_reason_text(s['reasons'])}", file=sys.stderr)
        print(f"scout-ckpt: {e}", file=sys.stderr)
        raise typer.Exit(1)
    # stdout is the path alone (restart scripts read it); why newer steps were not chosen goes to stderr.
    _say_fallback(found.get("fallback"))
    for s in found["skipped"]:
        print(f"scout-ckpt: skipped step {s['step']}: {_reason_text(s['reasons'])}", file=sys.stderr)
    for s in found.get("newer") or []:
        print(f"scout-ckpt: newer step {s['step']} is {s['state']}: {_reason_text(s['reasons']) or '-'}",
              file=sys.stderr)
    if as_json:
        _emit({**found, "tier": found.get("tier", "durable")})   # the CLI reads the durable tier (design.md#fast-tier)
    else:
        print(found["path"])


def _say_fallback(why: str | None) -> None:
    """The ledger could not be read: the answer came from the manifests and the journal (same exit codes)."""
    if why:
        print(f"scout-ckpt: warning: {why}; answered from the checkpoints' manifests and {JOURNAL_NAME}",
              file=sys.stderr)


# ---- gc / quarantine -------------------------------------------------------------------------------------------

@app.command("gc")
def gc_cmd(root: Path = typer.Argument(...), keep: int = typer.Option(..., "--keep", help="Checkpoints to keep."),
           dry_run: bool = typer.Option(False, "--dry-run"), as_json: bool = JSON_OPT):
    """Delete old checkpoints; never the newest certified one; rejected and partial ones first."""
    from scout_ckpt.ops import retention

    if keep < 1:
        raise BadInput(f"--keep must be at least 1 (got {keep})")
    result = retention.gc(root, keep, dry_run=dry_run)
    if as_json:
        _emit(result)
    else:
        verb = "would delete" if dry_run else "deleted"
        print(f"{verb}: {', '.join(map(str, result['delete'])) or 'nothing'}; kept: "
              f"{', '.join(map(str, result['keep'])) or 'nothing'} (protected: {result['protected']})")


@app.command("quarantine")
def quarantine_cmd(root: Path = typer.Argument(...), step: int = typer.Argument(...),
                   reason: str = typer.Option(..., "--reason"), as_json: bool = JSON_OPT):
    """Operator override: the step is never resumed from (nor re-saved) until released."""
    from scout_ckpt.ops.operator import quarantine

    result = quarantine(root, step, reason)
    if as_json:
        _emit(result)
    else:
        print(f"step {step}: quarantined ({reason})")


@app.command("release")
def release_cmd(root: Path = typer.Argument(...), step: int = typer.Argument(...),
                reason: str = typer.Option(..., "--reason"), as_json: bool = JSON_OPT):
    """Operator: end a quarantine; the step becomes what its recorded evidence gives under the run's policy."""
    from scout_ckpt.ops.operator import release

    result = release(root, step, reason)
    if as_json:
        _emit(result)
    else:
        print(f"step {step}: released, now {result['state']}"
              + (f"  {_reason_text(result['reasons'])}" if result["reasons"] else ""))


# ---- adopt / export --------------------------------------------------------------------------------------------

@app.command("adopt")
def adopt_cmd(root: Path = typer.Argument(...),
              invariant: List[str] = typer.Option([], "--invariant",
                                                  help="Invariant spec, e.g. finite or frobenius_sphere:radius=1:"
                                                       "params=blocks.*.weight (repeatable; default: finite)."),
              uri: Optional[str] = typer.Option(
                  None, "--uri", help="s3://bucket/prefix holding plain dcp.save step-N/ folders; ROOT is then the "
                                      "run's ledger_dir (created and bound to it); endpoint and credentials from "
                                      "the environment (AWS_ENDPOINT_URL, ...)."),
              as_json: bool = JSON_OPT):
    """Take in plain DCP step-N folders written without scout-ckpt: digests, structure check, invariants. On an
    object store each folder is copied into a fresh attempt prefix, verified, and committed by its manifest."""
    from scout_ckpt.ops.adopt import adopt

    result = adopt(root, invariant_specs=list(invariant) or None, uri=uri)   # object_store.resolve checks ROOT
    if as_json:
        _emit(result)
    else:
        for r in result["adopted"]:
            print(f"step {r['step']}: {r['state']}" + (f"  {_reason_text(r['reasons'])}" if r["reasons"] else ""))
        for r in result["skipped"]:
            print(f"skipped step {r['step']}: {r.get('reason', '')}")
    bad = [r for r in result["adopted"] if r["state"] != "certified"]
    if bad:
        print(f"scout-ckpt: {len(bad)} adopted step(s) not certified; first: step {bad[0]['step']} is "
              f"{bad[0]['state']}" + (f" ({_reason_text(bad[0]['reasons'])})" if bad[0].get("reasons") else ""),
              file=sys.stderr)
        raise typer.Exit(1)


@app.command("export")
def export_cmd(root: Path = typer.Argument(...), step: Optional[int] = typer.Option(None, "--step"),
               latest_clean: bool = typer.Option(False, "--latest-clean"),
               out: Path = typer.Option(..., "--out", help="Output .safetensors file."),
               force: bool = typer.Option(False, "--force", help="Export a step that is not certified."),
               prefix: Optional[str] = typer.Option(None, "--prefix", help="Key prefix of the model weights."),
               max_shard_bytes: Optional[int] = typer.Option(None, "--max-shard-bytes"),
               as_json: bool = JSON_OPT):
    """Consolidate a certified checkpoint's model weights into safetensors, with provenance metadata."""
    from scout_ckpt.ops.export import export

    if (step is None) == (not latest_clean):
        raise BadInput("give exactly one of --step N or --latest-clean")
    roots.store_for(root)   # an object-store run's ledger_dir: the objects are fetched and verified first
    result = export(root, step, out, force=force, prefix=prefix, max_shard_bytes=max_shard_bytes)
    if as_json:
        _emit(result)
    else:
        print(result.get("path") or out)


# ---- report ----------------------------------------------------------------------------------------------------

@app.command("report")
def report_cmd(root: Path = typer.Argument(...), as_json: bool = JSON_OPT,
               html: Optional[Path] = typer.Option(None, "--html", help="Also write a self-contained HTML page.")):
    """Fault timeline: SDC, hangs, stragglers, crashes, desyncs, health events, with ranks and steps."""
    from scout_ckpt.report import timeline as report

    with roots.open_ledger(root) as ledger:
        tl = report.timeline(ledger)
    if html is not None:
        report.write_html(tl, html)
    if as_json:
        _emit(tl)
    else:
        _console().print(report.render_table(tl))
        if html is not None:
            print(f"wrote {html}", file=sys.stderr)


# ---- demo ------------------------------------------------------------------------------------------------------

@app.command("demo")
def demo_cmd(dir: Optional[Path] = typer.Option(None, "--dir", help="Run directory (default: ./scout-demo-<time>)."),
             ranks: int = typer.Option(4, "--ranks"), steps: int = typer.Option(40, "--steps"),
             save_every: int = typer.Option(10, "--save-every"),
             async_save: bool = typer.Option(False, "--async", help="dcp.async_save on the checkpointer's group."),
             mode: str = typer.Option("ddp", "--mode", help="ddp | fsdp | hsdp"),
             inject: List[str] = typer.Option([], "--inject", help="KIND:key=value:... (repeatable)"),
             constraint: Optional[str] = typer.Option(None, "--constraint", help="sphere"),
             mixing: Optional[str] = typer.Option(None, "--mixing", help="online"),
             max_restarts: int = typer.Option(3, "--max-restarts", help="torchrun's --max-restarts for the job."),
             stall_s: float = typer.Option(3.0, "--stall-s", help="Hang observer stall threshold."),
             replay: Optional[bool] = typer.Option(None, "--replay/--no-replay",
                                                   help="SDC replay (default: on when --save-every > 7)."),
             as_json: bool = JSON_OPT):
    """Run a real multi-process CPU (gloo) training job under torchrun, with the save hook and fault injection."""
    from scout_ckpt.demo import print_summary, run_demo

    result = run_demo(dir, ranks=ranks, steps=steps, save_every=save_every, async_save=async_save, mode=mode,
                      inject=inject, constraint=constraint, mixing=mixing, max_restarts=max_restarts,
                      stall_s=stall_s, replay=replay, quiet=as_json)
    if as_json:
        _emit(result)
    else:
        print_summary(result, _console())
    if not result["completed"]:
        raise typer.Exit(1)


# ---- ledger rebuild --------------------------------------------------------------------------------------------

@ledger_app.command("rebuild")
def ledger_rebuild_cmd(root: Path = typer.Argument(...),
                       no_verify: bool = typer.Option(False, "--no-verify", help="Do not re-hash files."),
                       uri: Optional[str] = typer.Option(
                           None, "--uri", help="s3://bucket/prefix of an object-store run whose ledger_dir (ROOT) "
                                               "lost its scout-storage.json; endpoint and credentials from the "
                                               "environment (AWS_ENDPOINT_URL, ...)."),
                       as_json: bool = JSON_OPT):
    """Rebuild the ledger's checkpoint rows from the checkpoints' manifests and the journal (the old ledger is
    kept as .bak). Never more trusted than it can re-verify: --json lists what changed (step, before, after, why).
    On an object-store run ROOT is its ledger_dir: the committed attempts on the store are re-verified by ranged
    reads, and the journal's copy on the store counts with what survives in ROOT."""
    from scout_ckpt.ops.rebuild import rebuild

    result = rebuild(root, verify=not no_verify, uri=uri)   # object_store.rebuild.resolve checks ROOT and --uri
    if as_json:
        _emit(result)
    else:
        for r in result["checkpoints"]:
            print(f"step {r['step']}: {r['state']}" + (f"  {_reason_text(r['reasons'])}" if r["reasons"] else ""))
        for c in result["changes"]:
            print(f"changed step {c['step']}: {c['before']} -> {c['after']} ({c['why']})")
        if result["backup"]:
            print(f"previous ledger kept as {result['backup']}")
    if result["skipped"]:
        # A rebuild that left checkpoints out is not a success: restart tooling must not take it for one.
        first = result["skipped"][0]
        more = f" (and {len(result['skipped']) - 1} more)" if len(result["skipped"]) > 1 else ""
        print(f"scout-ckpt: ledger rebuild skipped step {first['step']}: {first['reason']}{more}", file=sys.stderr)
        raise typer.Exit(1)


# ---- entry point -----------------------------------------------------------------------------------------------

def _skip_pandas() -> None:
    """sqlite-utils (the ledger's writes) imports pandas whenever it is installed, 0.7-1 s of a command's start,
    for DataFrame inserts the ledger never makes. The command-line process marks it absent; a library caller's
    process is left alone."""
    sys.modules.setdefault("pandas", None)  # type: ignore[arg-type]


def main(argv: List[str] | None = None) -> None:
    """Console script: map errors to exit codes with one line on stderr, never a traceback. An OSError that
    reaches here (a command met a path it cannot read or write) is bad input too: exit 2, one line."""
    if argv is None:   # this process is the command line (not a caller passing argv): see _skip_pandas
        _skip_pandas()
    try:
        rc = app(args=argv, standalone_mode=False, prog_name="scout-ckpt")
    except ScoutError as e:
        print(f"scout-ckpt: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except typer.Abort:
        print("scout-ckpt: aborted", file=sys.stderr)
        sys.exit(130)
    except typer.TyperException as e:  # typer's click: bad option, missing argument, bad value
        msg = e.format_message() if hasattr(e, "format_message") else str(e)
        print(f"scout-ckpt: error: {msg}", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 2) or 2)
    except BrokenPipeError:
        sys.exit(0)
    except OSError as e:  # the world refused (a full disk, a directory where a file goes, EACCES): bad input
        print(f"scout-ckpt: error: {_os_error_text(e)}", file=sys.stderr)
        sys.exit(2)
    sys.exit(rc if isinstance(rc, int) else 0)


def _os_error_text(e: OSError) -> str:
    """One line for an OSError: the path(s) and the system's words ("outdir: Is a directory")."""
    what = e.strerror or str(e) or type(e).__name__
    if e.filename is not None and e.filename2 is not None:
        what = f"{e.filename} -> {e.filename2}: {what}"
    elif e.filename is not None:
        what = f"{e.filename}: {what}"
    return " ".join(what.split())


if __name__ == "__main__":
    main()
