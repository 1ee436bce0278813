"""`scout-ckpt`: a thin command line over the library. Every command takes --json.

This module is the command line's contract: the commands' names, arguments, options and help, and the mapping of
errors to exit codes (`main`). What each command prints and which exit code it returns is in scout_ckpt.commands
(`read` for the read-only commands, `maintain` for the others).

Exit codes: 0 success; 1 the thing asked about is not clean / not found / failed verification; 2 bad input,
with one line on stderr and no traceback. Read-only commands (ls, explain, resume, report) never import torch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from scout_ckpt.commands import fleet as fleet_cmds
from scout_ckpt.commands import maintain, read
from scout_ckpt.errors import ScoutError
from scout_ckpt.format.framework_folders import register_framework_layouts
from scout_ckpt.integrations import mg_folders as _mg_folders  # noqa: F401  declares Megatron-Core's adopt layout

# The frameworks' folder names (checkpoint-N, global_stepN, iter_NNNNNNN): every command reads such ROOTs.
register_framework_layouts()

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Certified checkpoints for torch.distributed.checkpoint: resume only from known-good state.",
)
ledger_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Ledger maintenance.")
app.add_typer(ledger_app, name="ledger")
fleet_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The fleet record shared by jobs.")
app.add_typer(fleet_app, name="fleet")

JSON_OPT = typer.Option(False, "--json", help="Print one JSON document on stdout.")


def _exit(code: int) -> None:
    """A command's exit code, raised the way typer ends a command (0: return normally)."""
    if code:
        raise typer.Exit(code)


def _pointers_then_exit(root: Path, code: int) -> None:
    """After a command that may have changed a verdict: the framework pointers under ROOT (DeepSpeed's `latest`,
    Megatron's tracker) name the newest certified step (integrations/pointers.py; a line on stderr per change),
    then the command's own exit code."""
    from scout_ckpt.integrations.pointers import refresh_quietly

    refresh_quietly(root, lambda line: print(line, file=sys.stderr))
    _exit(code)


# ---- ls / explain ----------------------------------------------------------------------------------------------


@app.command("ls")
def ls_cmd(root: Path = typer.Argument(..., help="The run's checkpoint root."), as_json: bool = JSON_OPT):
    """One row per checkpoint: step, state, evidence (✓ pass, ✗ fail, ? inconclusive, … missing, - n/a), size,
    reasons."""
    _exit(read.ls(root, as_json))


@app.command("explain")
def explain_cmd(root: Path = typer.Argument(...), step: int = typer.Argument(...), as_json: bool = JSON_OPT):
    """Why STEP is or is not certified: every piece of evidence, missing replay coverage, attributed ranks."""
    _exit(read.explain(root, step, as_json))


# ---- certify ---------------------------------------------------------------------------------------------------


@app.command("certify")
def certify_cmd(
    root: Path = typer.Argument(...),
    step: Optional[int] = typer.Option(None, "--step"),
    all_: bool = typer.Option(False, "--all", help="Every recorded checkpoint (the default)."),
    as_json: bool = JSON_OPT,
):
    """Re-verify bytes (and invariants) offline and record the result; exit 0 only if all are certified."""
    _pointers_then_exit(root, maintain.certify(root, step, all_, as_json))


# ---- resume ----------------------------------------------------------------------------------------------------


