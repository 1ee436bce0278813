"""What a command's ROOT may be, in one place: a run's checkpoint root on a POSIX filesystem, or the `ledger_dir`
of an object-store run (bound to its `s3://` URI by `scout-storage.json`, scout_ckpt/object_store).

Why a module of its own rather than helpers in cli.py: which ROOTs are accepted and how the ledger of a ROOT is
opened are rules of the library: each CLI command calls
one library function; only parsing and formatting live in cli.py. An `s3://` URI is never a ROOT: the ledger of
an object-store run lives in its ledger_dir, which names the URI, and a URI passed through a shell and pathlib
arrives as `s3:/bucket/...`, so it is recognised and refused with what to pass instead (exit 2, BadInput).

No torch, no fsspec unless the ROOT is bound to an object store.
"""

from __future__ import annotations

import os

from scout_ckpt.errors import BadInput


def store_for(root: str | os.PathLike):
    """The object store a ROOT (a ledger_dir) is bound to, or None for a POSIX ROOT. BadInput (exit 2) for an
    `s3://` ROOT and for an unreadable binding."""
    from scout_ckpt import object_store

    if object_store.looks_like_mangled_uri(root):
        raise BadInput(
            f"{root}: give the run's ledger_dir as ROOT (the ledger of an object-store run lives "
            "there, and it names the s3:// URI)"
        )
    if object_store.binding(root) is None:
        return None
    return object_store.bound_store(root)


def open_ledger(root: str | os.PathLike, readonly: bool = True):
    """The ledger of ROOT after `store_for`'s checks: LedgerError (exit 2) for a missing or foreign ROOT,
    LedgerUnavailable when it cannot be read now. Read-write opens migrate an older schema and write nothing
    else."""
    from scout_ckpt.ledger import Ledger

    store_for(root)
    return Ledger.open(root, readonly=readonly)


def check_writable(root: str | os.PathLike) -> None:
    """Fail (exit 2) before any work if ROOT's ledger cannot be opened for writing (certify checks this first,
    so a bad ROOT is bad input, not a failed verification)."""
    open_ledger(root, readonly=False).close()
