"""Replica signatures taken by the DCP writer while it writes: one pass over a tensor's bytes feeds both the file
digest and the tensor's consensus signature.

Why: at a sync save each rank hashes every replicated byte for consensus, and writes its own share (DCP
de-duplicates replicated tensors across ranks) through a file digest. Hashed apart, the bytes a rank writes are
read from memory three times (consensus, file digest, the kernel's copy); here the writer walks each such tensor in
1 MiB pieces, and each piece is hashed for the file, hashed for the tensor and written while it is in the cache.

Protocol (one save; `InFlightDigests` is shared by the consensus thread and the writer):

1. Before the write, consensus names the tensors it will sign (`want`): plain contiguous CPU tensors of at least
   FUSE_MIN bytes, keyed by (address, bytes) -- the memory a row-major signature covers.
2. When DCP hands the writer its plan, the writer says which of those it will write whole (`expect`): DCP writes a
   tensor's storage with torch.save, which passes the storage's memory as one buffer; a tensor whose storage holds
   more than its own bytes is cloned by DCP first and so never matches. Then `started` is set (the hashing gate).
3. Consensus hashes everything else once the writer has handed its last byte to the kernel (`flushing`: the
   disk's flush leaves the CPU idle), and takes the expected tensors' signatures after `done` (set when the writer
   returns or fails), hashing itself any that the writer did not deliver.

The digest of a tensor delivered this way is xxh3-128 of exactly the memory at its address, the same function
`replica_signatures` computes of its row-major bytes; the state cannot change meanwhile (a sync save holds the
training thread; an async save writes a staged copy that nothing else touches).
"""

from __future__ import annotations

import threading
from typing import Iterable

import numpy as np
import torch
import xxhash

from scout_ckpt.consensus.mesh import is_dtensor
from scout_ckpt.consensus.signatures import holds_row_major

FUSE_MIN = 1 << 16  # smaller tensors are signed by the consensus thread (a per-write lookup would cost more)


def _key(t) -> tuple[int, int] | None:
    """(address, bytes) of a plain CPU tensor (a DTensor: its local tensor) whose memory holds exactly its
    row-major bytes, else None."""
    if is_dtensor(t):
        t = t.to_local()
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.nbytes < FUSE_MIN or not holds_row_major(t):
        return None
    return (t.data_ptr(), t.nbytes)


def written_key(t) -> tuple[int, int] | None:
    """(address, bytes) of the buffer torch.save will hand the writer for `t` as DCP writes it (its whole
    storage, which DCP writes uncloned only when the storage holds exactly the tensor's bytes), else None."""
    if not isinstance(t, torch.Tensor) or not t.is_cpu or t.layout != torch.strided:
        return None
    storage = t.untyped_storage()
    if storage.nbytes() != t.nbytes or t.nbytes < FUSE_MIN:
        return None
    return (storage.data_ptr(), t.nbytes)


def buffer_key(view: memoryview) -> tuple[int, int]:
    return (np.frombuffer(view, np.uint8).ctypes.data, view.nbytes)


class InFlightDigests:
    """What one save's writer and consensus share (see the module docstring). `started`: the write has begun,
    DCP's planning (collectives, CPU) is over; `flushing`: a signing writer has handed every byte of its file to
    the kernel and waits for the disk (fsync); `done`: the writer has written all it will (or failed).
    `release()` sets all three (a save that fails before or during the write must not leave the consensus thread
    waiting).

    The consensus thread hashes what the writer does not sign once `flushing` is set (`started` for a writer that
    signs nothing): while the writer copies its bytes into the page cache it is CPU-bound, while the disk flushes
    them it is idle (bench/save_overhead.py, 4 ranks on 2 cores: the default save's cost over the bytes-only save
    fell from about 50 ms to about 10-20 ms with the hashing moved into the flush)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.flushing = threading.Event()
        self.done = threading.Event()
        self.flushes = False  # a signing writer will set `flushing` (expect() says so)
        self._wanted: frozenset = frozenset()
        self._expected: frozenset = frozenset()
        self._digests: dict[tuple[int, int], int] = {}
        self.delivered = 0  # signatures taken from the writer (tests and benches read it)

    # ---- consensus side -----------------------------------------------------------------------------------

    def want(self, tensors: Iterable) -> None:
        """Before the write: the tensors consensus will sign."""
        self._wanted = frozenset(k for k in map(_key, tensors) if k is not None)

    def expects(self, t) -> bool:
        """After `started`: whether the writer will sign `t` (consensus then leaves it for `take`)."""
        k = _key(t)
        return k is not None and k in self._expected

    def take(self, t) -> int | None:
        """After `done`: the writer's xxh3-128 of `t`'s memory, or None (consensus hashes it itself)."""
        k = _key(t)
        d = self._digests.get(k) if k is not None else None
        if d is not None:
            self.delivered += 1
        return d

    # ---- writer side --------------------------------------------------------------------------------------

    def expect(self, tensors: Iterable) -> None:
        """At the start of the write (before `started`): the tensors this rank's writer will write."""
        self._expected = frozenset(k for k in map(written_key, tensors) if k is not None and k in self._wanted)
        self.flushes = True

    def cpu_free(self, timeout: float) -> None:
        """Wait until the writer's CPU-bound part is over (`flushing`, else `started`), at most `timeout` s each."""
        self.started.wait(timeout)
        if self.flushes:
            self.flushing.wait(timeout)

    def hasher_for(self, key: tuple[int, int]):
        """A fresh xxh3-128 when `key` (`buffer_key` of a buffer being written) is an expected tensor's memory,
        else None."""
        return xxhash.xxh3_128() if key in self._expected else None

    def record(self, key: tuple[int, int], hasher) -> None:
        self._digests[key] = hasher.intdigest()

    def release(self) -> None:
        self.started.set()
        self.flushing.set()
        self.done.set()
