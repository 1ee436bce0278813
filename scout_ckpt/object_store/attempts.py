"""Save attempts on an object store: how one is written and published (ObjectPendingSave, commit.py's second
commit strategy), and how dead ones are cleared (sweep: start-up and `gc`).

Why a second strategy instead of the POSIX one: there is no rename. An attempt writes under its own prefix
`step-N.attempt-<id>/` that no other attempt ever uses, so nothing is overwritten (docs/pytorch-facts.md: a kill while
overwriting a DCP step on S3 left it unloadable); the commit is the manifest, written last by the coordinator with
a conditional create. Before the manifest exists the attempt is invisible; after, it is complete, because the
manifest lists every file with its size and digest and verification reads them back.

Nothing is deleted before the ledger says so: a retention deletion is the row's `deleted` state, a dead attempt
is an `object_delete` event naming the prefix, each recorded first.
"""

from __future__ import annotations

from dataclasses import dataclass

from scout_ckpt.format import layout, node_manifest
from scout_ckpt.format import manifest as manifest_mod
from scout_ckpt.format.digests import bytes_digest


@dataclass(frozen=True)
class ObjectPendingSave:
    """One save attempt's prefix on an object store; the same roles as commit.PendingSave.

    create         coordinator, before any rank writes: nothing to create on the store (prefixes are implicit);
                   the ledger's `writing` row, recorded just before, names the attempt and its owner.
    local_files    every rank, after DCP finished: the files this rank uploaded, hashed in flight; `.metadata`
                   (coordinator) is fetched back once (small).
    finalize       coordinator, after every rank's digests arrived: the manifest, conditional create. That
                   request is the commit. Returns the manifest's digest.
    """

    store: object
    step: int
    attempt: str

    @property
    def name(self) -> str:
        return layout.attempt_dirname(self.step, self.attempt)

    @property
    def tmp(self) -> str:
        return self.store.uri_of(self.name)

    final = tmp

    def create(self, owner: dict) -> None:
        pass

    def local_files(self, writer, rank: int) -> list[dict]:
        mine = sorted(writer.written | ({layout.DCP_METADATA} if rank == 0 else set()))
        known = dict(writer.file_digests())
        for f in mine:
            if f not in known:
                data = self.store.read_bytes(self.name, f)
                known[f] = (len(data), bytes_digest(data))
        return [{"path": f, "size": known[f][0], "digest": known[f][1], "rank": rank} for f in mine]

    def finalize(self, m: dict, hook) -> str:
        data = manifest_mod.encode(m)
        hook("before_rename", self.step)  # the same fault point as POSIX: everything written but the commit
        return self.store.publish_manifest(self.name, data)

    def published(self) -> bool:
        return self.store.has_manifest(self.name)

    def nbytes(self, files: list[dict]) -> int:
        return node_manifest.stored_bytes(files)  # a node manifest's row carries its node's bytes

    def discard(self) -> None:
        """Coordinator, after a failed publish whose rejection the ledger already holds."""
        self.store.delete_attempt(self.name)
        for u in self.store.multipart_uploads():
            if u["attempt"] == self.name:
                self.store.abort_upload(u)


def sweep(ledger, store, *, source: str, dry_run: bool = False) -> dict:
    """Abort the multipart uploads of dead attempts and remove dead attempts' objects; coordinator at start-up
    (after settle_writing) and `gc`. Returns {"aborted": [...], "removed": [...], "left": [...]}.

    The store is listed *before* the ledger is read: an upload or prefix seen in the listing belongs to an
    attempt whose `writing` row was recorded before it (Committer.begin), so the read that follows sees that
    row. Dead means: the step has a ledger row and that row is not this attempt in state `writing` (settle_writing
    has already turned dead owners' rows into `rejected`; an owner alive or unknown keeps its row `writing`).
    Kept: every attempt of a step the ledger has no row for (not ours to judge: another ledger, a lost ledger),
    every attempt with a manifest that the ledger's row names (retention decides about those), and every
    quarantined attempt a later incarnation set aside to save its step anew (ledger/aside.py: its
    `quarantine_set_aside` event, or a quarantine in the journal that no release followed): it is the step's
    history, not a dead attempt.
    """
    uploads = store.multipart_uploads()
    attempts = store.attempts()
    rows = {r["step"]: r for r in ledger.checkpoints()}
    kept = ledger.kept_aside()  # ledger/aside.py

    def verdict(name: str, has_manifest: bool) -> str | None:
        step, attempt = layout.parse_attempt_dir(name)
        row = rows.get(step)
        if row is None:
            return None  # unknown step: left alone
        if name in kept or (step, attempt) in kept:
            return None  # a quarantined attempt set aside: kept, byte for byte
        if row["path"] == name:
            if row["state"] == "writing":
                return None  # in flight (owner alive or unknown)
            if row["state"] == "deleted":
                return "retention"  # intent recorded, removal unfinished
            if not has_manifest:
                return "interrupted"  # settled as rejected: never committed
            return None  # committed: retention decides
        return "superseded"  # an older attempt of a step saved again

    aborted, removed, left = [], [], []
    for u in uploads:
        parsed = layout.parse_attempt_dir(u["attempt"])
        why = verdict(u["attempt"], attempts.get(u["attempt"], False)) if parsed else None
        if why is None:
            left.append({"upload": u["key"], "attempt": u["attempt"]})
            continue
        if not dry_run:
            ledger.add_event(
                "object_delete",
                step=parsed[0],
                detail={"what": "abort_multipart_upload", "key": u["key"], "why": why, "source": source},
            )
            store.abort_upload(u)
        aborted.append({"key": u["key"], "attempt": u["attempt"], "why": why})
    for name, has_manifest in sorted(attempts.items()):
        why = verdict(name, has_manifest)
        if why is None:
            left.append({"attempt": name, "manifest": has_manifest})
            continue
        if not dry_run:
            ledger.add_event(
                "object_delete",
                step=layout.parse_attempt_dir(name)[0],
                detail={"what": "delete_prefix", "prefix": name, "why": why, "source": source},
            )
            store.delete_attempt(name)
        removed.append({"attempt": name, "why": why})
    return {"aborted": aborted, "removed": removed, "left": left}
