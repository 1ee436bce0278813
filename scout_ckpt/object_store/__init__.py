"""Checkpoints on object storage (S3 and compatibles, through fsspec): the optional `scout-ckpt[s3]` extra.

Why a separate path: an object store has no atomic rename and no directory, so the POSIX commit (temp dir,
manifest, rename) cannot be used. Here every save attempt writes under a fresh prefix
`URI/step-N.attempt-<id>/` that nothing ever overwrites, and the commit marker is the attempt's
`scout-manifest.json`, written last with a conditional create (If-None-Match: *). An attempt without a manifest
is never listed, loaded or certified; digests (computed while writing) decide what a manifest may claim.

The ledger cannot live on the object store (SQLite needs a filesystem): it lives in a local or shared-POSIX
`ledger_dir`, which also holds the journal, the reports and `scout-storage.json`, the binding that names the URI.
Every CLI command takes that `ledger_dir` as ROOT; `resume` prints the `s3://` URI of the step to load.

This module imports neither fsspec nor s3fs (`import scout_ckpt` must not); `store.py` does, when a store is
opened.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from scout_ckpt.errors import BadInput, ScoutError

BINDING_NAME = "scout-storage.json"
SCHEMES = ("s3://",)
# storage_options keys never written to the binding file: credentials come from the environment or the caller.
_SECRET_HINTS = ("key", "secret", "token", "password", "session", "profile", "credential")


def is_uri(root) -> bool:
    """True for an object-store URI root (`s3://bucket/prefix`); a POSIX path otherwise."""
    return isinstance(root, str) and root.startswith(SCHEMES)


def looks_like_mangled_uri(root) -> bool:
    """`s3://b/p` passed through pathlib becomes `s3:/b/p`: the CLI says what to pass instead."""
    return str(root).startswith(("s3:/", "s3:\\"))


def public_options(storage_options: dict | None) -> dict:
    """The storage options that may be written to disk (endpoint, block size), never credentials."""

    def clean(d):
        out = {}
        for k, v in (d or {}).items():
            if any(h in k.lower() for h in _SECRET_HINTS):
                continue
            out[k] = clean(v) if isinstance(v, dict) else v
        return out

    return clean(storage_options)


def binding(ledger_dir: str | os.PathLike) -> dict | None:
    """{"uri", "storage_options"} when `ledger_dir` is the ledger of an object-store run, else None."""
    p = Path(ledger_dir) / BINDING_NAME
    try:
        data = json.loads(p.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:
        raise BadInput(f"{p}: unreadable ({e})") from None
    if not isinstance(data, dict) or not is_uri(data.get("uri")):
        raise BadInput(f"{p}: not a scout-ckpt storage binding")
    return data


def bind(ledger_dir: str | os.PathLike, uri: str, storage_options: dict | None) -> None:
    """Coordinator, at start-up: record which URI this ledger describes (atomic write). One ledger per URI: a
    ledger_dir bound to another URI is refused, so two runs can never mix their rows."""
    from scout_ckpt.format.layout import atomic_write_json

    uri = uri.rstrip("/")
    have = binding(ledger_dir)
    if have is not None and have["uri"].rstrip("/") != uri:
        raise ScoutError(f"{ledger_dir}: this ledger_dir belongs to {have['uri']}, not {uri}")
    rec = {"uri": uri, "storage_options": public_options(storage_options)}
    if have != rec:
        atomic_write_json(Path(ledger_dir) / BINDING_NAME, rec)


def open_store(uri: str, storage_options: dict | None = None):
    """An ObjectStore for `uri` (imports fsspec and s3fs; ScoutError naming the extra if they are missing)."""
    from scout_ckpt.object_store.store import ObjectStore

    return ObjectStore(uri, storage_options or {})


def bound_store(ledger_dir: str | os.PathLike, storage_options: dict | None = None):
    """The ObjectStore a ledger_dir is bound to (None for a POSIX root). `storage_options` given here override
    the recorded ones (credentials are never recorded)."""
    b = binding(ledger_dir)
    if b is None:
        return None
    return open_store(b["uri"], {**(b.get("storage_options") or {}), **(storage_options or {})})


def locate(root, *, ledger_dir=None, storage_options: dict | None = None, coordinator: bool = False):
    """(store, ledger_root) for a Checkpointer: (None, Path(root)) for a POSIX root; for a URI root, the opened
    store and `ledger_dir` (created and bound to the URI by the coordinator)."""
    if not is_uri(root):
        if ledger_dir is not None and Path(ledger_dir) != Path(root):
            raise ScoutError("ledger_dir is for object-store roots (s3://...); a POSIX root holds its own ledger")
        if storage_options:
            raise ScoutError("storage_options is for object-store roots (s3://...)")
        return None, Path(root)
    if ledger_dir is None:
        raise ScoutError(
            f"{root}: an object-store root needs ledger_dir= (a local or shared POSIX directory for "
            "the ledger: SQLite cannot live on an object store)"
        )
    store = open_store(root, storage_options)
    if coordinator:
        Path(ledger_dir).mkdir(parents=True, exist_ok=True)
        bind(ledger_dir, root, storage_options)
    remember(ledger_dir, store)
    return store, Path(ledger_dir)


# The stores this process opened, by the real path of their ledger_dir: the journal's copy on the store
# (bucket_journal.mirror) goes through the Checkpointer's own store, credentials from its storage_options included
# (the binding never records them).
_OPEN: dict[str, object] = {}


def remember(ledger_dir: str | os.PathLike, store) -> None:
    _OPEN[os.path.realpath(ledger_dir)] = store


def store_of(ledger_dir: str | os.PathLike):
    """The ObjectStore a ledger_dir is bound to: the one this process opened for it, else opened from the binding
    and the environment; None for a POSIX root."""
    if binding(ledger_dir) is None:
        return None
    return _OPEN.get(os.path.realpath(ledger_dir)) or bound_store(ledger_dir)


def location(ledger_root: str | os.PathLike, rel: str) -> str:
    """Where a recorded checkpoint path lives: the `s3://` URI for a bound ledger_dir, else ROOT/rel."""
    b = binding(ledger_root)
    if b is not None:
        return f"{b['uri'].rstrip('/')}/{rel}"
    return str(Path(ledger_root) / rel)


def resolve(root: str | os.PathLike, uri: str | None):
    """For `ledger rebuild` and `adopt`, which may start from a ledger_dir that does not exist yet: the ObjectStore
    of ROOT (its binding, or `uri`), or None for a POSIX ROOT (no binding, no `uri`). BadInput for a
    mangled `s3:/` ROOT, a `uri` that is not an object-store URI or contradicts the binding, and a ROOT that
    holds checkpoint directories of its own."""
    from scout_ckpt.format import layout
    from scout_ckpt.format.safepaths import clip

    if looks_like_mangled_uri(root):
        raise BadInput(
            f"{root}: give the run's ledger_dir as ROOT and the checkpoints' location as --uri s3://bucket/prefix"
        )
    if uri is not None and not is_uri(uri):
        raise BadInput(f"--uri {clip(uri, 80)}: not an object-store URI (s3://bucket/prefix)")
    have = binding(root)
    if have is not None:
        if uri is not None and uri.rstrip("/") != have["uri"].rstrip("/"):
            raise BadInput(f"{root}: this ledger_dir belongs to {have['uri']}, not {uri.rstrip('/')}")
        return bound_store(root)
    if uri is None:
        return None
    p = Path(root)
    if p.exists() and not p.is_dir():
        raise BadInput(f"{root}: not a directory")
    if p.is_dir() and layout.list_checkpoint_dirs(p):
        raise BadInput(
            f"{root}: holds checkpoint directories of its own (a POSIX run); --uri is for the "
            "ledger_dir of an object-store run"
        )
    return open_store(uri.rstrip("/"))
