"""DCP's fsspec writer and reader, made safe for an object store: digests while writing, no truncated object on
an error, and a `.metadata` that is unpickled only once its digest matches the manifest.

Why not plain FsspecWriter (docs/pytorch-facts.md, probed on a local S3 server): its create_stream deletes the file on an
exception *inside* the `with fs.open(...)` block, whose exit then completes the upload, so a Python error mid-write
committed a truncated `.distcp`. Here an error aborts the upload (`discard`: the multipart upload is aborted, a
small buffered file is never sent). Each data file is hashed (xxh3-128) from the bytes passed to write, in order,
as storage.ScoutWriter does on POSIX: no rank reads back what it just uploaded.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Callable

import xxhash
from torch.distributed.checkpoint._fsspec_filesystem import (
    FileSystem,
    FsspecReader,
    FsspecWriter,
)

from scout_ckpt.format.digests import ALGO
from scout_ckpt.save.storage import WritesRecorded
from scout_ckpt.save.verified_reader import MetadataChanged, VerifiedMetadata  # noqa: F401  (re-exported)


class _HashingUpload(io.IOBase):
    """An fsspec upload stream that hashes every byte written, in order. `on_upload` (tests, the demo's fault
    injection) fires once, as soon as at least one part has left for the store (the file passed its block
    size, so a multipart upload exists), or at the last write of a smaller file."""

    def __init__(self, raw, on_upload: Callable[[], None] | None):
        super().__init__()
        self.raw = raw
        self.hasher = xxhash.xxh3_128()
        self.size = 0
        self._on_upload = on_upload
        self._block = int(getattr(raw, "blocksize", 0) or 0)
        self.error: BaseException | None = None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        self.size += len(view)
        try:
            n = self.raw.write(view)
            if self._on_upload is not None and self._block and self.size > self._block:
                hook, self._on_upload = self._on_upload, None
                hook()
        except BaseException as e:
            # torch.save's zip writer calls this from C++ and loses the exception (it then fails with "unexpected
            # pos"): kept here, create_stream raises it instead, so the user sees the store's own error.
            self.error = e
            raise
        return n

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.raw.flush()

    def fire_pending_hook(self) -> None:
        if self._on_upload is not None:
            hook, self._on_upload = self._on_upload, None
            hook()

    def close(self) -> None:  # DCP closes per item through a no-close wrapper; the upload ends in create_stream
        pass


class _ObjectFileSystem(FileSystem):
    """DCP's fsspec FileSystem with hashed uploads of `.distcp` files and abort-on-error for every write."""

    def __init__(self, fs, on_first_upload: Callable[[], None] | None):
        super().__init__()
        self.fs = fs
        self._on_first_upload = on_first_upload
        self.digests: dict[str, tuple[int, str]] = {}

    def init_path(self, path, **kwargs):
        return path

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        path = os.fspath(path)
        if "w" not in mode:
            with self.fs.open(path, mode) as stream:
                yield stream
            return
        raw = self.fs.open(path, mode)
        hook = None
        if path.endswith(".distcp"):
            hook, self._on_first_upload = self._on_first_upload, None
        stream = _HashingUpload(raw, hook)
        try:
            yield stream
            stream.fire_pending_hook()
        except BaseException as e:
            # Never complete a partial upload: abort it (the multipart upload goes away, a buffered small file
            # is never sent). The attempt's prefix then lacks the file, and no manifest will list it.
            with contextlib.suppress(Exception):
                raw.discard()
            raw.closed = True
            if stream.error is not None and stream.error is not e:
                raise stream.error from e  # the upload's own error, not what torch.save made of it
            raise
        raw.close()
        if path.endswith(".distcp"):
            self.digests[os.path.basename(path)] = (stream.size, f"{ALGO}:{stream.hasher.hexdigest()}")


class ObjectStoreWriter(WritesRecorded, FsspecWriter):
    """FsspecWriter into one attempt prefix (never overwritten: overwrite=False), one file per rank, no fsync
    (docs/pytorch-facts.md: sync_files falls back to os.sync() of the whole host per file; an object is durable once its
    upload completed). Same interface as storage.ScoutWriter: `written`, `nonfinite`, `file_digests()`."""

    def __init__(self, uri: str, fs, *, step: int, fault_hook=None, check_finite: bool = True):
        # FsspecWriter.__init__ makes an unconfigured filesystem from the URI (cheap: no request); the store's own,
        # configured one replaces it. Never pass checkpoint_id= with a storage writer: DCP would rebuild the
        # filesystem without our options and go to real AWS (docs/pytorch-facts.md).
        super().__init__(uri, single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=False)
        self.step = step
        self.check_finite = check_finite
        self.written: set[str] = set()
        self.nonfinite: list[str] = []
        self.fs = _ObjectFileSystem(fs, (lambda: fault_hook("during_write", step)) if fault_hook else None)
        self.path = uri


class VerifiedReader(VerifiedMetadata, FsspecReader):
    """FsspecReader that reads `.metadata` whole, checks its digest against the one the manifest recorded, and
    only then unpickles it: an object replaced after the byte verification is refused, never unpickled."""

    def __init__(self, uri: str, fs, metadata_digest: str | None):
        super().__init__(uri)
        self.fs = _ObjectFileSystem(fs, None)
        self.path = uri
        self.metadata_digest = metadata_digest


def writer_for(store, name: str, *, step: int, fault_hook=None, check_finite: bool = True) -> ObjectStoreWriter:
    """The DCP writer of one save attempt `name` under `store` (an object_store.Store)."""
    return ObjectStoreWriter(store.uri_of(name), store.fs, step=step, fault_hook=fault_hook, check_finite=check_finite)


def reader_for(store, name: str, metadata_digest: str | None) -> VerifiedReader:
    """The DCP reader of attempt `name` under `store`, refusing a `.metadata` whose digest is not the recorded one."""
    return VerifiedReader(store.uri_of(name), store.fs, metadata_digest)
