"""Replica signatures of many tensors at once: the values consensus.signatures.replica_signatures gives, in one
pass over a whole sweep instead of one call per target.

Why: a sweep hashes a few hundred tensors (every target's outputs, input and parameter gradients, and the
optimizer replay's hundreds of small windows). replica_signatures pays tens of microseconds of Python setup per
tensor (type and layout checks, a numpy view, its result rows built one by one) for an xxh3 of a few hundred
bytes. Here each small, plain, contiguous CPU tensor's bytes are copied out directly (one memcpy, no torch call)
and hashed; everything else -- large tensors (hashed in place, in replica_signatures' pool when big enough),
device tensors, DTensors, conjugate or negative views, bytes -- goes through ONE replica_signatures call. Row i of
the result is exactly replica_signatures([items[i]]) (tests/test_replay.py checks it), so what peers compare does
not change, only how often the fixed costs are paid. Measured: 224 optimizer windows in 1.5 ms instead of 4.7.
"""

from __future__ import annotations

import ctypes

import torch
import xxhash

from scout_ckpt.consensus.kernels import s64
from scout_ckpt.consensus.signatures import replica_signatures

SMALL_BYTES = 1 << 16   # tensors below this are read by a plain copy of their bytes (bigger: replica_signatures)


def _direct(t) -> bool:
    """A plain, dense, contiguous CPU tensor whose memory holds exactly its row-major bytes (no conjugate or
    negative bit), small enough that copying its bytes costs less than replica_signatures' per-tensor setup."""
    return (type(t) is torch.Tensor and t.is_cpu and t.layout == torch.strided and t.nbytes < SMALL_BYTES
            and t.is_contiguous() and not t.is_quantized and not t.is_conj() and not t.is_neg())


def signatures(items: list) -> torch.Tensor:
    """[len(items), 2] int64: row i equals replica_signatures([items[i]]) (see the module docstring)."""
    direct = [_direct(t) for t in items]
    out = torch.zeros(len(items), 2, dtype=torch.int64)
    idx, rows = [], []
    for i, (t, ok) in enumerate(zip(items, direct)):
        if ok:
            # the tensor's own bytes (data_ptr includes its storage offset); read while `items` keeps it alive
            d = xxhash.xxh3_128_intdigest(ctypes.string_at(t.data_ptr(), t.nbytes) if t.nbytes else b"")
            idx.append(i)
            rows.append((s64(d >> 64), s64(d)))
    if idx:
        out[idx] = torch.tensor(rows, dtype=torch.int64)
    rest = [i for i, ok in enumerate(direct) if not ok]
    if rest:
        out[rest] = replica_signatures([items[i] for i in rest])
    return out


def signatures_of(groups: list[list]) -> list[torch.Tensor]:
    """One `signatures` call over several lists of tensors; the rows split back per list."""
    flat = [t for g in groups for t in g]
    sigs = signatures(flat)
    out, at = [], 0
    for g in groups:
        out.append(sigs[at:at + len(g)])
        at += len(g)
    return out


__all__ = ["SMALL_BYTES", "signatures", "signatures_of"]
