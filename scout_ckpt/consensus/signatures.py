"""Exact, order-sensitive, additive 128-bit fingerprints of tensors' raw bits, computed on their own device.

Definition. For a tensor whose elements (in row-major order of the *global* tensor) have raw bits b_i, widened
to 64 bits without loss, and global flat index i:

    sig(t)[lane] = sum_i mix_lane(b_i XOR (C_lane * i + K_lane))   mod 2^64,   lane in (0, 1)

with mix(x) = xs(xs(xs(x) * M1) * M2) and xs(x) = x XOR (x >>> 32): a bijection of 64-bit words (degski64's
form; lane 0 uses its constant, lane 1 MurmurHash3's fmix64 constants; C, K, M1, M2 are independent per lane).
Measured avalanche: each input bit flips each output bit with probability 0.50 +- 0.015, as fmix64 does. All
arithmetic is int64 with wrap-around (torch integer ops wrap on CPU and CUDA); xs is done on the int32 halves
of each word (low ^= high, one strided pass), since torch has no uint64 shift.

Properties the project relies on:
  * Exact. Any change of one element (a single bit flip included) changes both lanes with certainty: for a fixed
    index the term is a bijection of the bits, and the other terms are unchanged.
  * Order-sensitive. Each term depends on the element's global index, so a permutation changes the signature
    (unless all permuted elements are bit-equal) except with probability about 2^-64 per lane.
  * Additive. Addition mod 2^64 is associative and commutative, so the signature does not depend on reduction
    order or thread count, and partial signatures of disjoint pieces of a tensor, each computed with its pieces'
    *global* indices, sum (mod 2^64) to the signature of the whole tensor whatever the sharding. That is how a
    checkpoint saved on N ranks is compared with the same state loaded on M ranks (`full_signatures`).
  * On device. Only torch integer ops on the tensor's own device run over the data; the tensor is never copied to
    the host. Work goes in slices of CHUNK elements, so the extra memory is bounded (a few int64 buffers of a slice).

Raw bits: 1-byte dtypes (bool, uint8, int8, float8) are zero-extended, 2- and 4-byte dtypes (fp16, bf16, int16,
fp32, int32, ...) sign-extended (both injective), 8-byte dtypes taken as is. A complex tensor is its
`view_as_real`: element (i, real/imag) has index 2*i + c. The signature covers bits only, not dtype or shape.
It detects faults; it is not a cryptographic MAC (an adversary can build collisions of a sum of hashes).

Non-tensor leaves (step counters, learning rates, ...) are fingerprinted as stable bytes with xxh3-128.

Implementations. On CPU the same definition is evaluated with numpy ufuncs on uint64 (numpy's 64-bit multiply
and logical shift are about twice as fast as torch's int64 ones on one thread; bench/signature_throughput.py),
optionally over slices in several threads (`THREADS`; numpy releases the GIL); on other devices with torch integer
ops on the device. Both give the same value (tests compare them).

Two kinds of signature, for two jobs:
  * full / additive signatures (`tensor_signature`, `batch_signatures`, `full_signatures`): the definition above,
    needed where a tensor may be sharded differently on each side of the comparison (save on N ranks, load on M);
  * replica signatures (`replica_signatures`, save-time consensus): replicas of one tensor on one device type are
    compared with each other at the same moment, so additivity is not needed. A CPU tensor's signature is
    xxh3-128 of its raw bytes in row-major order (exact, order-sensitive, about 10 GB/s, the GIL released, no
    copy of a contiguous tensor), a tensor on another device keeps the additive torch-op signature (on device, no
    host copy). Replica signatures of a CPU tensor and of a device tensor are not comparable with each other.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import xxhash

from scout_ckpt.consensus.mesh import is_dtensor

_M64 = (1 << 64) - 1


def _s64(v: int) -> int:
    """A 64-bit pattern as the signed int64 value torch stores."""
    v &= _M64
    return v - (1 << 64) if v >= 1 << 63 else v


# (index multiplier C (odd), index offset K, multipliers M1, M2 (odd)) of each lane
_LANES = (
    (_s64(0x9E3779B97F4A7C15), _s64(0x632BE59BD9B4E019), _s64(0xD6E8FEB86659FD93), _s64(0xD6E8FEB86659FD93)),
    (_s64(0xBF58476D1CE4E5B9), _s64(0x8CB92BA72F3D8DD7), _s64(0xFF51AFD7ED558CCD), _s64(0xC4CEB9FE1A85EC53)),
)
_LITTLE = sys.byteorder == "little"

# Elements per slice. CPU: a few hundred KiB of int64 buffers keeps the dozen passes over a slice in L2 (64 Ki
# elements measured 1.5x faster than 1 Mi with the torch kernel, 32 Ki best with the numpy one); accelerators:
# larger slices amortise kernel launches.
CHUNK = {"cpu": 1 << 15}
CHUNK_DEFAULT = 1 << 22
# Tensors at most this large are packed together by `batch_signatures` and reduced with one index_add_.
SMALL = 1 << 16
# CPU kernel of the additive signature: "numpy" (default) or "torch" (the device kernel run on CPU; the benches'
# baseline and the tests' cross-check).
CPU_KERNEL = "numpy"
# Threads for CPU signatures (numpy slices of one tensor, xxh3 of many tensors); None: torch.get_num_threads(),
# so a rank limited to one intra-op thread (scout_ckpt.launch) stays on one thread.
THREADS: int | None = None
# Replica signatures: CPU tensors of at least this many bytes are hashed in the thread pool, smaller ones inline.
POOL_MIN_BYTES = 1 << 20


def _chunk_for(device: torch.device) -> int:
    return CHUNK.get(device.type, CHUNK_DEFAULT)


# ----------------------------------------------------------------------------------------------------------------
# the kernel: int64 words -> per-lane sums


class _Work:
    """Scratch buffers for one device, reused across slices (no allocator churn, no fresh pages per slice), and
    each lane's key template C*j + K for j < n: the keys of a contiguous slice starting at global index g are
    template + C*g, one add instead of an arange, a multiply and an add."""

    def __init__(self, device: torch.device, n: int):
        self.device = device
        self.n = n
        self.bits = torch.empty(n, dtype=torch.int64, device=device)
        self.x = torch.empty(n, dtype=torch.int64, device=device)
        j = torch.arange(n, dtype=torch.int64, device=device)
        self.keys = [j * c + k for c, k, _, _ in _LANES]

    def fits(self, device: torch.device, n: int) -> bool:
        return self.device == device and self.n >= n


def _xorshift32(x: torch.Tensor) -> None:
    """x ^= x >>> 32 in place: the low 32-bit word of each element ^= its high word (one strided pass)."""
    if _LITTLE:
        words = x.view(torch.int32).view(-1, 2)
        words[:, 0].bitwise_xor_(words[:, 1])
    else:
        x.bitwise_xor_(torch.bitwise_right_shift(x, 32).bitwise_and_(0xFFFFFFFF))


def _mix_into(x: torch.Tensor, lane) -> None:
    """x <- mix_lane(x) in place: xorshift32, * M1, xorshift32, * M2, xorshift32 (a bijection of 64-bit words)."""
    _, _, m1, m2 = lane
    _xorshift32(x)
    x.mul_(m1)
    _xorshift32(x)
    x.mul_(m2)
    _xorshift32(x)


def _terms(bits: torch.Tensor, w: _Work, lane_no: int, *, start: int | None = None,
           idx: torch.Tensor | None = None) -> torch.Tensor:
    """mix_lane(bits ^ (C*i + K)) for one slice, in w.x[:m]; i = start + j (contiguous) or idx[j]."""
    lane = _LANES[lane_no]
    c, k, _, _ = lane
    m = bits.numel()
    x = w.x[:m]
    if idx is None:
        torch.add(w.keys[lane_no][:m], _s64(c * start), out=x)
    else:
        torch.mul(idx, c, out=x)
        x.add_(k)
    x.bitwise_xor_(bits)
    _mix_into(x, lane)
    return x


_U64_LANES = tuple(tuple(np.uint64(v & _M64) for v in lane) for lane in _LANES)
_U32 = np.uint64(32)


def _threads() -> int:
    return max(1, THREADS if THREADS is not None else torch.get_num_threads())


_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """One process-wide pool, made again in a forked child (a parent's pool threads do not survive a fork)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2),
                                                     thread_name_prefix="scout-sig"))
        return _POOL[1]


