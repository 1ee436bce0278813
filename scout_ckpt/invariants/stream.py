"""Element-wise invariants checked piece by piece, on the buffers `certify` reads and hashes (scan.py).

`run_offline` needs a whole tensor in memory, and its float64 Frobenius norm costs 0.4-0.8 s per GB of float32 on
one core, more than reading and hashing the same bytes. `finite` and `frobenius_sphere` only need a sum over the
elements, so they are checked on each piece of the tensor's bytes right after the hasher read it, while it is in
the cache, and nothing of the tensor is kept. The other kinds (spectral, oblique, simplex, monotone) need the
tensor as a whole: a tensor any of them matches is not streamed (`streams` is False) and goes to `run_offline`.

Per piece, fast reductions decide and an exact element check is taken only when they cannot vouch:
- finite: the one finite check (finite.py, the writer's too): a sum, or for one-byte floats a masked reduction
  of the bits, proves a piece finite; otherwise the exact element check counts the bad elements and finds the
  first. The same sum of squares the Frobenius check needs proves it too, when both apply.
- frobenius_sphere: the sum of squares, in float32 with torch's cascade summation (relative error ~1e-8 where
  the float64 norm is ~1e-15, against a default rtol of 1e-3), accumulated over pieces in float64. A square that
  overflows or a piece whose sum lies outside [1e-20, 1e30] (overflow, or underflowed squares that could matter)
  is recomputed in float64, so is any piece of another dtype than float32 (a half-precision square keeps 8 or 11
  bits) - bf16 and fp16 are widened to float32 exactly first.
The evidence is the one `run_offline` gives for the same tensor (same reasons, same first index and count); only
the Frobenius value's last digits can differ.
"""

from __future__ import annotations

import math
import threading

from scout_ckpt.invariants.specs import Check
from scout_ckpt.policy import FAIL, INCONCLUSIVE, PASS, evidence

STREAMABLE = ("finite", "frobenius_sphere")
_LO, _HI = 1e-20, 1e30  # a float32 piece sum of squares outside this range is recomputed in float64
SMALL = 1 << 16  # pieces of at most this many elements are summed in float64 (cheap; exact figures)


def _floating(dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def applicable(checks: list[Check], name: str, dtype) -> list[int]:
    """Indices of the checks that would plan something for a tensor `name` of `dtype` (as `run_offline` would:
    the element-wise kinds skip non-floating tensors; every other kind is counted as applying)."""
    out = []
    for i, c in enumerate(checks):
        if not c.matches(name):
            continue
        if c.kind in STREAMABLE and not _floating(dtype):
            continue
        out.append(i)
    return out


def streams(checks: list[Check], name: str, dtype) -> bool:
    """True when every check that applies to this tensor can be checked piece by piece: `finite` for any dtype
    (finite.py decides each from its bits), `frobenius_sphere` for the dtypes its sums of squares are written
    for (float8 and the like then go to `run_offline`)."""
    import torch

    idx = applicable(checks, name, dtype)
    if any(checks[i].kind not in STREAMABLE for i in idx):
        return False
    if all(checks[i].kind == "finite" for i in idx):
        return True
    return dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128)


class Scratch:
    """Per-thread reusable float32 space for the squares and widened pieces (no allocation per piece)."""

    def __init__(self):
        self._t = None

    def get(self, n: int):
        import torch

        if self._t is None or self._t.numel() < n:
            self._t = torch.empty(n, dtype=torch.float32)
        return self._t[:n]


