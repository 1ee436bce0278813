"""The checks themselves, as seen from one rank: a tensor's local piece (View), and for each check kind a
planner that turns it into local verdicts (Local) or partial sums to all-reduce (Reduce)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scout_ckpt.invariants.specs import Check

SPECTRAL_GRAM_MAX = 1 << 22  # largest Gram matrix (elements) all-reduced for a sharded spectral check


# ---- tensors as seen from one rank -------------------------------------------------------------------------


@dataclass
class View:
    """One rank's piece of a tensor: the local data, where it sits in the global tensor, how many copies."""

    local: Any
    shape: tuple
    offset: tuple
    replicas: int = 1  # ranks holding this same piece (Replicate mesh dims)
    split: frozenset = frozenset()  # tensor dims sharded across ranks
    unsupported: str | None = None  # why this view cannot be combined (Partial, strided shards)

    @property
    def sharded(self) -> bool:
        return bool(self.split)


def _view(value) -> View:
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return View(value, tuple(value.shape), (0,) * value.dim())
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = value.device_mesh, value.placements
    local = value.to_local()
    replicas, split, unsupported = 1, set(), None
    for i, p in enumerate(placements):
        if p.is_replicate():
            replicas *= mesh.size(i)
        elif p.is_partial():
            unsupported = "Partial placement"
        elif type(p).__name__ == "_StridedShard":
            unsupported = "strided shard"
            split.add(p.dim)
        elif p.is_shard():
            split.add(p.dim)
    _, offset = compute_local_shape_and_global_offset(value.shape, mesh, placements)
    return View(local, tuple(value.shape), tuple(offset), replicas, frozenset(split), unsupported)


# ---- plans: what each (check, tensor) needs --------------------------------------------------------------


@dataclass
class Local:
    """Decided on this rank: ok=0, fail=1, error=2; value and index describe the worst finding."""

    code: int
    value: float = 0.0
    index: float = -1.0
    expected: Any = None


@dataclass
class Reduce:
    """Needs a sum over ranks. scalar: per-rank slots (attributable); vector: one summed segment."""

    partial: Any  # float64 tensor, already weighted by 1/replicas
    finalize: Callable[[Any, Any], Local]  # (total, per_rank or None) -> Local
    scalar: bool = False


def _floating(t) -> bool:
    return t.is_floating_point() or t.is_complex()


def _within(value: float, lo: float, hi: float) -> bool:
    return lo <= value <= hi  # False for NaN


def _power_sigma(matvec, rmatvec, n: int, iters: int, seed: int) -> float:
    """Largest singular value by power iteration on A^T A, in float64, from a seeded start: deterministic.

    The estimate never exceeds the true value and converges like (s2/s1)^(2k) for a spectral gap, and within
    about ln(n)/k relatively without one; hence spectral checks default to rtol=1e-2 with 100 iterations. An
    estimate above the bound is a certain violation; a NaN/Inf anywhere in the matrix gives NaN/Inf here."""
    import torch

    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g, dtype=torch.float64)
    v /= v.norm()
    sigma = 0.0
    for _ in range(iters):
        u = matvec(v)
        new = float(u.norm())
        if not math.isfinite(new) or new == 0.0:
            return new
        v = rmatvec(u)
        nv = float(v.norm())
        if not math.isfinite(nv) or nv == 0.0:
            return new if nv == 0.0 else nv
        v = v / nv
        if abs(new - sigma) <= 1e-12 * new:
            return new
        sigma = new
    return sigma


def _sigma_of_gram(g, iters: int, seed: int) -> float:
    lam = _power_sigma(lambda v: g @ v, lambda u: u, g.shape[0], iters, seed)
    # iterating v <- G v / |G v| and reading |G v| gives lambda_max(G) = sigma_max(A)^2
    return math.sqrt(lam) if lam >= 0 else lam


def _matrix(t):
    return t.reshape(t.shape[0], -1) if t.dim() > 2 else t


