"""The reader of the one-pass scan (scan.py): each data file read once, front to back, in hashed pieces, with the
bytes of its entries handed to the scan's checks on the way.

Why a module of its own: scan.py decides *what* to check in a step dir (the plan from its metadata, the checks
per entry, the evidence at the end); this module is *how the bytes are read*, which both sides must get exactly
right and which has nothing to do with invariants: one read loop (`Reader.pump`) that hashes each piece right
after reading it, while it is in the cache, completes short reads so that a piece holds whole elements, and
reads an entry's bytes into a caller's buffer or past a caller's check; the file's walk from entry to entry
(`read_file`: a regular file only, the digest right whatever the entries say); the test whether a tensor entry's
bytes may be read straight into a tensor of its shape (`direct_layout`); and a file over a buffer (`Memory`) for
the entries that go through `load_entry` instead.
"""

from __future__ import annotations

import math
import os
import stat
import threading
from typing import Any, Callable

import torch
import xxhash

from scout_ckpt.errors import BadInput
from scout_ckpt.format.digests import ALGO

# Bytes per read: hashed and checked while in the L2/L3 cache (2 threads x (piece + float32 scratch) fit in L3)
PIECE = 4 << 20


def read_file(path: str, entries: list, entry_pass: Callable, progress, piece: Callable) -> tuple[int, str]:
    """(size, digest) of one file, read once front to back; `entries` ((offset, length, fqn, chunk, item), by
    offset) are handed on the way to `entry_pass(reader, layout_f, off, length, fqn, chunk, item)`, which reads
    each one's bytes through the reader (a second descriptor, `layout_f`, for its dry run) and returns how many it
    read. `piece()` gives this thread's piece buffer (a uint8 tensor of PIECE bytes); `progress(n)` is told of
    every n bytes read. Raises BadInput for anything but a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadInput(f"{path}: not a regular file; refusing to hash it")
    h = xxhash.xxh3_128()
    with open(fd, "rb", buffering=0) as f:
        r = Reader(f, h, progress, piece())
        pos = 0
        if entries:
            with open(path, "rb") as layout_f:
                for off, length, fqn, chunk, item in entries:
                    pos += r.pump(off - pos)
                    if pos != off:  # the file ended (or changed) under us: the digest will not match
                        break
                    got = entry_pass(r, layout_f, off, length, fqn, chunk, item)
                    pos += got
                    if got != length:
                        break
        pos += r.pump(None)
    return pos, f"{ALGO}:{h.hexdigest()}"


class Reader:
    """The one read loop: the next n bytes of a file in pieces of at most PIECE bytes, each hashed right after
    it is read (while it is in the cache) and then, optionally, handed to a check. Short reads are completed
    before a piece is handed on, so a piece holds whole elements."""

    def __init__(self, f, h, progress, piece):
        self.f, self.h, self.progress = f, h, progress
        self.piece = piece  # uint8 tensor of PIECE bytes (this thread's, reused)
        self.view = memoryview(piece.numpy())

    def pump(self, n: int | None, into=None, each: Callable[[Any, int], None] | None = None) -> int:
        """Read and hash the next n bytes (None: to the end of the file); returns how many there were. `into`
        (a uint8 tensor of n bytes) receives them, else they pass through the piece buffer; `each(piece, done)`
        is called on every piece (a uint8 tensor; `done` bytes came before it)."""
        dest = memoryview(into.numpy()) if into is not None else None
        done = 0
        while n is None or done < n:
            want = PIECE if n is None else min(PIECE, n - done)
            view = dest[done : done + want] if dest is not None else self.view[:want]
            got = 0
            while got < want:
                k = self.f.readinto(view[got:])
                if not k:
                    break
                got += k
            if got:
                self.h.update(view[:got])
                if each is not None:
                    each((into[done : done + got] if into is not None else self.piece[:got]), done)
                if self.progress is not None:
                    self.progress(got)
            done += got
            if got < want:
                break
        return done


def direct_layout(f, off: int, length: int, size: tuple, dtype) -> tuple[int, int] | None:
    """(start of the tensor's bytes in the entry at `off`, their count) when reading them straight into a tensor
    of the chunk's shape `size` gives exactly what `torch.load` of the entry would (one storage of `dtype`, the
    chunk's shape, contiguous, from offset 0); None otherwise, and for any entry the dry run refuses (the
    `load_entry` path then records why). `f`: a descriptor of the file of its own (the dry run seeks)."""
    from scout_ckpt.format.dcp_entries import tensor_layout

    try:
        lay = tensor_layout(f, off, length)
    except BadInput:
        return None
    if lay is None or lay["storage_type"] == "UntypedStorage":
        return None
    if _storage_dtype(lay["storage_type"]) != dtype or lay["storage_offset"] != 0 or tuple(lay["size"]) != size:
        return None
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= n
    n = math.prod(size)
    if n == 0 or tuple(lay["stride"]) != tuple(reversed(strides)) or lay["nbytes"] != n * dtype.itemsize:
        return None
    return lay["start"], lay["nbytes"]


_STORAGE_DTYPES: dict[str, Any] = {}
_STORAGE_LOCK = threading.Lock()


def _storage_dtype(name: str):
    """The dtype of a typed-storage class name as torch.save pickles it ("FloatStorage"), or None."""
    with _STORAGE_LOCK:
        if not _STORAGE_DTYPES:
            import warnings

            with warnings.catch_warnings():  # TypedStorage's deprecation warning, once
                warnings.simplefilter("ignore")
                for attr in dir(torch):
                    cls = getattr(torch, attr, None)
                    if attr.endswith("Storage") and attr != "UntypedStorage" and isinstance(cls, type):
                        dt = getattr(cls, "dtype", None)
                        if isinstance(dt, torch.dtype):
                            _STORAGE_DTYPES[attr] = dt
        return _STORAGE_DTYPES.get(name)


class Memory:
    """A read-only seekable file over a buffer (no copy): what `load_entry` reads an entry through."""

    def __init__(self, buf):
        self._view = memoryview(buf)
        self._pos = 0

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._view)}[whence]
        self._pos = min(max(base + pos, 0), len(self._view))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        n = min(len(b), len(self._view) - self._pos)
        if n <= 0:
            return 0
        memoryview(b)[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n