class TensorStream:
    """The streamed checks of one tensor (all its chunks, in any order, from any thread). `update` each piece;
    `done` once every element was seen; then `evidence()`."""

    def __init__(self, checks: list[Check], name: str, dtype, size: tuple):
        self.checks, self.name, self.dtype, self.size = checks, name, dtype, tuple(size)
        self.todo = applicable(checks, name, dtype)
        kinds = {checks[i].kind for i in self.todo}
        self.want_finite = "finite" in kinds
        self.want_sumsq = "frobenius_sphere" in kinds
        self.missing = math.prod(self.size)
        self._lock = threading.Lock()
        self.bad = 0  # non-finite elements
        self.first: int | None = None  # flat index (in the whole tensor) of the first one
        self.sumsq = 0.0
        self.reported = False  # evidence handed out (by the scanner, once)

    def update(self, piece, scratch: Scratch, start: int = 0, chunk=None) -> None:
        """Check one flat piece (a 1-D tensor of this tensor's dtype): elements [start, start + n) of the chunk
        (`chunk`: its ChunkStorageMetadata, None for the whole tensor)."""
        import torch

        from scout_ckpt.invariants.finite import nonfinite

        n = piece.numel()
        bad, first, sumsq = 0, None, 0.0
        if n and (self.want_finite or self.want_sumsq):
            finite_ok = None
            if self.want_sumsq:
                real = torch.view_as_real(piece).reshape(-1) if piece.is_complex() else piece
                sumsq = _sumsq(real, scratch)
                finite_ok = math.isfinite(sumsq) or None  # not finite: decide below, exactly
            if self.want_finite and finite_ok is None:
                bad, local = nonfinite(piece)  # the one finite check (finite.py), the writer's too
                if bad:
                    first = self._flat(start + local, chunk)
        with self._lock:
            self.bad += bad
            if first is not None and (self.first is None or first < self.first):
                self.first = first
            self.sumsq += sumsq
            self.missing -= n

    @property
    def done(self) -> bool:
        return self.missing <= 0

    def _flat(self, local: int, chunk) -> int:
        """The flat index in the whole tensor of element `local` of a chunk."""
        if chunk is None or tuple(chunk.sizes) == self.size:
            return local
        idx = []
        for s in reversed(tuple(chunk.sizes)):
            idx.append(local % s if s else 0)
            local //= s if s else 1
        flat = 0
        for i, o, s in zip(reversed(idx), chunk.offsets, self.size):
            flat = flat * s + i + o
        return flat

    def evidence(self) -> dict:
        """What `run_offline(checks, {name: tensor})` gives for this tensor."""
        reasons = []
        checked = {c.label: 0 for c in self.checks}
        for i in self.todo:
            c = self.checks[i]
            checked[c.label] += 1
            if c.kind == "finite":
                if self.bad:
                    reasons.append(
                        {
                            "code": "invariant_failed",
                            "check": c.kind,
                            "spec": c.label,
                            "tensor": self.name,
                            "value": float(self.bad),
                            "expected": 0,
                            "ranks": [0],
                            "index": int(self.first),
                        }
                    )
            else:
                r, rtol = c.args["radius"], c.args["rtol"]
                n = math.sqrt(self.sumsq) if self.sumsq >= 0 else float("nan")
                if not (r * (1 - rtol) <= n <= r * (1 + rtol)):
                    reasons.append(
                        {
                            "code": "invariant_failed",
                            "check": c.kind,
                            "spec": c.label,
                            "tensor": self.name,
                            "value": n if math.isfinite(n) else str(n),
                            "expected": r,
                            "ranks": [0],
                        }
                    )
        errors = [
            {"code": "invariant_no_match", "check": c.kind, "spec": c.label, "detail": f"no tensor matches {c.glob!r}"}
            for c in self.checks
            if not checked[c.label]
        ]
        status = FAIL if reasons else INCONCLUSIVE if errors else PASS
        return evidence(
            status,
            reasons + errors,
            checks=[c.spec for c in self.checks],
            checked=checked,
            values={},
            collectives=0,
            reduced_floats=0,
        )


def _sumsq(x, scratch: Scratch) -> float:
    """Sum of squares of a real piece: float32 squares in the scratch space and a cascade sum, unless that could
    lose precision (see the module docstring); then float64. NaN/Inf if an element is."""
    import torch

    if x.dtype == torch.float64 or x.numel() <= SMALL:
        return _sumsq64(x)
    sq = scratch.get(x.numel())
    if x.dtype == torch.float32:
        torch.mul(x, x, out=sq)
    else:  # bf16, fp16 (and float8): widen exactly, then square
        sq.copy_(x)
        sq.mul_(sq)
    s = float(sq.sum())
    if _LO <= s <= _HI:
        return s
    if s == 0.0 and not bool(x.any()):  # all zeros: exact
        return 0.0
    return _sumsq64(x)


def _sumsq64(x) -> float:
    """The float64 sum of squares exactly as `run_offline` computes it (same figure for a one-piece tensor)."""
    import torch

    return float(torch.linalg.vector_norm(x, dtype=torch.float64) ** 2)
