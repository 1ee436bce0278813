"""`scout-ckpt ledger rebuild LEDGER_DIR [--uri s3://bucket/prefix]` for a run whose checkpoints live on an
object store: the ledger's rows from the committed attempts' manifests, under the same rules as on POSIX
(scout_ckpt/ops/rebuild.py: `decide`, `strictest`, `write_ledger` are shared, so the policy logic is in one place).

What counts: only attempts whose `scout-manifest.json` exists (the commit marker, written last with a conditional
create); an attempt prefix without one is never listed, whatever it holds. Bytes are re-verified by the store's
ranged reads (`ObjectStore.verify`: a missing object, a wrong size or a digest mismatch fails, fail closed). The
verdicts on record are the journal: what survives in LEDGER_DIR, merged with the copy on the store
(bucket_journal.py), so that losing LEDGER_DIR entirely does not lose them. Nothing on the store is written or
deleted here.

Which store: the URI the ledger_dir is bound to (scout-storage.json, with its recorded endpoint); when that file
was lost with the ledger, `--uri` names it, and the endpoint and credentials come from the environment as for
every AWS client (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...). A `--uri` that contradicts the binding, a ROOT that
holds a POSIX run, a URI with no committed attempt, a store that cannot be listed: BadInput (exit 2), checked
before LEDGER_DIR is created or changed. The binding is written (atomically) only once the new ledger is complete.

When a step has several committed attempts (a step saved again after a walk-back, the older attempt not yet
swept because the ledger that would have swept it is gone), the newest by its manifest's `created` is the step's
row, as it was in the ledger; the others are listed in `superseded` and left on the store for `gc`.
"""

from __future__ import annotations

import os
from pathlib import Path

from scout_ckpt.errors import BadInput, ScoutError
from scout_ckpt.format import layout, node_manifest
from scout_ckpt.format.safepaths import clip
from scout_ckpt.ledger import journal


def collect(store) -> tuple[dict, list[dict], list[dict], set[int]]:
    """(entries by step, skipped, superseded, steps present) from the store's committed attempts. BadInput if
    the store cannot be listed or holds no committed attempt."""
    from scout_ckpt.ops.rebuild_ledger import Entry

    try:
        committed = store.committed()
    except Exception as e:  # noqa: BLE001 - credentials, endpoint, permissions: the store's own words, one line
        raise cannot_list(store, e) from None
    if not committed:
        raise BadInput(
            f"{store.uri}: no committed save attempt (step-N.attempt-X/{layout.MANIFEST_NAME}) to "
            f"rebuild from{_foreign_hint(store)}"
        )
    entries: dict[int, Entry] = {}
    skipped: list[dict] = []
    superseded: list[dict] = []
    for step, names in committed.items():
        read: list[tuple[dict, str, str]] = []
        bad: list[dict] = []
        for name in names:
            try:
                m, digest = store.read_manifest(name)
            except BadInput as e:
                bad.append({"step": step, "path": name, "reason": str(e)})
                continue
            if m["step"] != step:
                bad.append(
                    {
                        "step": step,
                        "path": name,
                        "reason": f"{store.uri_of(name)}: its manifest is for step {m['step']}",
                    }
                )
                continue
            read.append((m, digest, name))
        if bad:  # fail closed: which attempt is the step's cannot be told when one of them cannot be read
            skipped.extend(bad)
            continue
        read.sort(key=lambda x: (_created(x[0]), x[2]))
        m, digest, name = read[-1]
        superseded.extend({"step": step, "path": n} for _, _, n in read[:-1])
        files = m["files"]
        entries[step] = Entry(
            m,
            digest,
            name,
            lambda files=files: node_manifest.stored_bytes(files),
            lambda name=name, files=files: _verify(store, name, files),
        )
    return entries, skipped, superseded, set(committed)


