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


Modules: kernels.py (the two kernels, raw bits, slicing, packing), indexing.py (DTensor index maths), flatten.py
(state dicts as flat maps), full.py (full_signatures, collective); this module keeps the definition, the knobs
below and the per-tensor entry points. `flatten_state` and `leaf_bytes` are still importable from here; the collective
(`full_signatures`, `assign_replicated`, `REPLICA_PREFIX`) is imported from full.py, which stands on this module.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

import numpy as np
import torch
import xxhash

from scout_ckpt.consensus.flatten import flatten_state, leaf_bytes  # noqa: F401  (re-exported)
from scout_ckpt.consensus.indexing import dtensor_box, global_index, index_map
from scout_ckpt.consensus.kernels import (
    LANES,
    M64,
    TorchWork,
    bits_view,
    check_tensor,
    cpu_sums,
    np_pack_signatures,
    np_work,
    numel,
    pack_signatures,
    packs,
    rows_to_host,
    s64,
    slices,
    torch_terms,
)
from scout_ckpt.consensus.mesh import is_dtensor

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
# so a rank limited to one intra-op thread (scout_ckpt.testing.launch) stays on one thread.
THREADS: int | None = None
# Replica signatures: CPU tensors of at least this many bytes are hashed in the thread pool, smaller ones inline.
POOL_MIN_BYTES = 1 << 20
SMALL_PLAIN = 1 << 16  # replica_signatures copies the bytes of a plain CPU tensor below this (see _small_plain)


def _chunk_for(device: torch.device) -> int:
    return CHUNK.get(device.type, CHUNK_DEFAULT)


def _threads() -> int:
    return max(1, THREADS if THREADS is not None else torch.get_num_threads())


