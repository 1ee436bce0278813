"""Adopt checkpoint folders written without scout-ckpt: plain DCP `step-N` folders (TorchTitan layout:
ROOT/step-N/.metadata + __R_I.distcp) and the folder layouts integrations register (ops/adopt_layouts.py:
Megatron-Core's `iter_NNNNNNN`, with its `integrity.json` as bytes evidence). Each folder: every file digested,
the structure checked, the invariants run offline, a manifest written and the verdict recorded under the ADOPTED
policy (bytes + structure + invariants), so `resume --latest-clean` works on them. Framework pointers
(Megatron-LM's `latest_checkpointed_iteration.txt`) are left alone: adopt writes only manifests, the ledger and
the journal (the Megatron integration points its tracker at a certified iteration when the job starts).

The manifest is built and written by `manifest.build`/`manifest.write`, the one manifest writer, so an adopted
checkpoint reads like any other (`ledger rebuild`, `certify`, `export`).

Crash consistency (a SIGKILL at any line: the old state or the new one). A folder is judged first, without
writing anything; then, in order:

  1. its manifest (atomic: temp + fsync + rename; the temp file of a write a kill interrupted is removed by the
     next adopt before it reads the folder) -- the folder is "adopted" from here on;
  2. a rejection goes into the journal first (a trust-lowering verdict is durable before it takes effect);
  3. the ledger row, `writing` and committed with its verdict in ONE transaction, so no reader ever sees an
     adopt's `writing` row and none is left behind without an owner;
  4. any other verdict into the journal.

A crash before 1 leaves nothing; after 1 and before 3, a manifest the ledger does not know: never resumed from
(`resume` reads the ledger; without one, `ls`/`resume` read the journal, which has no certification of it), and
the next `adopt` finishes it (`_finish`: the bytes re-verified against the manifest, the verdict recorded); after
3 and before 4, the next adopt journals the verdict. It also finishes the ownerless `writing` row that adopt left
before it recorded this way (a row written before judging, with no owner, so that no settler could decide it).
Two adopts on one ROOT would race on the same folders: an `flock` on ROOT/.leases/adopt.lock keeps a second one
out (one-line error, exit 2).

Test-only: SCOUT_CKPT_TEST_ADOPT_HOOK is read in one place, `_hook`, between these steps (see there).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path

from scout_ckpt import policy
from scout_ckpt.errors import BadInput, Quarantined
from scout_ckpt.format import layout, manifest
from scout_ckpt.ledger import journal
from scout_ckpt.ops import adopt_layouts
from scout_ckpt.ops.adopt_step import DEFAULT_INVARIANTS, adopt_step
from scout_ckpt.ops.settle import try_exclusive

HOOK_ENV = "SCOUT_CKPT_TEST_ADOPT_HOOK"
LOCK_NAME = "adopt"
# what layout.atomic_write_bytes leaves of the manifest when killed between its write and its rename
TORN_MANIFEST_RE = re.compile(r"^\." + re.escape(layout.MANIFEST_NAME) + r"\.tmp-\d+$")


def _hook(point: str, step: int) -> None:
    """Test-only, the one place SCOUT_CKPT_TEST_ADOPT_HOOK is read (tests/test_adopt_megatron.py). Points, in
    order for each folder: `judged` (nothing written yet), `manifest` (the manifest is written), `journal` and
    `ledger` (each written; a rejection is journaled before the ledger, any other verdict after). The value:
    `kill:POINT:STEP` SIGKILLs this process at that point of that step; `pause:SECONDS` prints
    "adopt-hook POINT STEP" on stderr at every point and sleeps, so a test can kill it at a time of its choosing."""
    spec = os.environ.get(HOOK_ENV)
    if not spec:
        return
    kind, _, arg = spec.partition(":")
    if kind == "kill" and arg == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "pause":
        print(f"adopt-hook {point} {step}", file=sys.stderr, flush=True)
        time.sleep(float(arg or 0))


def _drop_torn_manifest(step_dir: Path) -> None:
    """Remove the temp file of a manifest write that a kill interrupted (only adopt writes manifests into these
    folders, and it holds the adopt lock): left there, it would be judged a file of the folder, or unexpected."""
    for entry in os.scandir(step_dir):
        if TORN_MANIFEST_RE.match(entry.name) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)


@contextlib.contextmanager
def _exclusive(root: Path):
    """Hold ROOT/.leases/adopt.lock (flock LOCK_EX, not waiting) for one adopt; BadInput if another holds it."""
    path = layout.lease_path(root, LOCK_NAME)
    path.parent.mkdir(exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not try_exclusive(fd):
            raise BadInput(f"{root}: another `scout-ckpt adopt` is running on it")
        yield
    finally:
        os.close(fd)  # the lock goes with the descriptor; the file stays (unlinking it would race a second adopt)


def adopt(root: str | os.PathLike, *, invariant_specs: list | None = None, uri: str | None = None) -> dict:
    """Adopt every `step-N` (or registered layout's) folder under root that has no scout manifest yet, and finish
    what an interrupted adopt left. {"adopted": [{"step", "path", "state", "reasons"}] (every folder whose verdict
    this call recorded; `"finished": "recorded"` on one an interrupted adopt had judged), "finished": [... the
    folders an interrupted adopt left, `"finished"`: "recorded" or "journaled"], "skipped", "run_id"}.
    ROOT may also be the ledger_dir of an object-store run (bound to its URI, or named by `uri`): the plain
    `step-N/` folders there are adopted into attempt prefixes (ops/adopt_bucket.py)."""
    from scout_ckpt import object_store
    from scout_ckpt.invariants import parse_specs

    store = object_store.resolve(root, uri)
    if store is not None:
        from scout_ckpt.ops import adopt_bucket as on_store

        return on_store.adopt(Path(root), store, invariant_specs=invariant_specs)
    root = Path(root)
    if not root.exists():
        raise BadInput(f"{root}: no such directory")
    if not root.is_dir():
        raise BadInput(f"{root}: not a directory")
    found = adopt_layouts.folders(root)
    if not found:
        names = [s.label for s in adopt_layouts.registered()]
        raise BadInput(
            f"{root}: no step-N checkpoint folders to adopt" + (f" (nor {', '.join(names)} folders)" if names else "")
        )
    specs = list(invariant_specs) if invariant_specs is not None else list(DEFAULT_INVARIANTS)
    checks = parse_specs(specs)
    specs = [c.spec for c in checks]
    todo = {s: f for s, f in found.items() if not (f[0] / layout.MANIFEST_NAME).exists()}
    if not todo and not (root / layout.LEDGER_NAME).exists():
        return {
            "adopted": [],
            "finished": [],
            "run_id": None,
            "skipped": [{"step": s, "path": d.name, "reason": "has_manifest"} for s, (d, _) in found.items()],
        }
    with _exclusive(root):
        return _adopt(root, found, checks, specs)


def _adopt(root: Path, found: dict, checks, specs: list) -> dict:
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.ops.settle import this_process_owner

    todo = {s: f for s, f in found.items() if not (f[0] / layout.MANIFEST_NAME).exists()}
    adopted: list[dict] = []
    with Ledger.open(root, create=True) as ledger:
        finished, skipped = _finish(ledger, root, {s: f for s, f in found.items() if s not in todo})
        # a folder whose verdict this call recorded is adopted by it, finished or not (the CLI's exit code)
        adopted += [f for f in finished if f["finished"] == "recorded"]
        if not todo:
            return {"adopted": adopted, "finished": finished, "skipped": skipped, "run_id": None}
        run_id = f"adopted-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        from scout_ckpt.format.dcp_files import ranks_of

        world = max((len(ranks_of(d)) for d, _ in todo.values()), default=0)
        # the run's policy also carries the invariant specs, so `certify` can re-run them offline
        run_policy = {**policy.ADOPTED, "invariants": specs}
        ledger.begin_run(run_id, world_size=world, topology={"mode": "adopted"}, policy=run_policy)
        for step, (step_dir, spec) in todo.items():
            attempt = f"{run_id}-{step}"
            row = ledger.checkpoint(step)
            if row is not None and row["state"] == "quarantined":
                try:  # the operator's decision stands: not adopted over it (the refusal is in the history)
                    ledger.record_writing(
                        step, run_id, attempt, step_dir.name, owner=this_process_owner(), source="adopt"
                    )
                except Quarantined as e:
                    skipped.append({"step": step, "path": step_dir.name, "reason": "quarantined", "detail": str(e)})
                    continue
            _drop_torn_manifest(step_dir)
            m, verdict = adopt_step(root, step, step_dir, run_id, attempt, checks, specs, run_policy, spec)
            _hook("judged", step)
            digest = manifest.write(step_dir, m)
            _hook("manifest", step)
            if not _record(ledger, root, step, step_dir, m, digest, verdict):
                skipped.append({"step": step, "path": step_dir.name, "reason": "quarantined"})
                continue
            adopted.append({"step": step, "path": step_dir.name, **verdict})
    return {"adopted": adopted, "finished": finished, "skipped": skipped, "run_id": run_id}


def _record(ledger, root: Path, step: int, step_dir: Path, m: dict, digest: str, verdict: dict) -> bool:
    """Steps 2-4 of the module docstring for a folder whose manifest is written: the journal before the ledger
    for a rejection, the ledger row created and committed in one transaction, the journal after for any other
    verdict. False when the step became quarantined meanwhile (nothing recorded)."""
    from scout_ckpt.ops.settle import this_process_owner

    state, reasons, attempt = verdict["state"], verdict["reasons"], m["attempt"]
    if state == "rejected":
        journal.journal_verdict(root, step, attempt, digest, state, reasons, "adopt")
        _hook("journal", step)
    try:
        with ledger.write():  # one transaction: no reader ever sees this `writing` row
            row = ledger.checkpoint(step)
            if row is None or row["state"] != "writing" or row["attempt"] != attempt:  # else: an older adopt's
                ledger.record_writing(
                    step, m["run_id"], attempt, step_dir.name, owner=this_process_owner(), source="adopt"
                )
            applied = ledger.record_commit(
                step,
                run_id=m["run_id"],
                path=step_dir.name,
                nbytes=sum(f["size"] for f in m["files"]),
                manifest_digest=digest,
                files=m["files"],
                evidence=m["evidence"],
                state=state,
                reasons=reasons,
                source="adopt",
                attempt=attempt,
            )
    except Quarantined:
        return False
    _hook("ledger", step)
    if applied and state != "rejected":
        journal.journal_verdict(root, step, attempt, digest, state, reasons, "adopt")
        _hook("journal", step)
    return True


def _finish(ledger, root: Path, have_manifest: dict) -> tuple[list[dict], list[dict]]:
    """Finish what an interrupted adopt left among the folders that have a manifest: an adopted manifest the
    ledger has no row for is re-verified (its bytes against its digests) and recorded; an adopted step whose
    verdict the journal lacks is journaled. Returns (finished, skipped); anything else is `has_manifest`."""
    from scout_ckpt.format.verify import could_not_check, verify_files

    finished, skipped, records = [], [], None
    for step, (step_dir, _) in have_manifest.items():
        entry = {"step": step, "path": step_dir.name}
        try:
            m, digest = manifest.read(step_dir)
        except BadInput:  # a manifest nobody can read is not adopt's to repair: `certify`/`ls` report it
            skipped.append({**entry, "reason": "has_manifest"})
            continue
        row = ledger.checkpoint(step)
        if not m.get("adopted") or not m.get("attempt") or (row is not None and row["attempt"] != m["attempt"]):
            skipped.append({**entry, "reason": "has_manifest"})
            continue
        # interrupted after the manifest, before the ledger: record it now. A `writing` row of the same attempt
        # is what adopt left before it recorded in one transaction (no owner: no settler could ever decide it);
        # the commit is compare-and-set on it, so an old adopt still running could not also apply a verdict.
        if row is None or row["state"] == "writing":
            _drop_torn_manifest(step_dir)
            ev = dict(m["evidence"])
            checked = verify_files(step_dir, m["files"])
            if could_not_check(checked):  # an I/O error is not evidence: the next adopt tries again
                skipped.append({**entry, "reason": "could_not_check", "detail": checked["reasons"]})
                continue
            if checked["status"] != policy.PASS:
                ev["bytes"] = {**ev.get("bytes", {}), **checked}
            run = ledger.run(m["run_id"]) if m.get("run_id") else None
            v = policy.evaluate((run or {}).get("policy") or m["policy"], ev)
            verdict = {"state": v.state, "reasons": v.reasons}
            if _record(ledger, root, step, step_dir, {**m, "evidence": ev}, digest, verdict):
                finished.append({**entry, **verdict, "finished": "recorded"})
            else:
                skipped.append({**entry, "reason": "quarantined"})
            continue
        if row["state"] in ("certified", "committed", "rejected"):
            records = journal.read(root) if records is None else records
            if journal.standing(records, step, digest)["state"] is None:  # interrupted before the journal
                journal.journal_verdict(root, step, row["attempt"], digest, row["state"], row["reasons"], "adopt")
                finished.append({**entry, "state": row["state"], "reasons": row["reasons"], "finished": "journaled"})
                continue
        skipped.append({**entry, "reason": "has_manifest"})
    return finished, skipped
