"""The two kernels of the additive signature (signatures.py gives its definition): torch integer ops on the
tensor's device, and numpy ufuncs on uint64 for CPU tensors (numpy's 64-bit multiply and logical shift are about
twice as fast as torch's int64 ones on one thread; bench/signature_throughput.py). Both give the same value (tests
compare them). Also the raw-bit views, row-major slicing and small-tensor packing both kernels share.

Lane constants are part of the definition: the ledger stores signatures, so changing any constant here changes
every stored value.
"""

from __future__ import annotations

import sys
import threading
from typing import Iterator

import numpy as np
import torch

from scout_ckpt.consensus.indexing import global_index

M64 = (1 << 64) - 1


def s64(v: int) -> int:
    """A 64-bit pattern as the signed int64 value torch stores."""
    v &= M64
    return v - (1 << 64) if v >= 1 << 63 else v


# (index multiplier C (odd), index offset K, multipliers M1, M2 (odd)) of each lane
LANES = (
    (s64(0x9E3779B97F4A7C15), s64(0x632BE59BD9B4E019), s64(0xD6E8FEB86659FD93), s64(0xD6E8FEB86659FD93)),
    (s64(0xBF58476D1CE4E5B9), s64(0x8CB92BA72F3D8DD7), s64(0xFF51AFD7ED558CCD), s64(0xC4CEB9FE1A85EC53)),
)
_LITTLE = sys.byteorder == "little"


class TorchWork:
    """Scratch buffers for one device, reused across slices (no allocator churn, no fresh pages per slice), and
    each lane's key template C*j + K for j < n: the keys of a contiguous slice starting at global index g are
    template + C*g, one add instead of an arange, a multiply and an add."""

    def __init__(self, device: torch.device, n: int):
        self.device = device
        self.n = n
        self.bits = torch.empty(n, dtype=torch.int64, device=device)
        self.x = torch.empty(n, dtype=torch.int64, device=device)
        j = torch.arange(n, dtype=torch.int64, device=device)
        self.keys = [j * c + k for c, k, _, _ in LANES]

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


def torch_terms(
    bits: torch.Tensor, w: TorchWork, lane_no: int, *, start: int | None = None, idx: torch.Tensor | None = None
) -> torch.Tensor:
    """mix_lane(bits ^ (C*i + K)) for one slice, in w.x[:m]; i = start + j (contiguous) or idx[j]."""
    lane = LANES[lane_no]
    c, k, _, _ = lane
    m = bits.numel()
    x = w.x[:m]
    if idx is None:
        torch.add(w.keys[lane_no][:m], s64(c * start), out=x)
    else:
        torch.mul(idx, c, out=x)
        x.add_(k)
    x.bitwise_xor_(bits)
    _mix_into(x, lane)
    return x


_U64_LANES = tuple(tuple(np.uint64(v & M64) for v in lane) for lane in LANES)
_U32 = np.uint64(32)


class NpWork:
    """numpy scratch for the CPU kernel, both lanes side by side ([2, n] rows): the key templates C*j + K (int64,
    so that xor with sign-extended narrower words widens correctly), the terms buffer and a shift temporary."""

    def __init__(self, n: int):
        j = np.arange(n, dtype=np.uint64)
        self.n = n
        self.keys = np.stack([j * c + k for c, k, _, _ in _U64_LANES]).view(np.int64)
        self.x = np.empty((len(LANES), n), dtype=np.int64)
        self.tmp = np.empty((len(LANES), n), dtype=np.uint64)


_SCRATCH = threading.local()


def np_work(n: int) -> NpWork:
    """This thread's NpWork of at least `n` elements, kept for the thread's next signatures: a save signs hundreds
    of tensors, and building the key templates and buffers afresh for each (an arange, two multiplies, fresh pages)
    cost about a quarter of the CPU kernel's time on a transformer's shards. One per thread, since the consensus
    thread and the signature pool sign concurrently; every user takes slices `[:, :m]` of it."""
    w = getattr(_SCRATCH, "work", None)
    if w is None or w.n < n:
        w = _SCRATCH.work = NpWork(n)
    return w


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


def _np_terms(bits: np.ndarray, w: NpWork, *, start: int | None = None, idx: np.ndarray | None = None) -> np.ndarray:
    """[lanes, m] uint64: mix_lane(bits ^ (C*i + K)) for one slice, in w.x; i = start + j or idx[j]. `bits` are
    the raw words (uint8, int16, int32 or int64): numpy widens them as the definition says (zero / sign
    extension) when xor-ing them into the int64 keys."""
    m = bits.shape[0]
    x = w.x[:, :m]
    if idx is None:
        np.add(w.keys[:, :m], (_NP_C * np.uint64(start & M64)).view(np.int64), out=x)
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


def np_bits(flat: torch.Tensor) -> np.ndarray:
    """The raw words of a contiguous 1-D CPU slice as a numpy view (no copy)."""
    return bits_view(flat).numpy()