_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """One process-wide pool, made again in a forked child (a parent's pool threads do not survive a fork)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (
                os.getpid(),
                ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="scout-sig"),
            )
        return _POOL[1]


def _cpu_signature(t: torch.Tensor, base: int, dims, contiguous: bool) -> torch.Tensor:
    """The additive signature of a (non-empty) CPU tensor with the numpy kernel, its slices split over threads."""
    chunk = _chunk_for(t.device)
    pieces = [(c0, flat.detach()) for c0, flat in slices(t, chunk)]
    threads = min(_threads(), len(pieces) // 4)
    if threads <= 1:
        sums = cpu_sums(pieces, base, dims, contiguous, chunk)
    else:
        share = -(-len(pieces) // threads)
        futures = [
            _pool().submit(cpu_sums, pieces[i : i + share], base, dims, contiguous, chunk)
            for i in range(0, len(pieces), share)
        ]
        parts = [f.result() for f in futures]
        sums = [sum(p[lane] for p in parts) & M64 for lane in range(len(LANES))]
    return torch.tensor([s64(v) for v in sums], dtype=torch.int64)


def tensor_signature(
    t: torch.Tensor,
    *,
    global_shape: Iterable[int] | None = None,
    global_offset: Iterable[int] | None = None,
    _work: TorchWork | None = None,
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
        box = dtensor_box(t)
        if box is None:  # this rank is not part of the DTensor's mesh: it holds nothing
            return torch.zeros(2, dtype=torch.int64, device=t.to_local().device)
        t, global_shape, global_offset = box
    check_tensor(t)
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
    base, dims = index_map(shape, global_shape, global_offset)
    contiguous = not dims or (len(dims) == 1 and dims[0][1] == 1)
    device = t.device
    total = torch.zeros(2, dtype=torch.int64, device=device)
    n = t.numel()
    if n == 0:
        return total
    if device.type == "cpu" and CPU_KERNEL == "numpy":
        return _cpu_signature(t, base, dims, contiguous)
    chunk = _chunk_for(device)
    w = _work if _work is not None and _work.fits(device, min(n, chunk)) else TorchWork(device, min(n, chunk))
    for c0, flat in slices(t, chunk):
        m = flat.numel()
        bits = bits_view(flat)
        if bits.dtype != torch.int64:
            bits = w.bits[:m].copy_(bits)
        if contiguous:
            where = {"start": base + c0}
        else:
            where = {"idx": global_index(torch.arange(c0, c0 + m, device=device), base, dims)}
        total.add_(torch.stack([torch_terms(bits, w, lane, **where).sum() for lane in range(len(LANES))]))
    return total


def digest_row(d: int) -> list[int]:
    """A 128-bit digest as a signature row: its high and low halves, each a signed 64-bit int."""
    return [s64(d >> 64), s64(d)]


def bytes_signature(data: bytes) -> torch.Tensor:
    """[2] int64 (CPU) fingerprint of a byte string: xxh3-128, high and low halves."""
    return torch.tensor(digest_row(xxhash.xxh3_128_intdigest(data)), dtype=torch.int64)


def signature_hex(sig) -> str:
    """32 hex digits: lane 0 then lane 1, each as an unsigned 64-bit word."""
    if isinstance(sig, torch.Tensor):
        sig = sig.detach().reshape(-1).tolist()
    a, b = (int(v) for v in sig)
    return f"{a & M64:016x}{b & M64:016x}"


def add_signatures(*sigs) -> torch.Tensor:
    """Sum of [2] signatures mod 2^64 (on the host): the signature of the union of disjoint pieces."""
    a = b = 0
    for s in sigs:
        x, y = (int(v) for v in (s.tolist() if isinstance(s, torch.Tensor) else s))
        a, b = a + x, b + y
    return torch.tensor([s64(a), s64(b)], dtype=torch.int64)


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
            check_tensor(t)
            tensors.setdefault(t.device, []).append((i, t))
        else:
            raise TypeError(f"item {i}: expected a tensor or bytes, got {type(item).__name__}")
    for device, entries in tensors.items():
        chunk = _chunk_for(device)
        limit = min(SMALL, chunk)
        small = [(i, t) for i, t in entries if numel(t) <= limit]
        large = [(i, t) for i, t in entries if numel(t) > limit]
        need = max([sum(numel(t) for _, t in small)] + [numel(t) for _, t in large])
        cpu = device.type == "cpu" and CPU_KERNEL == "numpy"
        w = np_work(max(1, min(chunk, need))) if cpu else TorchWork(device, max(1, min(chunk, need)))
        for i, t in large:
            rows[i] = tensor_signature(t) if cpu else tensor_signature(t, _work=w)
        for pack in packs(small, w.n):
            sums = (np_pack_signatures if cpu else pack_signatures)([t for _, t in pack], w)
            for row, (i, _) in enumerate(pack):
                rows[i] = sums[row]
    return rows_to_host(rows)


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
        if _small_plain(item):
            # its own bytes copied out (data_ptr includes the storage offset): a replay's hundreds of small
            # tensors (optimizer windows, biases) paid tens of microseconds each for the general path below
            digests[i] = xxhash.xxh3_128_intdigest(ctypes.string_at(item.data_ptr(), item.nbytes))
            continue
        if isinstance(item, (bytes, bytearray, memoryview)):
            digests[i] = xxhash.xxh3_128_intdigest(bytes(item))
            continue
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"item {i}: expected a tensor or bytes, got {type(item).__name__}")
        t = item.to_local() if is_dtensor(item) else item
        check_tensor(t)
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
        out[idx] = torch.tensor([digest_row(digests[i]) for i in idx], dtype=torch.int64)
    if device_items:
        out[[i for i, _ in device_items]] = batch_signatures([t for _, t in device_items])
    return out


def holds_row_major(t: torch.Tensor) -> bool:
    """Whether a CPU tensor's memory, from data_ptr on, holds exactly its row-major bytes: dense, contiguous, not
    quantized, no conjugate or negative bit. Such memory hashes to its replica signature as it is."""
    return (
        t.is_cpu
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
    )


def _small_plain(t) -> bool:
    """A plain, non-empty tensor under SMALL_PLAIN bytes that `holds_row_major`: hashed from a copy of those
    bytes, the same digest as `_host_bytes` gives, without its per-tensor torch and numpy calls."""
    return type(t) is torch.Tensor and 0 < t.nbytes < SMALL_PLAIN and holds_row_major(t)


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