class _NpWork:
    """numpy scratch for the CPU kernel, both lanes side by side ([2, n] rows): the key templates C*j + K (int64,
    so that xor with sign-extended narrower words widens correctly), the terms buffer and a shift temporary."""

    def __init__(self, n: int):
        j = np.arange(n, dtype=np.uint64)
        self.n = n
        self.keys = np.stack([j * c + k for c, k, _, _ in _U64_LANES]).view(np.int64)
        self.x = np.empty((len(_LANES), n), dtype=np.int64)
        self.tmp = np.empty((len(_LANES), n), dtype=np.uint64)


_NP_C = np.array([[lane[0]] for lane in _U64_LANES], dtype=np.uint64)
_NP_K = np.array([[lane[1]] for lane in _U64_LANES], dtype=np.uint64)
_NP_M1 = np.array([[lane[2]] for lane in _U64_LANES], dtype=np.uint64)
_NP_M2 = np.array([[lane[3]] for lane in _U64_LANES], dtype=np.uint64)


def _np_xorshift32(x: np.ndarray, tmp: np.ndarray) -> None:
    """x ^= x >>> 32 in place (uint64 rows): on little-endian hosts the low 32-bit word ^= the high one, one
    strided pass; elsewhere a shift into tmp and an xor."""
    if _LITTLE:
        words = x.view(np.uint32)  # rows of 2m words (views only: x may be a column slice of a larger buffer)
        np.bitwise_xor(words[:, 0::2], words[:, 1::2], out=words[:, 0::2])
    else:
        np.right_shift(x, _U32, out=tmp)
        np.bitwise_xor(x, tmp, out=x)