@app.command("resume")
def resume_cmd(
    root: Path = typer.Argument(...),
    latest_clean: bool = typer.Option(False, "--latest-clean", help="The newest certified checkpoint."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip re-hashing its files."),
    require: List[str] = typer.Option(
        [],
        "--require",
        help="Evidence that must have passed outright (repeatable): replay (full replay "
        "coverage), consensus, bytes, invariants, shard_replay, at_rest, health, "
        "source_digests (digests written at save, not only adopt's).",
    ),
    as_json: bool = JSON_OPT,
):
    """Print the path of the newest certified checkpoint, re-verified; exit 1 if none."""
    _pointers_then_exit(root, read.resume(root, latest_clean, no_verify, as_json, require))


# ---- gc / quarantine -------------------------------------------------------------------------------------------


@app.command("gc")
def gc_cmd(
    root: Path = typer.Argument(...),
    keep: int = typer.Option(..., "--keep", help="Checkpoints to keep."),
    dry_run: bool = typer.Option(False, "--dry-run"),
    as_json: bool = JSON_OPT,
):
    """Delete old checkpoints; never the newest certified one; rejected and partial ones first."""
    code = maintain.gc(root, keep, dry_run, as_json)
    if dry_run:
        _exit(code)
    _pointers_then_exit(root, code)


@app.command("quarantine")
def quarantine_cmd(
    root: Path = typer.Argument(...),
    step: int = typer.Argument(...),
    reason: str = typer.Option(..., "--reason"),
    as_json: bool = JSON_OPT,
):
    """Operator override: the step is never resumed from (nor re-saved) until released."""
    _pointers_then_exit(root, maintain.quarantine(root, step, reason, as_json))


@app.command("release")
def release_cmd(
    root: Path = typer.Argument(...),
    step: int = typer.Argument(...),
    reason: str = typer.Option(..., "--reason"),
    as_json: bool = JSON_OPT,
):
    """Operator: end a quarantine; the step becomes what its recorded evidence gives under the run's policy."""
    _pointers_then_exit(root, maintain.release(root, step, reason, as_json))


# ---- adopt / export --------------------------------------------------------------------------------------------


@app.command("adopt")
def adopt_cmd(
    root: Path = typer.Argument(...),
    invariant: List[str] = typer.Option(
        [],
        "--invariant",
        help="Invariant spec, e.g. finite or frobenius_sphere:radius=1:"
        "params=blocks.*.weight (repeatable; default: finite).",
    ),
    uri: Optional[str] = typer.Option(
        None,
        "--uri",
        help="s3://bucket/prefix holding plain dcp.save step-N/ folders; ROOT is then the "
        "run's ledger_dir (created and bound to it); endpoint and credentials from "
        "the environment (AWS_ENDPOINT_URL, ...).",
    ),
    as_json: bool = JSON_OPT,
):
    """Take in plain DCP step-N folders (and Megatron iter_NNNNNNN folders, checked against their integrity.json
    when present) written without scout-ckpt: digests, structure check, invariants. On an object store (step-N
    folders) each folder is copied into a fresh attempt prefix, verified, and committed by its manifest."""
    _exit(maintain.adopt(root, invariant, uri, as_json))


@app.command("export")
def export_cmd(
    root: Path = typer.Argument(...),
    step: Optional[int] = typer.Option(None, "--step"),
    latest_clean: bool = typer.Option(False, "--latest-clean"),
    out: Path = typer.Option(..., "--out", help="Output .safetensors file."),
    force: bool = typer.Option(False, "--force", help="Export a step that is not certified."),
    prefix: Optional[str] = typer.Option(None, "--prefix", help="Key prefix of the model weights."),
    max_shard_bytes: Optional[int] = typer.Option(None, "--max-shard-bytes"),
    as_json: bool = JSON_OPT,
):
    """Consolidate a certified checkpoint's model weights into safetensors, with provenance metadata."""
    _exit(maintain.export(root, step, latest_clean, out, force, prefix, max_shard_bytes, as_json))


# ---- report ----------------------------------------------------------------------------------------------------


@app.command("report")
def report_cmd(
    root: Path = typer.Argument(...),
    as_json: bool = JSON_OPT,
    html: Optional[Path] = typer.Option(None, "--html", help="Also write a self-contained HTML page."),
):
    """Fault timeline: SDC, hangs, stragglers, crashes, desyncs, health events, with ranks and steps."""
    _exit(read.report(root, as_json, html))


# ---- demo ------------------------------------------------------------------------------------------------------


@app.command("demo")
def demo_cmd(
    dir: Optional[Path] = typer.Option(None, "--dir", help="Run directory (default: ./scout-demo-<time>)."),
    ranks: int = typer.Option(4, "--ranks"),
    steps: int = typer.Option(40, "--steps"),
    save_every: int = typer.Option(10, "--save-every"),
    async_save: bool = typer.Option(False, "--async", help="dcp.async_save on the checkpointer's group."),
    mode: str = typer.Option("ddp", "--mode", help="ddp | fsdp | hsdp"),
    inject: List[str] = typer.Option([], "--inject", help="KIND:key=value:... (repeatable)"),
    constraint: Optional[str] = typer.Option(None, "--constraint", help="sphere"),
    mixing: Optional[str] = typer.Option(None, "--mixing", help="online"),
    max_restarts: int = typer.Option(3, "--max-restarts", help="torchrun's --max-restarts for the job."),
    stall_s: float = typer.Option(3.0, "--stall-s", help="Hang observer stall threshold."),
    replay: Optional[bool] = typer.Option(
        None, "--replay/--no-replay", help="SDC replay (default: on when --save-every > 7)."
    ),
    as_json: bool = JSON_OPT,
):
    """Run a real multi-process CPU (gloo) training job under torchrun, with the save hook and fault injection."""
    _exit(
        maintain.demo(
            as_json,
            dir=dir,
            ranks=ranks,
            steps=steps,
            save_every=save_every,
            async_save=async_save,
            mode=mode,
            inject=inject,
            constraint=constraint,
            mixing=mixing,
            max_restarts=max_restarts,
            stall_s=stall_s,
            replay=replay,
        )
    )


# ---- ledger rebuild --------------------------------------------------------------------------------------------


@ledger_app.command("rebuild")
def ledger_rebuild_cmd(
    root: Path = typer.Argument(...),
    no_verify: bool = typer.Option(False, "--no-verify", help="Do not re-hash files."),
    uri: Optional[str] = typer.Option(
        None,
        "--uri",
        help="s3://bucket/prefix of an object-store run whose ledger_dir (ROOT) "
        "lost its scout-storage.json; endpoint and credentials from the "
        "environment (AWS_ENDPOINT_URL, ...).",
    ),
    local_dir: List[Path] = typer.Option(
        [],
        "--local-dir",
        help="A node-local directory of the fast tier (local.dir) that this "
        "host can read; repeatable. Default: those the old ledger names "
        "on this host.",
    ),
    as_json: bool = JSON_OPT,
):
    """Rebuild the ledger's checkpoint rows from the checkpoints' manifests and the journal (the old ledger is
    kept as .bak). Never more trusted than it can re-verify: --json lists what changed (step, before, after, why).
    On an object-store run ROOT is its ledger_dir: the committed attempts on the store are re-verified by ranged
    reads, and the journal's copy on the store counts with what survives in ROOT. The fast tier's rows are
    rebuilt from the --local-dir directories: certified only where the old ledger certified them and every
    rank's file is found and matches its recorded digest."""
    _pointers_then_exit(root, maintain.ledger_rebuild(root, no_verify, uri, as_json, local_dir))


# ---- fleet -----------------------------------------------------------------------------------------------------

FLEET_OPT = typer.Option(None, "--fleet", help="The fleet store (default: $SCOUT_CKPT_FLEET).")


@app.command("suspects")
def suspects_cmd(
    since: Optional[str] = typer.Option(
        None, "--since", help="Only verdicts since T: 7d, 12h, an ISO date or time (UTC), or epoch seconds."
    ),
    min_score: float = typer.Option(0.0, "--min-score", help="Leave out devices scoring below S."),
    fmt: Optional[str] = typer.Option(
        None, "--format", help="slurm|k8s: print (never run) the drain commands for the persistent suspects' hosts."
    ),
    explain: Optional[str] = typer.Option(
        None, "--explain", help="The verdicts behind DEVICE, each with its ROOT and step."
    ),
    store: Optional[Path] = FLEET_OPT,
    as_json: bool = JSON_OPT,
):
    """Devices ranked by the attributed verdicts of every job in the fleet store, most suspect first."""
    _exit(fleet_cmds.suspects(store, since, min_score, as_json, fmt, explain))


@fleet_app.command("import")
def fleet_import_cmd(
    roots: List[Path] = typer.Argument(..., help="Checkpoint roots whose history to bring in."),
    store: Optional[Path] = FLEET_OPT,
    as_json: bool = JSON_OPT,
):
    """Bring the attributed verdicts recorded in ROOTs' ledgers into the fleet store (idempotent)."""
    _exit(fleet_cmds.fleet_import(store, roots, as_json))


# ---- entry point -----------------------------------------------------------------------------------------------


def _skip_pandas() -> None:
    """sqlite-utils (the ledger's writes) imports pandas whenever it is installed, 0.7-1 s of a command's start,
    for DataFrame inserts the ledger never makes. The command-line process marks it absent; a library caller's
    process is left alone."""
    sys.modules.setdefault("pandas", None)  # type: ignore[arg-type]


def main(argv: List[str] | None = None) -> None:
    """Console script: map errors to exit codes with one line on stderr, never a traceback. An OSError that
    reaches here (a command met a path it cannot read or write) is bad input too: exit 2, one line."""
    if argv is None:  # this process is the command line (not a caller passing argv): see _skip_pandas
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
