"""`scout-ckpt adopt LEDGER_DIR [--uri s3://bucket/prefix]`: take in plain `dcp.save` checkpoints on an object
store (`URI/step-N/.metadata`, `__R_I.distcp`, TorchTitan's layout) under the ledger of LEDGER_DIR.

Why a copy: an object-store run lists only attempt prefixes `step-N.attempt-X/` committed by their manifest
(object_store/__init__.py); a plain `step-N/` is written in place, and its writer may write it again. So each
folder is adopted into a fresh attempt prefix, as a save would have written it:

  1. the ledger's `writing` row names the attempt (and this process as its owner) before any object is written;
  2. the folder's objects are downloaded into a temp dir inside LEDGER_DIR and judged there exactly as on POSIX
     (scout_ckpt/adopt.adopt_step: digests, structure check, invariants run offline: the same code, the same
     ADOPTED policy);
  3. the objects are copied on the store (server side) into the attempt prefix, and the copy is verified by
     ranged reads against the digests of the bytes judged in 2 (an object changed in between fails the copy:
     the step is rejected, `adopt_copy_mismatch`, and no manifest is written);
  4. the manifest is published with a conditional create (the commit, as a save's), then the ledger commit and
     the journal (its copy on the store too: bucket_journal), so `ledger rebuild` can vouch for it later.

A crash leaves what a crashed save leaves: a `writing` row whose owner is dead and objects without a manifest,
settled and removed at the next start or `gc` (attempts.sweep). The plain folders are never modified or deleted;
a step that already has a committed attempt is skipped. It needs local space for one folder at a time.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

from scout_ckpt import policy
from scout_ckpt.errors import BadInput, Quarantined, ScoutError
from scout_ckpt.format import layout
from scout_ckpt.format import manifest as manifest_mod
from scout_ckpt.format.safepaths import clip, relpath_problem
from scout_ckpt.ledger import journal

DISTCP_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


def plain_folders(store) -> dict[int, tuple[str, dict[str, int]]]:
    """{step: (prefix name, {relative key: size})} of every `step-N/` prefix (not an attempt) holding objects."""
    out: dict[int, tuple[str, dict[str, int]]] = {}
    for rel, size in store.objects().items():
        head, _, tail = rel.partition("/")
        step = layout.parse_step_dir(head)
        if step is None or not tail:
            continue
        have = out.get(step)
        if have is not None and have[0] != head:  # step-4/ and step-0004/: which one is the step cannot be told
            raise BadInput(f"{store.uri}: two folders for step {step} ({have[0]}, {head})")
        out.setdefault(step, (head, {}))[1][tail] = size
    return dict(sorted(out.items()))


def adopt(root: Path, store, *, invariant_specs: list | None = None) -> dict:
    """Adopt every plain `step-N/` folder under the store's URI that has no committed attempt yet; the ledger is
    LEDGER_DIR's (created and bound to the URI). Same result as adopt.adopt, plus "uri"."""
    from scout_ckpt import object_store
    from scout_ckpt.invariants import parse_specs
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.ops.adopt_step import DEFAULT_INVARIANTS, adopt_step
    from scout_ckpt.ops.rebuild_bucket import cannot_list
    from scout_ckpt.ops.settle import this_process_owner

    specs = list(invariant_specs) if invariant_specs is not None else list(DEFAULT_INVARIANTS)
    checks = parse_specs(specs)
    specs = [c.spec for c in checks]
    try:
        folders = plain_folders(store)
        committed = store.committed()
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - credentials, endpoint, permissions: one line
        raise cannot_list(store, e) from None
    if not folders:
        raise BadInput(f"{store.uri}: no plain DCP step-N/ folders to adopt")
    for step, (head, objects) in folders.items():
        bad = next((k for k in objects if relpath_problem(k) is not None), None)
        if bad is not None:
            raise BadInput(f"{store.uri_of(head)}: an object name that is not a plain relative path ({clip(bad, 80)})")
    todo = {s: f for s, f in folders.items() if s not in committed}
    skipped = [{"step": s, "path": h, "reason": "has_manifest"} for s, (h, _) in folders.items() if s in committed]
    adopted: list[dict] = []
    if not todo:
        return {"adopted": adopted, "skipped": skipped, "run_id": None, "uri": store.uri}
    if root.exists() and not root.is_dir():
        raise BadInput(f"{root}: not a directory")
    root.mkdir(parents=True, exist_ok=True)
    object_store.bind(root, store.uri, object_store.public_options(store.storage_options))
    object_store.remember(root, store)  # journal.append copies each record to it (bucket_journal.mirror)
    run_id = f"adopted-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    world = max((len({m.group(1) for k in objs if (m := DISTCP_RE.match(k))}) for _, objs in todo.values()), default=0)
    run_policy = {**policy.ADOPTED, "invariants": specs}
    with Ledger.open(root, create=True) as ledger:
        ledger.begin_run(run_id, world_size=world, topology={"mode": "adopted"}, policy=run_policy)
        for step, (head, objects) in todo.items():
            attempt = f"{run_id}-{step}"
            name = layout.attempt_dirname(step, attempt)
            try:
                ledger.record_writing(step, run_id, attempt, name, owner=this_process_owner(), source="adopt")
            except Quarantined as e:  # the operator's decision stands: not adopted over it
                skipped.append({"step": step, "path": head, "reason": "quarantined", "detail": str(e)})
                continue
            with tempfile.TemporaryDirectory(prefix=".adopt-", dir=root) as tmp:
                local = Path(tmp) / head
                try:
                    _download(store, head, objects, local)
                except Exception as e:  # noqa: BLE001 - the store's own words; the `writing` row settles later
                    raise ScoutError(f"{store.uri_of(head)}: download failed ({clip(str(e), 200)})") from None
                m, verdict = adopt_step(Path(tmp), step, local, run_id, attempt, checks, specs, run_policy)
            copied = _copy(store, head, name, m["files"])
            if copied["status"] != policy.PASS:
                reasons = [{"code": "adopt_copy_mismatch", "from": head}, *copied["reasons"]]
                if ledger.transition(step, "rejected", reasons, source="adopt", expect="writing", attempt=attempt):
                    journal.journal_verdict(root, step, attempt, None, "rejected", reasons, "adopt")
                adopted.append({"step": step, "path": name, "from": head, "state": "rejected", "reasons": reasons})
                continue
            digest = store.publish_manifest(name, manifest_mod.encode(m))
            if ledger.record_commit(
                step,
                run_id=run_id,
                path=name,
                nbytes=sum(f["size"] for f in m["files"]),
                manifest_digest=digest,
                files=m["files"],
                evidence=m["evidence"],
                state=verdict["state"],
                reasons=verdict["reasons"],
                source="adopt",
                attempt=attempt,
            ):
                journal.journal_verdict(root, step, attempt, digest, verdict["state"], verdict["reasons"], "adopt")
            adopted.append({"step": step, "path": name, "from": head, **verdict})
    return {"adopted": adopted, "skipped": skipped, "run_id": run_id, "uri": store.uri}


def _download(store, head: str, objects: dict[str, int], dest: Path) -> None:
    """Every object of a plain folder into `dest` (same relative names)."""
    for rel in sorted(objects):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        store.fs.get_file(store.key(head, rel), str(target))


def _copy(store, head: str, name: str, files: list[dict]) -> dict:
    """Server-side copy of the judged files into the attempt prefix, then ranged-read verification of the copy
    against their digests (bytes evidence: pass only if the attempt holds exactly what was judged)."""
    try:
        for f in files:
            store.fs.copy(store.key(head, f["path"]), store.key(name, f["path"]))
    except (OSError, ValueError) as e:
        return policy.evidence(policy.FAIL, [{"code": "unreadable_file", "detail": clip(str(e), 200)}])
    return store.verify(name, files)