def _np_terms(bits: np.ndarray, w: _NpWork, *, start: int | None = None,
              idx: np.ndarray | None = None) -> np.ndarray:
    """[lanes, m] uint64: mix_lane(bits ^ (C*i + K)) for one slice, in w.x; i = start + j or idx[j]. `bits` are
    the raw words (uint8, int16, int32 or int64): numpy widens them as the definition says (zero / sign
    extension) when xor-ing them into the int64 keys."""
    m = bits.shape[0]
    x = w.x[:, :m]
    if idx is None:
        np.add(w.keys[:, :m], (_NP_C * np.uint64(start & _M64)).view(np.int64), out=x)
    else:
        xu = x.view(np.uint64)
        np.multiply(idx.view(np.uint64)[None, :], _NP_C, out=xu)
        np.add(xu, _NP_K, out=xu)
    np.bitwise_xor(x, bits[None, :], out=x)
    u = x.view(np.uint64)
    t = w.tmp[:, :m]
    _np_xorshift32(u, t)
    np.multiply(u, _NP_M1, out=u)
    _np_xorshift32(u, t)
    np.multiply(u, _NP_M2, out=u)
    _np_xorshift32(u, t)
    return u


def _np_bits(flat: torch.Tensor) -> np.ndarray:
    """The raw words of a contiguous 1-D CPU slice as a numpy view (no copy)."""
    return _bits_view(flat).numpy()


def _cpu_sums(pieces: list[tuple[int, torch.Tensor]], base: int, dims, contiguous: bool, chunk: int) -> list[int]:
    """Per-lane sums (Python ints mod 2^64) over (local offset, contiguous 1-D slice) pieces of one tensor."""
    w = _NpWork(min(chunk, max(p.numel() for _, p in pieces)))
    sums = [0] * len(_LANES)
    for c0, flat in pieces:
        bits = _np_bits(flat)
        if contiguous:
            where = {"start": base + c0}
        else:
            where = {"idx": _global_index(torch.arange(c0, c0 + flat.numel()), base, dims).numpy()}
        for lane, v in enumerate(_np_terms(bits, w, **where).sum(axis=1, dtype=np.uint64).tolist()):
            sums[lane] += v
    return [v & _M64 for v in sums]


