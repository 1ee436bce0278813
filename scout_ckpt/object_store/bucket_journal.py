"""The journal's copy on the object store: `URI/scout-journal/<time>-<id>.json`, one object per record.

Why: on an object-store run the journal (scout_ckpt/ledger/journal.py) lives in the local `ledger_dir` with the ledger,
so losing that directory (the node died) loses every verdict on record, and `ledger rebuild`, which certifies a
step only if a certified verdict for that exact manifest digest is on record, could then certify nothing. A copy
of each record beside the checkpoints gives an object-store run what a POSIX run has: a record that survives the
ledger. It is exactly as trusted as the POSIX journal (same place as the data, same writers): it does not vouch for
a manifest edited since (the record names the digest of the manifest it judged), and rejections and quarantines
copied here stand after a rebuild.

One object per record, each written with a conditional create (If-None-Match: *, as the manifest), because an
object cannot be appended to: two writers never overwrite each other, and a crash leaves a record whole or absent.
The name sorts by time (nanoseconds, zero-padded), then a random id. `scout-journal` does not parse as an attempt
prefix, so listing, sweeping and retention (attempts.py) never touch it.

`mirror(ledger_dir, record)` is what `journal.append` calls for a ledger_dir bound to a store (after its local
append). `read(store)` is what `ledger rebuild` reads, merged with whatever local journal survives (`merge`).
"""

from __future__ import annotations

import json
import os
import posixpath
import time
import uuid

PREFIX = "scout-journal"
# A record is a few hundred bytes; anything far larger under the prefix is not ours and is not read whole.
MAX_RECORD_BYTES = 1 << 20


def record_name(record: dict) -> str:
    """`scout-journal/<ns since the epoch, 20 digits>-<random>.json`: sorted by the record's own time."""
    t = record.get("time")
    ns = int(t * 1e9) if isinstance(t, (int, float)) and t > 0 else time.time_ns()
    return f"{PREFIX}/{ns:020d}-{uuid.uuid4().hex[:12]}.json"


def append(store, record: dict) -> str:
    """Write one record (conditional create where the store honours it); returns its key under the root. Errors
    are the store's own: the caller decides whether a record that could not be copied fails its operation."""
    key = posixpath.join(store.base, record_name(record))
    data = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
    mode = "xb" if store.conditional_create else "wb"
    with store.fs.open(key, mode) as f:
        f.write(data)
    return key


def mirror(ledger_dir: str | os.PathLike, record: dict) -> str | None:
    """Copy a record just appended to `ledger_dir`'s journal to the store that ledger_dir is bound to, through the
    store this process opened for it if any (object_store.store_of); None for a POSIX root: nothing to do."""
    from scout_ckpt.object_store import store_of

    store = store_of(ledger_dir)
    return None if store is None else append(store, record)


def read(store) -> list[dict]:
    """Every record under `URI/scout-journal/`, in name order (its writer's clock: see merge). Objects that do
    not parse as a journal record (a JSON object with a "kind" and an integer "step"), or that are too large, are
    skipped, as a torn line of the local journal is."""
    base = posixpath.join(store.base, PREFIX)
    try:
        found = store.fs.find(base, detail=True)
    except FileNotFoundError:
        return []
    paths = sorted(
        p
        for p, info in found.items()
        if info.get("type", "file") == "file" and p.endswith(".json") and int(info.get("size") or 0) <= MAX_RECORD_BYTES
    )
    if not paths:
        return []
    # one batch: fsspec fetches the records concurrently (a long run has thousands); a record gone since the
    # listing is skipped, any other error is the caller's (an unreadable record may be a quarantine)
    data = store.fs.cat(paths, on_error="return")
    out = []
    for path in paths:
        got = data.get(path) if isinstance(data, dict) else data
        if isinstance(got, FileNotFoundError):
            continue
        if isinstance(got, BaseException):
            raise got
        try:
            rec = json.loads(got)
        except (ValueError, UnicodeDecodeError, RecursionError, TypeError):
            continue
        if isinstance(rec, dict) and "kind" in rec and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def merge(*sources: list[dict]) -> list[dict]:
    """One journal from several copies (the local one first, then the store's): each record once (a record copied
    to both is the same JSON). The first source keeps its own order (the local file's append order); records only
    a later source has follow, in that source's order. Never sorted by the records' times: those are the writers'
    clocks, and hosts disagree (journal.standing makes a rejection outlive a certification whatever the order)."""
    seen, out = set(), []
    for src in sources:
        for rec in src:
            key = json.dumps(rec, sort_keys=True, default=str)
            if key in seen:
                continue
            seen.add(key)
            out.append(rec)
    return out
