"""What a rank's DCP writer computes from the bytes it writes, in the one pass they make through the cache.

torch.save hands the writer each tensor's storage as one buffer. A large buffer goes to the file in PIECE-sized
pieces, and each piece, while it is in the cache, is

- hashed into the tensor's consensus signature, when consensus expects that tensor (consensus/in_flight.py);
- checked to be finite, for a tensor the writer registered (`WritePass.finite`), in the dtype of every tensor of
  the state that views those bytes (invariants/finite.py: the one finite check, the one `certify` runs too);
- written, and hashed into the file's digest as it reaches the file (`_HashedRaw`: xxh3-128 of exactly the bytes
  written, in order: the digest that certify, resume and load verification check), so the commit needs no second
  read of what this rank just wrote.

Apart, these were four reads of every byte a rank writes from memory, which on a loaded host is what a save's CPU
time goes to. The small writes between tensors (zip records, pickles, small tensors) go through the buffer and
are hashed a buffer at a time.

Fail closed: a tensor whose buffer never passed through (DCP cloned it, or wrote it some other way) is checked by
the writer afterwards (`WritePass.unseen`), and consensus hashes any signature the writer did not deliver.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Callable

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem

from scout_ckpt.consensus.in_flight import FUSE_MIN, InFlightDigests, buffer_key, written_key
from scout_ckpt.format.digests import ALGO
from scout_ckpt.invariants.finite import bytes_finite, can_be_nonfinite

PIECE = 1 << 20  # bytes per piece: one piece is hashed twice, summed and copied by the kernel while in the cache


class _Tensor:
    """One large write's per-piece work. `aliases` ({dtype: [names]}): every registered tensor whose storage is
    the buffer being written, by dtype; each piece of the bytes is checked as each of those dtypes."""

    __slots__ = ("aliases", "bad", "key", "raw", "signer")

    def __init__(self, key, signer, raw=None, aliases=None):
        self.key, self.signer = key, signer
        self.raw, self.aliases = raw, aliases or {}
        self.bad: set = set()  # dtypes under which some piece was not finite

    def update(self, start: int, piece: memoryview) -> None:
        if self.signer is not None:
            self.signer.update(piece)
        if self.raw is not None:
            window = self.raw[start : start + len(piece)]
            for dtype in self.aliases:
                if dtype not in self.bad and not bytes_finite(window, dtype):
                    self.bad.add(dtype)


class WritePass:
    """The work one save's writer does on the bytes passing through: `in_flight` (consensus signatures; None: none
    wanted) and `finite` ({buffer key: [(name, tensor), ...]} of the large tensors whose finiteness is checked
    piece by piece: every tensor of the state whose storage is that buffer, so that aliases of one storage in
    different dtypes -- a bfloat16 tensor and a float32 `.view()` of it -- are each checked in their own dtype).
    Afterwards `nonfinite` names those found not finite, and `unseen()` those never written whole as one buffer
    (the writer checks them itself)."""

    def __init__(self, in_flight: InFlightDigests | None, finite: dict):
        self.in_flight = in_flight
        self.finite = finite
        self.seen: set = set()
        self.nonfinite: list[str] = []

    def begin(self, view: memoryview) -> _Tensor | None:
        if view.nbytes < FUSE_MIN:
            return None
        key = buffer_key(view)
        signer = self.in_flight.hasher_for(key) if self.in_flight is not None else None
        # a storage DCP writes twice (two aliases) is checked once: its bytes are the same both times
        tensors = self.finite.get(key) if key not in self.seen else None
        if signer is None and not tensors:
            return None
        if not tensors:
            return _Tensor(key, signer)
        aliases: dict = {}
        for fqn, t in tensors:
            aliases.setdefault(t.dtype, []).append(fqn)
        return _Tensor(key, signer, _storage_bytes(tensors[0][1]), aliases)

    def flushing(self) -> None:
        """The file's last byte is with the kernel; the disk's flush follows (InFlightDigests.flushing)."""
        if self.in_flight is not None:
            self.in_flight.flushing.set()

    def end(self, t: _Tensor) -> None:
        if t.signer is not None:
            self.in_flight.record(t.key, t.signer)
        if t.raw is not None:
            self.seen.add(t.key)
            for dtype, names in t.aliases.items():
                if dtype in t.bad:
                    self.nonfinite.extend(names)

    def unseen(self) -> list[tuple[str, torch.Tensor]]:
        return [v for k, vs in self.finite.items() if k not in self.seen for v in vs]


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of `t`'s whole storage (the bytes torch.save writes for it)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def finite_key(t) -> tuple | None:
    """The buffer key under which a tensor that can hold a NaN or an infinity is checked as it is written, or None
    (check it before the write, or not at all: integers and bool are always finite)."""
    return written_key(t) if isinstance(t, torch.Tensor) and can_be_nonfinite(t.dtype) else None


class _HashedRaw(io.FileIO):
    """The file under a _DigestingFile: every byte that reaches it is hashed here, in file order, as the buffered
    layer hands it over. torch.save makes thousands of small writes a save (zip headers, pickles, small tensors);
    gathered in the buffer first, they are hashed a buffer at a time instead of one Python call each."""

    def __init__(self, path: str):
        super().__init__(path, "w")
        self.hasher = xxhash.xxh3_128()
        self.size = 0

    def write(self, b) -> int:
        n = super().write(b)
        if n:
            view = memoryview(b)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            self.hasher.update(view[:n] if n < view.nbytes else view)
            self.size += n
        return n


_BUFFERED_WRITE = io.BufferedWriter.write


class _DigestingFile(io.BufferedWriter):
    """A data file hashed as it is written (the module docstring; the file digest is taken by `_HashedRaw` below
    the buffer). Any seek or positioned access makes the running digest unusable; the writer then falls back to
    reading the file back.

    With `on_first_write`, the first write is flushed half-way and control goes to the fault hook (tests and the
    demo SIGKILL a rank in the middle of a file)."""

    def __init__(
        self,
        raw: _HashedRaw,
        on_first_write: Callable[[], None] | None = None,
        work: WritePass | None = None,
        sync: bool = True,
    ):
        super().__init__(raw)
        self._on_first_write = on_first_write
        self._work = work
        self._sync = sync
        self.sequential = True

    @property
    def hasher(self):
        return self.raw.hasher

    @property
    def size(self) -> int:
        return self.raw.size

    def write(self, data) -> int:
        if self._on_first_write is not None:
            return self._write_then_fault(memoryview(data).cast("B"))
        # torch.save hands over memoryviews, thousands a save, most of them small: the common case costs one type
        # check and the buffer's own write
        view = data if type(data) is memoryview else memoryview(data)
        n = view.nbytes
        if n < FUSE_MIN:  # no tensor buffer the write pass looks at (WritePass.begin): straight into the buffer
            return _BUFFERED_WRITE(self, view)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        tensor = self._work.begin(view) if self._work is not None else None
        if n <= PIECE and tensor is None:
            return super().write(view)
        # piece by piece: each piece is signed and checked, then copied by the kernel and hashed into the file's
        # digest (_HashedRaw) while it is in the cache
        for start in range(0, n, PIECE):
            piece = view[start : start + PIECE]
            if tensor is not None:
                tensor.update(start, piece)
            super().write(piece)
        if tensor is not None:
            self._work.end(tensor)
        return n

    def _write_then_fault(self, view: memoryview) -> int:
        hook, self._on_first_write = self._on_first_write, None
        half = max(1, len(view) // 2)
        n = super().write(view[:half])
        self.flush()
        os.fsync(self.fileno())
        hook()
        return n + super().write(view[half:])

    def close(self) -> None:
        """Flush, say so (`WritePass.flushing`), fsync, close: durable at close, the bytes DCP's own fsync (taken
        before the buffer's last flush) would have left out included."""
        if self.closed:
            return
        try:
            self.flush()
            if self._sync:
                if self._work is not None:
                    self._work.flushing()
                os.fsync(self.fileno())
        finally:
            super().close()

    def seek(self, *args) -> int:
        pos = super().seek(*args)
        if pos != self.size:
            self.sequential = False
        return pos

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)


class DigestingFileSystem(FileSystem):
    """Opens every `.distcp` written through it as a _DigestingFile and remembers the digests of closed ones. With
    `sync`, every file written through it is fsynced before it is closed (the writer passes sync_files=False to
    DCP and lets this do it: the data file says when its flush begins, and DCP's metadata file is flushed before
    its fsync)."""

    def __init__(self, on_first_write: Callable[[], None] | None, sync: bool = True):
        super().__init__()
        self._on_first_write = on_first_write
        self._sync = sync
        self.work: WritePass | None = None  # this save's, set by the writer when its write begins
        self.digests: dict[str, tuple[int, str]] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode or not str(path).endswith(".distcp"):
            with super().create_stream(path, mode) as stream:
                yield stream
                if self._sync and "w" in mode:
                    stream.flush()
                    os.fsync(stream.fileno())
            return
        hook, self._on_first_write = self._on_first_write, None
        with _DigestingFile(_HashedRaw(str(path)), hook, self.work, self._sync) as stream:
            yield stream
        if stream.sequential:  # DCP may close the stream itself; the running digest outlives it
            self.digests[os.path.basename(path)] = (stream.size, f"{ALGO}:{stream.hasher.hexdigest()}")
