"""The commands that change a ROOT or run a job: certify, gc, quarantine, release, adopt, export, ledger rebuild,
demo.

Each takes the command line's options and returns its exit code: 0, or 1 when what it did left something not
certified (a step that failed re-verification or could not be checked now, an adopted step, a rebuild that left
checkpoints out, a demo job that did not complete). Restart tooling reads these codes, so "could not check" and
"left out" are never 0. Bad input raises errors.BadInput before anything is written.
"""

from __future__ import annotations

import sys
from pathlib import Path

from scout_ckpt.commands.output import console, emit, progress
from scout_ckpt.errors import BadInput
from scout_ckpt.ops import roots
from scout_ckpt.ops.views import reason_text


def _reasons_suffix(result: dict) -> str:
    return f"  {reason_text(result['reasons'])}" if result["reasons"] else ""


def _step_lines(rows: list[dict]) -> list[str]:
    """One line a step: `step N: STATE  reasons`."""
    return [f"step {r['step']}: {r['state']}" + _reasons_suffix(r) for r in rows]


def _answer(result: dict, as_json: bool, lines) -> int:
    """Print a command's result: the JSON document, or the lines `lines(result)` gives; exit 0."""
    if as_json:
        emit(result)
    else:
        for line in lines(result):
            print(line)
    return 0


def certify(root: Path, step: int | None, all_: bool, as_json: bool) -> int:
    from scout_ckpt.ops.certify import certify as certify_steps

    if step is not None and all_:
        raise BadInput("--step and --all are mutually exclusive")
    # bad ROOT / ledger: exit 2 before anything else (read-write: an older schema is migrated, nothing else written)
    roots.check_writable(root)
    with progress(not as_json and sys.stderr.isatty()) as progress_factory:
        results = certify_steps(root, [step] if step is not None else None, progress_factory=progress_factory)
    ok = all(r["state"] == "certified" and not r.get("could_not_check") for r in results)
    if as_json:
        emit({"results": results, "certified": ok})
    else:
        for r in results:
            print(
                f"step {r['step']}: {r['state']}"
                + _reasons_suffix(r)
                + (
                    f"  (could not check now: {reason_text(r['could_not_check'])}; left as it was)"
                    if r.get("could_not_check")
                    else ""
                )
            )
    if ok:
        return 0
    bad = [r for r in results if r["state"] != "certified" or r.get("could_not_check")]
    first = bad[0]
    what = (
        f"could not be checked now ({reason_text(first['could_not_check'])}); it is still {first['state']}"
        if first.get("could_not_check")
        else f"is {first['state']}" + (f" ({reason_text(first['reasons'])})" if first["reasons"] else "")
    )
    print(
        f"scout-ckpt: {len(bad)} of {len(results)} step(s) not certified now; first: step {first['step']} {what}",
        file=sys.stderr,
    )
    return 1


def gc(root: Path, keep: int, dry_run: bool, as_json: bool) -> int:
    from scout_ckpt.ops import retention

    if keep < 1:
        raise BadInput(f"--keep must be at least 1 (got {keep})")
    from scout_ckpt.ops.steps import steps_of

    verb = "would delete" if dry_run else "deleted"
    result = retention.gc(root, keep, dry_run=dry_run)
    result["steps"] = steps_of(root)  # what is left: each step's verdict and its copies in every tier
    return _answer(
        result,
        as_json,
        lambda r: [
            f"{verb}: {', '.join(map(str, r['delete'])) or 'nothing'}; kept: "
            f"{', '.join(map(str, r['keep'])) or 'nothing'} (protected: {r['protected']})"
        ],
    )


def quarantine(root: Path, step: int, reason: str, as_json: bool) -> int:
    from scout_ckpt.ops.operator import quarantine as quarantine_step

    return _answer(quarantine_step(root, step, reason), as_json, lambda r: [f"step {step}: quarantined ({reason})"])


def release(root: Path, step: int, reason: str, as_json: bool) -> int:
    from scout_ckpt.ops.operator import release as release_step

    return _answer(
        release_step(root, step, reason),
        as_json,
        lambda r: [f"step {step}: released, now {r['state']}" + _reasons_suffix(r)],
    )