def _finite(check: Check, v: View) -> list:
    from scout_ckpt.invariants.finite import nonfinite

    t = v.local
    if not _floating(t):
        return []
    # the one finite check (finite.py): the writer's and certify's, correct for every dtype DCP saves
    bad, first = nonfinite(t)
    if not bad:
        return [Local(0)]
    return [Local(1, float(bad), _global_flat_index(v, first), expected=0)]


def _global_flat_index(v: View, local_flat: int) -> float:
    """Flat index in the global tensor of a local element (for reports)."""
    if not v.shape:
        return 0.0
    idx, rem = [], local_flat
    for s in reversed(v.local.shape):
        idx.append(rem % s if s else 0)
        rem //= s if s else 1
    idx = [i + o for i, o in zip(reversed(idx), v.offset)]
    flat = 0
    for i, s in zip(idx, v.shape):
        flat = flat * s + i
    return float(flat)


def _frobenius(check: Check, v: View) -> list:
    import torch

    if not _floating(v.local):
        return []
    r, rtol = check.args["radius"], check.args["rtol"]
    lo, hi = r * (1 - rtol), r * (1 + rtol)
    sumsq = float(torch.linalg.vector_norm(v.local, dtype=torch.float64) ** 2) if v.local.numel() else 0.0
    if not v.sharded:
        n = math.sqrt(sumsq)
        return [Local(0 if _within(n, lo, hi) else 1, n, expected=r)]

    def finalize(total, per_rank):
        n = math.sqrt(float(total)) if float(total) >= 0 else float("nan")
        if _within(n, lo, hi):
            return Local(0, n, expected=r)
        return Local(1, n, expected=r)

    return [Reduce(torch.tensor([sumsq / v.replicas], dtype=torch.float64), finalize, scalar=True)]


def _spectral(check: Check, v: View) -> list:
    import torch

    t = v.local
    if not _floating(t) or len(v.shape) < 2:
        return []
    a = check.args
    if check.kind == "spectral_sphere":
        expected = a["radius"]
        lo, hi = a["radius"] * (1 - a["rtol"]), a["radius"] * (1 + a["rtol"])
    else:
        expected = [a["lo"], None if a["hi"] == math.inf else a["hi"]]
        lo, hi = a["lo"] * (1 - a["rtol"]), a["hi"] * (1 + a["rtol"])

    def verdict(s: float) -> Local:
        return Local(0 if _within(s, lo, hi) else 1, s, expected=expected)

    if not v.sharded:
        w = _matrix(t).to(torch.float64)
        return [verdict(_power_sigma(lambda x: w @ x, lambda y: w.T @ y, w.shape[1], a["iters"], a["seed"]))]
    if len(v.shape) != 2 or v.unsupported:
        return [Local(2, expected="sharded spectral check needs a 2-D row- or column-sharded matrix")]
    w = t.to(torch.float64)
    m, n = v.shape
    if v.split == {0} and n * n <= SPECTRAL_GRAM_MAX:  # rows split: A^T A = sum of the ranks' W_r^T W_r
        gram, dim = torch.zeros(n, n, dtype=torch.float64), n
        gram += w.T @ w
    elif v.split == {1} and m * m <= SPECTRAL_GRAM_MAX:  # columns split: A A^T = sum of W_r W_r^T
        gram, dim = torch.zeros(m, m, dtype=torch.float64), m
        gram += w @ w.T
    else:
        return [Local(2, expected="sharded spectral check: Gram matrix too large or 2-D sharding")]

    def finalize(total, per_rank):
        return verdict(_sigma_of_gram(total.reshape(dim, dim), a["iters"], a["seed"]))

    return [Reduce((gram / v.replicas).reshape(-1), finalize)]


