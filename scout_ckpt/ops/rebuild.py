"""`scout-ckpt ledger rebuild`: recreate the ledger's checkpoint rows from the manifests on disk and the journal.

This module collects the steps of a POSIX ROOT and dispatches an object-store run to ops/rebuild_bucket.py; what
a rebuild decides for each step, and how the new ledger replaces the old one, is ops/rebuild_ledger.py (its
docstring states the rules: a rebuild never makes a checkpoint more trusted than it can establish itself).
"""

from __future__ import annotations

import os
from pathlib import Path

from scout_ckpt.errors import BadInput
from scout_ckpt.format import manifest
from scout_ckpt.format.layout import dir_bytes, list_checkpoint_dirs
from scout_ckpt.format.verify import verify_files
from scout_ckpt.ledger import journal
from scout_ckpt.ops.rebuild_ledger import Entry, write_ledger


def rebuild(
    root: str | os.PathLike,
    *,
    verify: bool = True,
    uri: str | None = None,
    local_dirs: list[str | os.PathLike] | None = None,
) -> dict:
    """Rebuild ROOT's ledger. ROOT is a run's checkpoint root, or the `ledger_dir` of an object-store run: bound
    to its URI by scout-storage.json, or, when that file was lost with the ledger, named by `uri`
    (object_store.resolve says which, and refuses a mismatch before anything is read). The fast tier's rows are
    rebuilt from the node-local directories `local_dirs` (else those the old ledger names on this host):
    ops/rebuild_local.py says what it can and cannot establish (result key "local")."""
    from scout_ckpt import object_store
    from scout_ckpt.ops import rebuild_local

    dirs = rebuild_local.check_dirs(local_dirs or [])  # bad input: refused before anything is read or written
    store = object_store.resolve(root, uri)
    if store is not None:
        from scout_ckpt.ops import rebuild_bucket as on_store

        return on_store.rebuild(Path(root), store, verify=verify, local_dirs=dirs)
    root = Path(root)
    if not root.is_dir():
        raise BadInput(f"{root}: {'not a directory' if root.exists() else 'no such directory'}")
    steps = list_checkpoint_dirs(root)
    entries = {}
    skipped = []
    for step, d in steps.items():
        try:
            m, digest = manifest.read(d)
        except BadInput as e:
            skipped.append({"step": step, "reason": str(e)})
            continue
        entries[step] = Entry(
            m, digest, d.name, lambda d=d, m=m: dir_bytes(d), lambda d=d, m=m: verify_files(d, m["files"])
        )
    if not entries:
        raise BadInput(f"{root}: no checkpoint with a scout-manifest.json to rebuild from")
    return write_ledger(
        root,
        entries,
        skipped,
        journal.read(root),
        verify=verify,
        present=set(steps),
        local=lambda ledger: rebuild_local.rebuild_rows(root, dirs, ledger),
    )