def adopt(root: Path, invariant: list[str], uri: str | None, as_json: bool) -> int:
    from scout_ckpt.ops.adopt import adopt as adopt_steps

    result = adopt_steps(root, invariant_specs=list(invariant) or None, uri=uri)  # object_store.resolve checks ROOT
    _answer(
        result,
        as_json,
        lambda res: (
            _step_lines(res["adopted"]) + [f"skipped step {r['step']}: {r.get('reason', '')}" for r in res["skipped"]]
        ),
    )
    bad = [r for r in result["adopted"] if r["state"] != "certified"]
    if bad:
        print(
            f"scout-ckpt: {len(bad)} adopted step(s) not certified; first: step {bad[0]['step']} is "
            f"{bad[0]['state']}" + (f" ({reason_text(bad[0]['reasons'])})" if bad[0].get("reasons") else ""),
            file=sys.stderr,
        )
        return 1
    return 0


def export(
    root: Path,
    step: int | None,
    latest_clean: bool,
    out: Path,
    force: bool,
    prefix: str | None,
    max_shard_bytes: int | None,
    as_json: bool,
) -> int:
    from scout_ckpt.ops.export import export as export_step

    if (step is None) == (not latest_clean):
        raise BadInput("give exactly one of --step N or --latest-clean")
    roots.store_for(root)  # an object-store run's ledger_dir: the objects are fetched and verified first
    return _answer(
        export_step(root, step, out, force=force, prefix=prefix, max_shard_bytes=max_shard_bytes),
        as_json,
        lambda r: [r.get("path") or out],
    )


def ledger_rebuild(
    root: Path, no_verify: bool, uri: str | None, as_json: bool, local_dir: list[Path] | None = None
) -> int:
    from scout_ckpt.ops.rebuild import rebuild

    # object_store.rebuild.resolve checks ROOT and --uri, rebuild_local.check_dirs each --local-dir
    result = rebuild(root, verify=not no_verify, uri=uri, local_dirs=list(local_dir or []))
    from scout_ckpt.ops.steps import steps_of

    result["steps"] = steps_of(root)  # the rebuilt ledger's steps, each with its copies in every tier
    local = result.get("local") or {}
    _answer(
        result,
        as_json,
        lambda res: (
            _step_lines(res["checkpoints"])
            + [f"changed step {c['step']}: {c['before']} -> {c['after']} ({c['why']})" for c in res["changes"]]
            + _local_lines(local)
            + ([f"previous ledger kept as {res['backup']}"] if res["backup"] else [])
        ),
    )
    failed = 0
    if result["skipped"]:
        # A rebuild that left checkpoints out is not a success: restart tooling must not take it for one.
        first = result["skipped"][0]
        more = f" (and {len(result['skipped']) - 1} more)" if len(result["skipped"]) > 1 else ""
        print(f"scout-ckpt: ledger rebuild skipped step {first['step']}: {first['reason']}{more}", file=sys.stderr)
        failed = 1
    chain = result.get("journal_chain") or {}
    if chain and not chain.get("intact", True):
        # nor is one whose journal is broken: the certificates it held are not restored
        print(
            f"scout-ckpt: the journal's chain is broken ({chain['detail']}): it vouches for no certificate; "
            "its rejections and quarantines stand",
            file=sys.stderr,
        )
        failed = 1
    if local.get("not_checked"):
        # nor is one that could not check a local step it had on record: it is no longer certified
        steps = ", ".join(map(str, local["not_checked"]))
        print(
            f"scout-ckpt: ledger rebuild could not check local step(s) {steps}: some rank's file is in no "
            f"local directory given; they are committed, not certified (rebuild again with every node's "
            f"--local-dir to restore them)",
            file=sys.stderr,
        )
        failed = 1
    return failed


def _local_lines(local: dict) -> list[str]:
    """The fast tier's part of the rebuild, in sentences."""
    if not local:
        return []
    dirs = ", ".join(local.get("dirs") or []) or "none (no --local-dir, and no readable old ledger names one)"
    lines = [f"Local tier: looked in {dirs}; {len(local.get('rows') or [])} local step(s) recorded."]
    lines += [f"local step {r['step']}: {r['state']}" + _reasons_suffix(r) for r in local.get("rows") or []]
    lines += [
        f"changed local step {c['step']}: {c['before']} -> {c['after']} ({c['why']})"
        for c in local.get("changes") or []
    ]
    if local.get("unrecorded"):
        lines.append(
            "Local directories no row records (an older save of a step recorded from another run): "
            + ", ".join(local["unrecorded"])
            + "."
        )
    return lines


def demo(as_json: bool, **options) -> int:
    """A real multi-process job under torchrun (demo.run_demo takes the options); 1 if it did not complete."""
    from scout_ckpt.demo import print_summary, run_demo

    result = run_demo(**options, quiet=as_json)
    if as_json:
        emit(result)
    else:
        print_summary(result, console())
    return 0 if result["completed"] else 1


__all__ = ["adopt", "certify", "demo", "export", "gc", "ledger_rebuild", "quarantine", "release"]