def _slices(
    check: Check, v: View, values, reduce_dim: int, expected, ok: Callable[[Any], Any], transform: Callable[[Any], Any]
) -> list:
    """Per-slice sums of `values` along reduce_dim of a 2-D view, checked with `ok` after `transform`."""
    import torch

    keep = 1 - reduce_dim
    if reduce_dim not in v.split:  # complete slices on this rank: decide here
        sums = (
            values.sum(dim=reduce_dim, dtype=torch.float64)
            if values.numel()
            else torch.zeros(values.shape[keep], dtype=torch.float64)
        )
        got = transform(sums)
        bad = ~ok(got)
        if not bool(bad.any()):
            return [Local(0)]
        i = int(bad.nonzero()[0, 0])
        return [Local(1, float(got[i]), float(i + (v.offset[keep] if len(v.offset) > keep else 0)), expected)]
    if v.unsupported or len(v.shape) != 2:
        return [Local(2, expected=f"slices split across ranks: {v.unsupported or 'needs a 2-D tensor'}")]
    full = torch.zeros(v.shape[keep], dtype=torch.float64)
    if values.numel():
        part = values.sum(dim=reduce_dim, dtype=torch.float64) / v.replicas
        full[v.offset[keep] : v.offset[keep] + part.shape[0]] = part

    def finalize(total, per_rank):
        got = transform(total)
        bad = ~ok(got)
        if not bool(bad.any()):
            return Local(0)
        i = int(bad.nonzero()[0, 0])
        return Local(1, float(got[i]), float(i), expected)

    return [Reduce(full, finalize)]


def _oblique(check: Check, v: View) -> list:
    import torch

    if not _floating(v.local) or len(v.shape) < 2:
        return []
    a = check.args
    r, rtol = a["radius"], a["rtol"]
    t = _matrix(v.local)
    sq = t.to(torch.float64) ** 2
    reduce_dim = 1 if a["axis"] == "rows" else 0
    return _slices(check, v, sq, reduce_dim, r, lambda n: (n >= r * (1 - rtol)) & (n <= r * (1 + rtol)), torch.sqrt)


def _simplex(check: Check, v: View) -> list:

    t = v.local
    if not _floating(t) or len(v.shape) == 0:
        return []
    atol = check.args["atol"]
    out = []
    neg = ~(t >= -atol)  # local: every element non-negative (NaN fails)
    if bool(neg.any()):
        i = int(neg.reshape(-1).nonzero()[0, 0])
        out.append(Local(1, float(t.reshape(-1)[i]), _global_flat_index(v, i), expected=">= 0"))
    else:
        out.append(Local(0))
    if len(v.shape) == 1:  # one distribution: a single row
        vv = View(
            t.reshape(1, -1),
            (1,) + v.shape,
            (0,) + v.offset,
            v.replicas,
            frozenset(d + 1 for d in v.split),
            v.unsupported,
        )
    elif len(v.shape) == 2:  # one distribution per row
        vv = v
    elif not v.sharded:  # leading dims flattened: one distribution per last-dim slice
        vv = View(t.reshape(-1, t.shape[-1]), (math.prod(v.shape[:-1]), v.shape[-1]), (0, 0))
    else:
        return out + [Local(2, expected="simplex on a sharded tensor of more than 2 dims")]
    out += _slices(check, vv, vv.local, 1, 1.0, lambda s: (s - 1.0).abs() <= atol, lambda s: s)
    return out


def _monotone(check: Check, value, previous) -> Local:
    try:
        x = float(value.reshape(-1)[0]) if hasattr(value, "reshape") and value.numel() == 1 else float(value)
    except (TypeError, ValueError, RuntimeError):
        return Local(2, expected="a scalar counter")
    if previous is None:
        return Local(0 if math.isfinite(x) else 1, x)
    ok = x > previous if check.args["strict"] else x >= previous
    return Local(0 if ok else 1, x, expected=(">" if check.args["strict"] else ">=") + f" {previous}")


_PLANNERS = {
    "finite": _finite,
    "frobenius_sphere": _frobenius,
    "spectral_sphere": _spectral,
    "spectral_bound": _spectral,
    "oblique": _oblique,
    "simplex": _simplex,
}