def _cpu_signature(t: torch.Tensor, base: int, dims, contiguous: bool) -> torch.Tensor:
    """The additive signature of a (non-empty) CPU tensor with the numpy kernel, its slices split over threads."""
    chunk = _chunk_for(t.device)
    pieces = [(c0, flat.detach()) for c0, flat in _slices(t, chunk)]
    threads = min(_threads(), len(pieces) // 4)
    if threads <= 1:
        sums = _cpu_sums(pieces, base, dims, contiguous, chunk)
    else:
        share = -(-len(pieces) // threads)
        futures = [_pool().submit(_cpu_sums, pieces[i:i + share], base, dims, contiguous, chunk)
                   for i in range(0, len(pieces), share)]
        parts = [f.result() for f in futures]
        sums = [sum(p[lane] for p in parts) & _M64 for lane in range(len(_LANES))]
    return torch.tensor([_s64(v) for v in sums], dtype=torch.int64)


# ----------------------------------------------------------------------------------------------------------------
# raw bits and indices


def _check_tensor(t: torch.Tensor) -> None:
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"signatures need a strided dense tensor, got layout {t.layout}")
    if t.is_quantized:
        raise TypeError("signatures of quantized tensors are not supported; use int_repr()")
    if t.device.type == "meta":
        raise TypeError("a meta tensor has no bits to fingerprint")


def _bits_view(flat: torch.Tensor) -> torch.Tensor:
    """The same elements reinterpreted as integers of the same width; copy_ into int64 widens them (zero-extends
    uint8, sign-extends int16/int32)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(flat.element_size())
    if view is None:
        raise TypeError(f"unsupported element size {flat.element_size()} for dtype {flat.dtype}")
    return flat.view(view)


def _slices(t: torch.Tensor, chunk: int, start: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """(local flat offset, 1-D contiguous slice) in row-major order; a non-contiguous tensor is copied one
    bounded block at a time."""
    n = t.numel()
    if n == 0:
        return
    if t.is_contiguous() or n <= chunk:
        flat = t.reshape(-1)
        for c0 in range(0, n, chunk):
            yield start + c0, flat[c0:c0 + chunk]
        return
    rows = t.shape[0]
    per_row = n // rows
    step = max(1, chunk // per_row)
    for r0 in range(0, rows, step):
        yield from _slices(t[r0:r0 + step] if step > 1 else t[r0], chunk, start + r0 * per_row)


def _index_map(local_shape, global_shape, offset) -> tuple[int, list[tuple[int, int]]]:
    """Global flat index of local flat index j: base + sum over (size, stride) of ((j // inner) % size) * stride,
    with adjacent dims merged where the global layout is contiguous. [] or [(n, 1)] means base + j."""
    if len(local_shape) != len(global_shape) or len(offset) != len(global_shape):
        raise ValueError(f"shape/offset ranks differ: local {tuple(local_shape)}, global {tuple(global_shape)}, "
                         f"offset {tuple(offset)}")
    gstrides, acc = [], 1
    for g in reversed(global_shape):
        gstrides.append(acc)
        acc *= g
    gstrides.reverse()
    base = 0
    for l, g, o, s in zip(local_shape, global_shape, offset, gstrides):
        if o < 0 or o + l > g:
            raise ValueError(f"local shape {tuple(local_shape)} at offset {tuple(offset)} "
                             f"exceeds global shape {tuple(global_shape)}")
        base += o * s
    dims: list[tuple[int, int]] = []
    for l, s in zip(local_shape, gstrides):
        if l == 1:
            continue
        if dims and dims[-1][1] == l * s:
            dims[-1] = (dims[-1][0] * l, s)
        else:
            dims.append((l, s))
    return base, dims


def _global_index(j: torch.Tensor, base: int, dims: list[tuple[int, int]]) -> torch.Tensor:
    g = torch.full_like(j, base)
    inner = 1
    for size, stride in reversed(dims):
        g.add_(torch.remainder(torch.div(j, inner, rounding_mode="floor"), size).mul_(stride))
        inner *= size
    return g


# ----------------------------------------------------------------------------------------------------------------
# public API


def tensor_signature(
    t: torch.Tensor,
    *,
    global_shape: Iterable[int] | None = None,
    global_offset: Iterable[int] | None = None,
    _work: _Work | None = None,
) -> torch.Tensor:
    """[2] int64 signature of t's bits, on t.device.

    With `global_shape`/`global_offset`, t is one box-shaped piece of a larger tensor and the result is its
    partial signature: the pieces of a tensor sum (mod 2^64) to the whole tensor's signature. A DTensor gives the
    partial signature of its local shard at its global offset (Shard/Replicate placements; for the full signature
    use `full_signatures`, which also makes each Replicate group count once).
    """
    if is_dtensor(t):
        if global_shape is not None or global_offset is not None:
            raise ValueError("a DTensor carries its own global shape and offset")
        box = _dtensor_box(t)
        if box is None:  # this rank is not part of the DTensor's mesh: it holds nothing
            return torch.zeros(2, dtype=torch.int64, device=t.to_local().device)
        t, global_shape, global_offset = box
    _check_tensor(t)
    shape = tuple(t.shape)
    if global_shape is None:
        if global_offset is not None:
            raise ValueError("global_offset needs global_shape")
        global_shape = shape
    global_shape = tuple(int(s) for s in global_shape)
    global_offset = (0,) * len(global_shape) if global_offset is None else tuple(int(o) for o in global_offset)
    if t.is_complex():  # element (i, real/imag) is element 2*i + c of the real view
        shape, global_shape, global_offset = shape + (2,), global_shape + (2,), global_offset + (0,)
        t = torch.view_as_real(t)
    base, dims = _index_map(shape, global_shape, global_offset)
    contiguous = not dims or (len(dims) == 1 and dims[0][1] == 1)
    device = t.device
    total = torch.zeros(2, dtype=torch.int64, device=device)
    n = t.numel()
    if n == 0:
        return total
    if device.type == "cpu" and CPU_KERNEL == "numpy":
        return _cpu_signature(t, base, dims, contiguous)
    chunk = _chunk_for(device)
    w = _work if _work is not None and _work.fits(device, min(n, chunk)) else _Work(device, min(n, chunk))
    for c0, flat in _slices(t, chunk):
        m = flat.numel()
        bits = _bits_view(flat)
        if bits.dtype != torch.int64:
            bits = w.bits[:m].copy_(bits)
        if contiguous:
            where = {"start": base + c0}
        else:
            where = {"idx": _global_index(torch.arange(c0, c0 + m, device=device), base, dims)}
        total.add_(torch.stack([_terms(bits, w, lane, **where).sum() for lane in range(len(_LANES))]))
    return total


def bytes_signature(data: bytes) -> torch.Tensor:
    """[2] int64 (CPU) fingerprint of a byte string: xxh3-128, high and low halves."""
    d = xxhash.xxh3_128_intdigest(data)
    return torch.tensor([_s64(d >> 64), _s64(d)], dtype=torch.int64)


def signature_hex(sig) -> str:
    """32 hex digits: lane 0 then lane 1, each as an unsigned 64-bit word."""
    if isinstance(sig, torch.Tensor):
        sig = sig.detach().reshape(-1).tolist()
    a, b = (int(v) for v in sig)
    return f"{a & _M64:016x}{b & _M64:016x}"


def add_signatures(*sigs) -> torch.Tensor:
    """Sum of [2] signatures mod 2^64 (on the host): the signature of the union of disjoint pieces."""
    a = b = 0
    for s in sigs:
        x, y = (int(v) for v in (s.tolist() if isinstance(s, torch.Tensor) else s))
        a, b = a + x, b + y
    return torch.tensor([_s64(a), _s64(b)], dtype=torch.int64)


def _numel(t: torch.Tensor) -> int:
    """Elements fingerprinted: a complex element counts twice (real, imaginary)."""
    return t.numel() * (2 if t.is_complex() else 1)


def _rows_to_host(rows: list[torch.Tensor]) -> torch.Tensor:
    """Stack [2] or [k, 2] signature rows (on any devices) into one [n, 2] CPU tensor, one copy per device."""
    if not rows:
        return torch.zeros(0, 2, dtype=torch.int64)
    rows = [r.reshape(-1, 2) for r in rows]
    by_device: dict[torch.device, list[int]] = {}
    for i, r in enumerate(rows):
        by_device.setdefault(r.device, []).append(i)
    host: list[torch.Tensor | None] = [None] * len(rows)
    for device, idxs in by_device.items():
        stacked = torch.cat([rows[i] for i in idxs]).cpu()
        for i, part in zip(idxs, stacked.split([rows[i].shape[0] for i in idxs])):
            host[i] = part
    return torch.cat(host)


def batch_signatures(items: list) -> torch.Tensor:
    """[n, 2] int64 on CPU: the signature of each tensor (or bytes leaf) in `items`, equal to what
    `tensor_signature` gives for the plain tensor (a DTensor counts as its local tensor, at local indices).

    Small tensors on one device are packed into shared slices and reduced with one index_add_ per pack, so
    thousands of small tensors cost a few dozen kernel launches; results are copied to the host once per device.
    """
    rows: list[torch.Tensor | None] = [None] * len(items)
    tensors: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, item in enumerate(items):
        if isinstance(item, (bytes, bytearray, memoryview)):
            rows[i] = bytes_signature(bytes(item))
        elif isinstance(item, torch.Tensor):
            t = item.to_local() if is_dtensor(item) else item
            _check_tensor(t)
            tensors.setdefault(t.device, []).append((i, t))
        else:
            raise TypeError(f"item {i}: expected a tensor or bytes, got {type(item).__name__}")
    for device, entries in tensors.items():
        chunk = _chunk_for(device)
        limit = min(SMALL, chunk)
        small = [(i, t) for i, t in entries if _numel(t) <= limit]
        large = [(i, t) for i, t in entries if _numel(t) > limit]
        need = max([sum(_numel(t) for _, t in small)] + [_numel(t) for _, t in large])
        cpu = device.type == "cpu" and CPU_KERNEL == "numpy"
        w = _NpWork(max(1, min(chunk, need))) if cpu else _Work(device, max(1, min(chunk, need)))
        for i, t in large:
            rows[i] = tensor_signature(t) if cpu else tensor_signature(t, _work=w)
        for pack in _packs(small, w.n):
            sums = (_np_pack_signatures if cpu else _pack_signatures)([t for _, t in pack], w)
            for row, (i, _) in enumerate(pack):
                rows[i] = sums[row]
    return _rows_to_host(rows)


def _packs(entries: list, cap: int) -> Iterator[list]:
    """Consecutive groups of (i, tensor) entries whose element counts sum to at most cap."""
    pack, used = [], 0
    for entry in entries:
        n = _numel(entry[1])
        if pack and used + n > cap:
            yield pack
            pack, used = [], 0
        pack.append(entry)
        used += n
    if pack:
        yield pack


def _pack_signatures(tensors: list[torch.Tensor], w: _Work) -> torch.Tensor:
    """[k, 2] signatures of k small tensors that fit together into one slice of w: each element's index is its
    index within its own tensor, and an index_add_ over segment ids sums the terms per tensor."""
    device = w.device
    sizes = [_numel(t) for t in tensors]
    m = sum(sizes)
    sums = torch.zeros(len(tensors), 2, dtype=torch.int64, device=device)
    if m == 0:
        return sums
    bits = w.bits[:m]
    o = 0
    for t, n in zip(tensors, sizes):
        if n:
            real = torch.view_as_real(t) if t.is_complex() else t
            bits[o:o + n].copy_(_bits_view(real.reshape(-1)))
        o += n
    counts = torch.tensor(sizes, dtype=torch.int64, device=device)
    seg = torch.repeat_interleave(torch.arange(len(tensors), device=device), counts, output_size=m)
    idx = torch.arange(m, device=device).sub_((torch.cumsum(counts, 0) - counts)[seg])
    for lane in range(len(_LANES)):
        sums[:, lane].index_add_(0, seg, _terms(bits, w, lane, idx=idx))
    return sums


def _np_pack_signatures(tensors: list[torch.Tensor], w: _NpWork) -> torch.Tensor:
    """`_pack_signatures` with the numpy kernel: the words of k small CPU tensors side by side in one int64
    buffer, each element keyed by its index within its own tensor, terms summed per tensor with add.reduceat."""
    sizes = [_numel(t) for t in tensors]
    m = sum(sizes)
    out = np.zeros((len(tensors), len(_LANES)), dtype=np.uint64)
    if m == 0:
        return torch.zeros(len(tensors), 2, dtype=torch.int64)
    bits = np.empty(m, dtype=np.int64)
    starts = np.zeros(len(tensors), dtype=np.int64)
    o = 0
    for j, (t, n) in enumerate(zip(tensors, sizes)):
        starts[j] = o
        if n:
            real = torch.view_as_real(t) if t.is_complex() else t
            bits[o:o + n] = _np_bits(real.detach().reshape(-1))  # widens: sign / zero extension
        o += n
    sizes_np = np.asarray(sizes, dtype=np.int64)
    idx = np.arange(m, dtype=np.int64) - np.repeat(starts, sizes_np)
    nonempty = sizes_np > 0
    terms = _np_terms(bits, w, idx=idx)
    out[nonempty] = np.add.reduceat(terms, starts[nonempty], axis=1, dtype=np.uint64).T
    return torch.from_numpy(out.view(np.int64))


def replica_signatures(items: list) -> torch.Tensor:
    """[n, 2] int64 on CPU: replica signatures of the tensors (or bytes leaves) in `items`, for comparing replicas
    of the same state with each other (save-time consensus). Exact (any bit flip changes it), order-sensitive.

    A CPU tensor: xxh3-128 of its raw bytes in row-major order (high, low halves, as `bytes_signature`); zero-copy
    for a contiguous tensor (a non-contiguous one is copied to a contiguous one first); tensors of at least
    POOL_MIN_BYTES are hashed in a thread pool of `THREADS` threads (xxh3 releases the GIL). A tensor on another
    device: its additive signature (`batch_signatures`, on the device). Not additive, so not a full signature;
    not comparable between a CPU tensor and a device tensor. A DTensor counts as its local tensor.
    """
    digests: dict[int, int] = {}
    pooled: list[tuple[int, Any]] = []
    device_items: list[tuple[int, torch.Tensor]] = []
    for i, item in enumerate(items):
        if isinstance(item, (bytes, bytearray, memoryview)):
            digests[i] = xxhash.xxh3_128_intdigest(bytes(item))
            continue
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"item {i}: expected a tensor or bytes, got {type(item).__name__}")
        t = item.to_local() if is_dtensor(item) else item
        _check_tensor(t)
        if t.device.type != "cpu":
            device_items.append((i, t))
            continue
        buf = _host_bytes(t)
        if buf.nbytes >= POOL_MIN_BYTES:
            pooled.append((i, buf))
        else:
            digests[i] = xxhash.xxh3_128_intdigest(buf)
    threads = min(_threads(), len(pooled))
    if threads > 1:
        pooled.sort(key=lambda e: -e[1].nbytes)  # largest first: the pool's queue balances the rest
        for (i, _), d in zip(pooled, _pool().map(xxhash.xxh3_128_intdigest, [b for _, b in pooled])):
            digests[i] = d
    else:
        for i, buf in pooled:
            digests[i] = xxhash.xxh3_128_intdigest(buf)
    out = torch.zeros(len(items), 2, dtype=torch.int64)
    if digests:
        idx = list(digests)
        out[idx] = torch.tensor([[_s64(digests[i] >> 64), _s64(digests[i])] for i in idx], dtype=torch.int64)
    if device_items:
        out[[i for i, _ in device_items]] = batch_signatures([t for _, t in device_items])
    return out


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a CPU tensor in row-major order, as a numpy uint8 view (a copy only if not contiguous)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


# ----------------------------------------------------------------------------------------------------------------
# state dicts


def _is_stateful(obj: Any) -> bool:
    """DCP's Stateful protocol (state_dict + load_state_dict), checked by duck typing as its runtime_checkable
    isinstance does, without importing torch.distributed.checkpoint."""
    return (not isinstance(obj, (torch.Tensor, Mapping, type)) and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")


def leaf_bytes(obj: Any) -> bytes:
    """Stable bytes of a non-tensor leaf, identical on every rank for equal values: the type's name, then JSON for
    scalars (floats keep their exact repr), the buffer of a numpy array, or the repr with object addresses removed
    for anything else."""
    typ = type(obj)
    head = f"{typ.__module__}.{typ.__qualname__}:".encode()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return head + json.dumps(obj).encode()
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return head + bytes(obj)
    if typ.__module__ == "numpy":
        import numpy as np

        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            return head + f"{arr.dtype.str}{arr.shape}:".encode() + arr.tobytes()
        if isinstance(obj, np.generic):
            return head + f"{obj.dtype.str}:".encode() + obj.tobytes()
    return head + _ADDR.sub("", repr(obj)).encode()


def _walk(obj: Any, key: str, out: dict, keep_dtensor: bool) -> None:
    if is_dtensor(obj):
        leaf = obj if keep_dtensor else obj.to_local()
    elif isinstance(obj, torch.Tensor):
        leaf = obj
    elif _is_stateful(obj):
        _walk(obj.state_dict(), key, out, keep_dtensor)
        return
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _walk(v, f"{key}.{k}" if key else str(k), out, keep_dtensor)
        return
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{key}.{i}" if key else str(i), out, keep_dtensor)
        return
    else:
        leaf = leaf_bytes(obj)
    if key in out:
        raise ValueError(f"two leaves of the state flatten to the same key {key!r}")
    out[key] = leaf


def flatten_state(state_dict: Mapping, *, keep_dtensor: bool = False) -> dict[str, Any]:
    """{dotted key: leaf}: nested dicts/lists/tuples become dotted keys, Stateful objects (modules, optimizers, DCP
    AppState wrappers) their state_dict(), DTensors their local tensor (or the DTensor with keep_dtensor), and
    non-tensor leaves stable bytes (`leaf_bytes`), so scalars such as the step and learning rate are compared too.
    Insertion order follows the state dict."""
    out: dict[str, Any] = {}
    _walk(state_dict, "", out, keep_dtensor)
    return out


def _dtensor_box(dt) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]] | None:
    """(local tensor, global shape, global offset) of a DTensor with Shard/Replicate placements; None on a rank
    outside its mesh."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    for p in dt.placements:
        if isinstance(p, _StridedShard) or not isinstance(p, (Shard, Replicate)):
            raise ValueError(f"full signatures support Shard(dim) and Replicate placements, not {p}")
    if dt.device_mesh.get_coordinate() is None:
        return None
    local = dt.to_local()
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    if tuple(shape) != tuple(local.shape):
        raise ValueError(f"local shard shape {tuple(local.shape)} differs from the placement's {tuple(shape)}")
    return local, tuple(dt.shape), tuple(offset)


def _dtensor_contributes(dt) -> bool:
    """One rank per Replicate group contributes: the one at coordinate 0 on every Replicate mesh dimension."""
    from torch.distributed.tensor import Replicate

    coord = dt.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, p in zip(coord, dt.placements) if isinstance(p, Replicate))


def assign_replicated(costs: list[int], world: int) -> list[int]:
    """Owner rank of each replicated item: greedy longest-processing-time assignment (largest first, ties by
    position, each to the least loaded rank, ties to the lowest rank). A function of the costs alone, so every rank
    computes the same assignment; each rank gets about 1/world of the bytes."""
    import heapq

    owners = [0] * len(costs)
    heap = [(0, r) for r in range(world)]
    for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    return owners


def _replicated_layout(flat: Mapping[str, Any], replicated: list[int]) -> tuple[list[int], int]:
    """(cost in bytes of each replicated tensor, 63-bit digest of keys, dtypes and shapes): what the assignment
    depends on. Non-tensor leaves cost nothing and stay with rank 0 (their bytes may legitimately differ)."""
    keys = list(flat)
    costs, blob = [], []
    for i in replicated:
        leaf = flat[keys[i]]
        if isinstance(leaf, torch.Tensor):
            costs.append(leaf.numel() * leaf.element_size())
            blob.append(f"{keys[i]}\0{leaf.dtype}{tuple(leaf.shape)}\0")
        else:
            costs.append(-1)
            blob.append(f"{keys[i]}\0bytes\0")
    return costs, xxhash.xxh3_64_intdigest("".join(blob).encode()) >> 1


def _same_everywhere(value: int, group) -> bool:
    """True on every rank iff `value` is the same on every rank of `group` (one all_reduce(MAX) of [v, -v])."""
    import torch.distributed as dist

    buf = torch.tensor([value, -value], dtype=torch.int64)
    backend = str(dist.get_backend(group))
    dev = buf if "gloo" in backend else buf.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(dev, op=dist.ReduceOp.MAX, group=group)
    hi, neg_lo = dev.cpu().tolist()
    return hi == -neg_lo


REPLICA_PREFIX = "r:"


def full_signatures(state_dict: Mapping, group=None, *, plain: str = "additive") -> dict[str, str]:
    """{dotted key: hex} full-tensor signatures of a (sharded) state; collective over `group` (default: world).

    Each rank computes the partial signature of what it holds at its global offsets and one all_reduce(SUM) of the
    [n, 2] partials gives every rank the full signatures. Who contributes:
      * a DTensor (Shard(dim) / Replicate placements, even or uneven): every rank of its mesh contributes its local
        shard, except that within each Replicate group only the rank at coordinate 0 of every Replicate mesh dim
        does (the others add zero), so each element is counted exactly once;
      * a plain tensor is taken as replicated: one rank of `group` signs it, the tensors spread over the ranks by
        size (`assign_replicated`), so each rank signs about 1/world of the bytes; if the ranks' plain tensors do
        not have the same keys, dtypes and shapes (checked by one tiny all_reduce), rank 0 signs all of them;
      * a non-tensor leaf (bytes) is signed by rank 0 of `group`.
    As in DCP, which writes one copy of replicated items, replicas that differ are C3's business, not this
    function's: the value recorded is that of the signing rank.
    Every rank of `group` must call it with the same keys in the same order, and `group` must contain every rank of
    every DTensor's mesh. The result does not depend on the number of ranks or the sharding, so state saved on N
    ranks and loaded on M ranks compare equal iff their bits are equal.

    plain="replica" signs plain tensors with `replica_signatures` instead (xxh3 on CPU, 20x faster than the
    additive hash) and marks their values with REPLICA_PREFIX: such a value compares only with another plain
    tensor's (not with a DTensor's after resharding), which is what a same-layout restart needs.
    """
    import torch.distributed as dist

    flat = flatten_state(state_dict, keep_dtensor=True)
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    grank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if distributed else 1
    rows: list[torch.Tensor] = []
    replicated: list[int] = []
    zero = torch.zeros(2, dtype=torch.int64)
    for i, leaf in enumerate(flat.values()):
        if is_dtensor(leaf):
            box = _dtensor_box(leaf)  # on every rank: a placement it cannot handle fails everywhere, not in a hang
            rows.append(tensor_signature(box[0], global_shape=box[1], global_offset=box[2])
                        if box is not None and _dtensor_contributes(leaf) else zero)
        else:
            rows.append(zero)
            replicated.append(i)
    sums = _rows_to_host(rows)
    costs, layout = _replicated_layout(flat, replicated)
    spread = world > 1 and _same_everywhere(layout, group)  # collective on every rank whatever it holds
    if replicated:
        if spread:
            tensor_idx = [j for j, c in enumerate(costs) if c >= 0]
            owners = [0] * len(replicated)
            for j, r in zip(tensor_idx, assign_replicated([costs[j] for j in tensor_idx], world)):
                owners[j] = r
        else:
            owners = [0] * len(replicated)
        leaves = list(flat.values())
        mine = [i for i, r in zip(replicated, owners) if r == grank]
        if mine:
            sign = replica_signatures if plain == "replica" else batch_signatures
            sums[mine] = sign([leaves[i] for i in mine])
    if distributed:
        backend = str(dist.get_backend(group))
        buf = sums if "gloo" in backend else sums.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        sums = buf.cpu()
    marked = set(replicated) if plain == "replica" else set()
    return {key: (REPLICA_PREFIX if i in marked else "") + signature_hex(sums[i]) for i, key in enumerate(flat)}