def cpu_sums(pieces: list[tuple[int, torch.Tensor]], base: int, dims, contiguous: bool, chunk: int) -> list[int]:
    """Per-lane sums (Python ints mod 2^64) over (local offset, contiguous 1-D slice) pieces of one tensor."""
    w = np_work(min(chunk, max(p.numel() for _, p in pieces)))
    sums = [0] * len(LANES)
    for c0, flat in pieces:
        bits = np_bits(flat)
        if contiguous:
            where = {"start": base + c0}
        else:
            where = {"idx": global_index(torch.arange(c0, c0 + flat.numel()), base, dims).numpy()}
        for lane, v in enumerate(_np_terms(bits, w, **where).sum(axis=1, dtype=np.uint64).tolist()):
            sums[lane] += v
    return [v & M64 for v in sums]


def check_tensor(t: torch.Tensor) -> None:
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"signatures need a strided dense tensor, got layout {t.layout}")
    if t.is_quantized:
        raise TypeError("signatures of quantized tensors are not supported; use int_repr()")
    if t.device.type == "meta":
        raise TypeError("a meta tensor has no bits to fingerprint")


def bits_view(flat: torch.Tensor) -> torch.Tensor:
    """The same elements reinterpreted as integers of the same width; copy_ into int64 widens them (zero-extends
    uint8, sign-extends int16/int32)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(flat.element_size())
    if view is None:
        raise TypeError(f"unsupported element size {flat.element_size()} for dtype {flat.dtype}")
    return flat.view(view)


def slices(t: torch.Tensor, chunk: int, start: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """(local flat offset, 1-D contiguous slice) in row-major order; a non-contiguous tensor is copied one
    bounded block at a time."""
    n = t.numel()
    if n == 0:
        return
    if t.is_contiguous() or n <= chunk:
        flat = t.reshape(-1)
        for c0 in range(0, n, chunk):
            yield start + c0, flat[c0 : c0 + chunk]
        return
    rows = t.shape[0]
    per_row = n // rows
    step = max(1, chunk // per_row)
    for r0 in range(0, rows, step):
        yield from slices(t[r0 : r0 + step] if step > 1 else t[r0], chunk, start + r0 * per_row)


def numel(t: torch.Tensor) -> int:
    """Elements fingerprinted: a complex element counts twice (real, imaginary)."""
    return t.numel() * (2 if t.is_complex() else 1)


def rows_to_host(rows: list[torch.Tensor]) -> torch.Tensor:
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


def packs(entries: list, cap: int) -> Iterator[list]:
    """Consecutive groups of (i, tensor) entries whose element counts sum to at most cap."""
    pack, used = [], 0
    for entry in entries:
        n = numel(entry[1])
        if pack and used + n > cap:
            yield pack
            pack, used = [], 0
        pack.append(entry)
        used += n
    if pack:
        yield pack


def pack_signatures(tensors: list[torch.Tensor], w: TorchWork) -> torch.Tensor:
    """[k, 2] signatures of k small tensors that fit together into one slice of w: each element's index is its
    index within its own tensor, and an index_add_ over segment ids sums the terms per tensor."""
    device = w.device
    sizes = [numel(t) for t in tensors]
    m = sum(sizes)
    sums = torch.zeros(len(tensors), 2, dtype=torch.int64, device=device)
    if m == 0:
        return sums
    bits = w.bits[:m]
    o = 0
    for t, n in zip(tensors, sizes):
        if n:
            real = torch.view_as_real(t) if t.is_complex() else t
            bits[o : o + n].copy_(bits_view(real.reshape(-1)))
        o += n
    counts = torch.tensor(sizes, dtype=torch.int64, device=device)
    seg = torch.repeat_interleave(torch.arange(len(tensors), device=device), counts, output_size=m)
    idx = torch.arange(m, device=device).sub_((torch.cumsum(counts, 0) - counts)[seg])
    for lane in range(len(LANES)):
        sums[:, lane].index_add_(0, seg, torch_terms(bits, w, lane, idx=idx))
    return sums


def np_pack_signatures(tensors: list[torch.Tensor], w: NpWork) -> torch.Tensor:
    """`pack_signatures` with the numpy kernel: the words of k small CPU tensors side by side in one int64
    buffer, each element keyed by its index within its own tensor, terms summed per tensor with add.reduceat."""
    sizes = [numel(t) for t in tensors]
    m = sum(sizes)
    out = np.zeros((len(tensors), len(LANES)), dtype=np.uint64)
    if m == 0:
        return torch.zeros(len(tensors), 2, dtype=torch.int64)
    bits = np.empty(m, dtype=np.int64)
    starts = np.zeros(len(tensors), dtype=np.int64)
    o = 0
    for j, (t, n) in enumerate(zip(tensors, sizes)):
        starts[j] = o
        if n:
            real = torch.view_as_real(t) if t.is_complex() else t
            bits[o : o + n] = np_bits(real.detach().reshape(-1))  # widens: sign / zero extension
        o += n
    sizes_np = np.asarray(sizes, dtype=np.int64)
    idx = np.arange(m, dtype=np.int64) - np.repeat(starts, sizes_np)
    nonempty = sizes_np > 0
    terms = _np_terms(bits, w, idx=idx)
    out[nonempty] = np.add.reduceat(terms, starts[nonempty], axis=1, dtype=np.uint64).T
    return torch.from_numpy(out.view(np.int64))
