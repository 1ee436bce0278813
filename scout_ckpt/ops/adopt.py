"""Adopt plain DCP `step-N` folders written without scout-ckpt (TorchTitan layout: ROOT/step-N/.metadata +
__R_I.distcp): digest every file, check the structure, run the invariants offline, write a manifest and record the
verdict under the ADOPTED policy (bytes + structure + invariants), so `resume --latest-clean` works on them.

The manifest is built and written by `manifest.build`/`manifest.write`, the one manifest writer, so an adopted
checkpoint reads like any other (`ledger rebuild`, `certify`, `export`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from scout_ckpt import policy
from scout_ckpt.errors import BadInput, Quarantined
from scout_ckpt.format import layout, manifest
from scout_ckpt.ledger import journal
from scout_ckpt.ops.adopt_step import DEFAULT_INVARIANTS, adopt_step


def adopt(root: str | os.PathLike, *, invariant_specs: list | None = None, uri: str | None = None) -> dict:
    """Adopt every `step-N` dir under root that has no scout manifest yet. ROOT may also be the ledger_dir of an
    object-store run (bound to its URI, or named by `uri`): the plain `step-N/` folders there are adopted into
    attempt prefixes (object_store/adopt.py)."""
    from scout_ckpt import object_store
    from scout_ckpt.invariants import parse_specs
    from scout_ckpt.ledger import Ledger

    store = object_store.resolve(root, uri)
    if store is not None:
        from scout_ckpt.ops import adopt_bucket as on_store

        return on_store.adopt(Path(root), store, invariant_specs=invariant_specs)
    root = Path(root)
    if not root.exists():
        raise BadInput(f"{root}: no such directory")
    if not root.is_dir():
        raise BadInput(f"{root}: not a directory")
    steps = layout.list_step_dirs(root)
    if not steps:
        raise BadInput(f"{root}: no step-N checkpoint folders to adopt")
    specs = list(invariant_specs) if invariant_specs is not None else list(DEFAULT_INVARIANTS)
    checks = parse_specs(specs)
    specs = [c.spec for c in checks]
    todo = {s: d for s, d in steps.items() if not (d / layout.MANIFEST_NAME).exists()}
    skipped = [{"step": s, "path": d.name, "reason": "has_manifest"} for s, d in steps.items() if s not in todo]
    adopted: list[dict] = []
    if not todo:
        return {"adopted": adopted, "skipped": skipped, "run_id": None}
    run_id = f"adopted-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    from scout_ckpt.format.dcp_files import ranks_of

    world = max((len(ranks_of(d)) for d in todo.values()), default=0)
    # the run's policy also carries the invariant specs, so `certify` can re-run them offline
    run_policy = {**policy.ADOPTED, "invariants": specs}
    with Ledger.open(root, create=True) as ledger:
        ledger.begin_run(run_id, world_size=world, topology={"mode": "adopted"}, policy=run_policy)
        for step, step_dir in todo.items():
            attempt = f"{run_id}-{step}"
            try:
                ledger.record_writing(step, run_id, attempt, step_dir.name, source="adopt")
            except Quarantined as e:  # the operator's decision stands: not adopted over it
                skipped.append({"step": step, "path": step_dir.name, "reason": "quarantined", "detail": str(e)})
                continue
            m, verdict = adopt_step(root, step, step_dir, run_id, attempt, checks, specs, run_policy)
            digest = manifest.write(step_dir, m)
            if ledger.record_commit(
                    step, run_id=run_id, path=step_dir.name, nbytes=sum(f["size"] for f in m["files"]),
                    manifest_digest=digest, files=m["files"], evidence=m["evidence"], state=verdict["state"],
                    reasons=verdict["reasons"], source="adopt", attempt=attempt):
                journal.journal_verdict(root, step, attempt, digest, verdict["state"], verdict["reasons"], "adopt")
            adopted.append({"step": step, "path": step_dir.name, **verdict})
    return {"adopted": adopted, "skipped": skipped, "run_id": run_id}
