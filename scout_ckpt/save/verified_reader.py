"""DCP's `.metadata` is unpickled only if its bytes are the ones whose digest was verified.

Why: `load_latest_clean` verifies every file's digest and only then lets DCP open the files again by path. The
`.metadata` file is a pickle, and unpickling runs code: a file swapped between the verification and the load (an
operator's copy, a racing writer, an attacker with write access to ROOT) would be executed by the real pickle.
These readers read `.metadata` whole, hash those very bytes and unpickle them only when the digest is the one
the manifest recorded; otherwise `MetadataChanged`, which DCP raises on every rank (inside a CheckpointException)
and the loader treats as damage: the candidate is rejected and the walk-back goes on. The data files are read by
DCP as raw tensor bytes, never unpickled; a change to them after verification is what load verification (the
loaded values against the signatures recorded at save) catches.

The object-store reader (save/object_store_io.py VerifiedReader) uses the same check.
"""

from __future__ import annotations

import pickle

import xxhash
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from scout_ckpt.format.digests import ALGO


class MetadataChanged(RuntimeError):
    """The `.metadata` read for loading is not the one whose digest was verified."""


def unpickle_verified(data: bytes, expected_digest: str | None, path: str, load_id):
    """The Metadata pickled in `data`, after checking that `data` hashes to `expected_digest` (None: no digest on
    record, refused as well: nothing vouches for these bytes)."""
    got = f"{ALGO}:{xxhash.xxh3_128_hexdigest(data)}"
    if expected_digest is None or got != expected_digest:
        raise MetadataChanged(
            f"{path}: .metadata changed after verification (digest {got}, recorded {expected_digest})"
        )
    metadata = pickle.loads(data)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata


def is_metadata_changed(exc: BaseException) -> bool:
    """Whether a DCP load failed because a reader refused a changed `.metadata` (on any rank: DCP wraps each
    rank's exception in a CheckpointException whose text carries it)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, MetadataChanged) or "changed after verification" in str(e):
            return True
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(v for v in failures.values() if isinstance(v, BaseException))
        todo.extend([e.__cause__, e.__context__])
    return False


class VerifiedMetadata:
    """Mixin for a DCP reader (FileSystemReader, FsspecReader): `.metadata` read whole through the reader's own
    filesystem and unpickled only with the recorded digest (`self.metadata_digest`)."""

    metadata_digest: str | None = None

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            data = f.read()
        return unpickle_verified(data, self.metadata_digest, str(path), self.load_id)


class VerifiedFileSystemReader(VerifiedMetadata, FileSystemReader):
    """FileSystemReader whose `.metadata` is read whole and unpickled only with the recorded digest."""

    def __init__(self, path: str, metadata_digest: str | None):
        super().__init__(path)
        self.metadata_digest = metadata_digest