def rebuild(root: Path, store, *, verify: bool = True, local_dirs: list[Path] | None = None) -> dict:
    """Rebuild ROOT (a ledger_dir) from `store`; rebuild.rebuild's result plus "uri" and "superseded"."""
    from scout_ckpt import object_store
    from scout_ckpt.object_store import bucket_journal
    from scout_ckpt.ops import rebuild_local
    from scout_ckpt.ops.rebuild_ledger import write_ledger

    entries, skipped, superseded, present = collect(store)
    if not entries:
        raise BadInput(
            f"{store.uri}: no committed attempt with a readable manifest to rebuild from "
            f"(first: {skipped[0]['reason']})"
        )
    try:
        remote = bucket_journal.read(store)
    except Exception as e:  # noqa: BLE001 - as for the listing
        raise BadInput(f"{store.uri}: cannot read {bucket_journal.PREFIX}/ ({_say(e)})") from None
    local = journal.read(root) if root.is_dir() else []
    records = bucket_journal.merge(local, remote)
    if root.exists() and not root.is_dir():
        raise BadInput(f"{root}: not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"{root}: cannot create the ledger_dir ({e.strerror})") from None
    opts = object_store.public_options(store.storage_options)

    def before_swap() -> None:
        # a ledger_dir that lost its journal gets the store's copy back: the records appended from now on continue
        # its seq and its hash chain instead of starting both again at 0 beside it
        journal.restore(root, remote if not local else [])
        object_store.bind(root, store.uri, opts)

    result = write_ledger(
        root,
        entries,
        skipped,
        records,
        verify=verify,
        present=present,
        before_swap=before_swap,
        local=lambda ledger: rebuild_local.rebuild_rows(root, list(local_dirs or []), ledger),
    )
    return {
        **result,
        "uri": store.uri,
        "superseded": superseded,
        "journal": {"local": len(local), "store": len(remote), "merged": len(records)},
    }


def cannot_list(store, e: Exception) -> BadInput:
    """The one-line error for a store that cannot be listed (exit 2): its own words, and where the requests went."""
    return BadInput(
        f"{store.uri}: cannot list the checkpoints ({_say(e)}); check the credentials and the endpoint "
        f"({_endpoint(store)})"
    )


def _verify(store, name: str, files: list[dict]) -> dict:
    """Bytes evidence of one attempt by ranged reads. An error the store raises mid-way (not the OSError that
    verify already turns into `unreadable_file`) ends the rebuild with its one line; nothing was swapped in."""
    try:
        return store.verify(name, files)
    except ScoutError:
        raise
    except Exception as e:  # noqa: BLE001 - credentials expiring, throttling: the store's own words
        raise ScoutError(f"{store.uri_of(name)}: verification failed ({_say(e)})") from None


def _created(m: dict) -> float:
    c = m.get("created")
    return float(c) if isinstance(c, (int, float)) else 0.0


def _endpoint(store) -> str:
    """Where the requests went, for the error line: the configured endpoint, else AWS's default one."""
    ep = (store.storage_options.get("client_kwargs") or {}).get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL")
    return f"endpoint {ep}" if ep else "no endpoint set: AWS itself; AWS_ENDPOINT_URL names another store"


def _say(e: Exception) -> str:
    return clip(f"{type(e).__name__}: {e}".replace("\n", " "), 200)


def _foreign_hint(store) -> str:
    """What else is there, said in a few words: nothing at all, or objects that are not scout-ckpt's (plain DCP
    step folders written without scout-ckpt, another tool's data)."""
    try:
        objects = store.objects()
    except Exception:  # noqa: BLE001 - the hint is optional
        return ""
    if not objects:
        return " (nothing under this prefix: check the bucket, the prefix and AWS_ENDPOINT_URL)"
    attempts = [k for k in objects if layout.parse_attempt_dir(k.partition("/")[0])]
    if attempts:
        return f" ({len(attempts)} object(s) of attempts that never committed)"
    heads = sorted({k.partition("/")[0] for k in objects})[:3]
    return f" (a foreign prefix: it holds {', '.join(heads)}{', ...' if len(objects) > 3 else ''}, not scout-ckpt's)"
