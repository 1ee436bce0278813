"""Model-intrinsic invariants: properties a healthy state has whether or not a replica exists to compare with.

A check is configured as a JSON-able spec (stored in the run's policy and in each manifest, so `certify` can
re-run it offline from the saved bytes):

    {"check": "frobenius_sphere", "params": "blocks.*.weight", "radius": 1.0, "rtol": 1e-3}
    "frobenius_sphere:radius=1.0:params=blocks.*.weight"          (string shorthand)

`params` (alias `path`) is an fnmatch glob over flat DCP keys; it also matches after any dotted prefix, so
"blocks.*.weight" finds "model.blocks.0.weight" on disk and "blocks.0.weight" in memory.

run_local works on each rank's own shard. Properties that are local (finite, a row norm of a row-sharded matrix,
a replicated counter) are checked where the data is; the rest (the Frobenius norm of a sharded DTensor, the
spectral norm via the Gram matrix of a row- or column-sharded matrix, row sums split across ranks) are combined
with ONE all_reduce of a small float64 vector, in which every rank also writes its own failure bitmap, so every
rank ends with the same evidence naming the failing ranks. A 4 x int64 all_reduce runs before it to prove that
all ranks planned the same layout (otherwise the data all_reduce could mismatch and hang).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import xxhash

from scout_ckpt.errors import BadInput
from scout_ckpt.policy import FAIL, INCONCLUSIVE, PASS, evidence

SPECTRAL_GRAM_MAX = 1 << 22   # largest Gram matrix (elements) all-reduced for a sharded spectral check


@dataclass(frozen=True)
class Param:
    default: Any = None
    required: bool = False
    kind: type = float


# Each kind: its parameters and the key its glob is stored under.
KINDS: dict[str, dict[str, Param]] = {
    "finite": {"params": Param("*", kind=str)},
    "frobenius_sphere": {"params": Param(required=True, kind=str), "radius": Param(required=True),
                         "rtol": Param(1e-3)},
    "spectral_sphere": {"params": Param(required=True, kind=str), "radius": Param(required=True),
                        "rtol": Param(1e-2), "iters": Param(100, kind=int), "seed": Param(0, kind=int)},
    "spectral_bound": {"params": Param(required=True, kind=str), "lo": Param(0.0), "hi": Param(math.inf),
                       "rtol": Param(1e-2), "iters": Param(100, kind=int), "seed": Param(0, kind=int)},
    "oblique": {"params": Param(required=True, kind=str), "axis": Param("rows", kind=str),
                "radius": Param(1.0), "rtol": Param(1e-3)},
    "simplex": {"path": Param(required=True, kind=str), "atol": Param(1e-5)},
    "monotone": {"path": Param(required=True, kind=str), "strict": Param(False, kind=bool)},
}


# Whether a passing check of each kind vouches for a tensor's values where no replica exists to compare with
# (single-owner FSDP shards): a sphere, a spectral bound, an oblique or simplex constraint pins the values down
# tightly enough that a flipped exponent or mantissa bit breaks it. `finite` misses a huge but finite flipped
# exponent and `monotone` looks at one counter, so they never stand in for consensus. A spec may set
# `vouches=False`; `vouches=True` is refused for the kinds that cannot vouch.
VOUCHES: dict[str, bool] = {"finite": False, "frobenius_sphere": True, "spectral_sphere": True,
                            "spectral_bound": True, "oblique": True, "simplex": True, "monotone": False}


@dataclass(frozen=True)
class Check:
    kind: str
    args: dict = field(hash=False)
    vouches_override: bool | None = None   # from the spec's `vouches`, if given

    @property
    def vouches(self) -> bool:
        """True if passing this check stands in for consensus on single-owner shards (see VOUCHES)."""
        return VOUCHES[self.kind] if self.vouches_override is None else self.vouches_override and VOUCHES[self.kind]

    @property
    def glob(self) -> str:
        return self.args.get("params") or self.args.get("path")

    @property
    def spec(self) -> dict:
        """The canonical JSON-able spec (what parse_specs reads back)."""
        spec = {"check": self.kind, **{k: (None if v == math.inf else v) for k, v in self.args.items()}}
        if self.vouches_override is not None:
            spec["vouches"] = self.vouches_override
        return spec

    @property
    def label(self) -> str:
        return f"{self.kind}({self.glob})"

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.glob) or fnmatch.fnmatchcase(name, "*." + self.glob)


# ---- parsing -----------------------------------------------------------------------------------------------

def _coerce(kind: str, key: str, value: Any, p: Param) -> Any:
    if value is None and p.kind is float and key == "hi":
        return math.inf
    try:
        if p.kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if p.kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if p.kind is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if not isinstance(value, str) or not value:
            raise ValueError(value)
        return value
    except (TypeError, ValueError):
        raise BadInput(f"invariant {kind}: {key}={value!r} is not a valid {p.kind.__name__}") from None


def _parse_one(spec: dict | str) -> Check:
    if isinstance(spec, str):
        head, *pairs = spec.split(":")
        d: dict[str, Any] = {"check": head.strip()}
        for pair in pairs:
            if "=" not in pair:
                raise BadInput(f"invariant spec {spec!r}: expected key=value, got {pair!r}")
            k, v = pair.split("=", 1)
            d[k.strip()] = v.strip()
        spec = d
    if not isinstance(spec, dict):
        raise BadInput(f"invariant spec must be a dict or a string, not {type(spec).__name__}")
    kind = spec.get("check")
    if kind not in KINDS:
        raise BadInput(f"unknown invariant check {kind!r} (known: {', '.join(KINDS)})")
    params = KINDS[kind]
    glob_key = "params" if "params" in params else "path"
    raw = dict(spec)
    raw.pop("check")
    vouches = _coerce(kind, "vouches", raw.pop("vouches"), Param(kind=bool)) if "vouches" in raw else None
    if vouches and not VOUCHES[kind]:
        raise BadInput(f"invariant {kind} cannot vouch for a tensor's values (vouches=true is only for "
                       f"{', '.join(k for k, v in VOUCHES.items() if v)})")
    for alias in ("params", "path"):   # either name is accepted for the glob
        if alias in raw and alias != glob_key:
            raw[glob_key] = raw.pop(alias)
    unknown = set(raw) - set(params)
    if unknown:
        raise BadInput(f"invariant {kind}: unknown parameter(s) {', '.join(sorted(unknown))} "
                       f"(allowed: {', '.join(params)})")
    args = {}
    for key, p in params.items():
        if key in raw:
            args[key] = _coerce(kind, key, raw[key], p)
        elif p.required:
            raise BadInput(f"invariant {kind} needs {key}")
        else:
            args[key] = p.default
    for key in ("radius", "rtol", "atol", "lo"):
        if key in args and not (args[key] >= 0 and math.isfinite(args[key])):
            raise BadInput(f"invariant {kind}: {key} must be a finite number >= 0, got {args[key]}")
    if kind == "spectral_bound" and not args["lo"] <= args["hi"]:
        raise BadInput(f"invariant spectral_bound: lo={args['lo']} > hi={args['hi']}")
    if kind == "spectral_bound" and args["lo"] == 0 and args["hi"] == math.inf:
        raise BadInput("invariant spectral_bound needs lo or hi")
    if kind == "oblique" and args["axis"] not in ("rows", "cols"):
        raise BadInput(f"invariant oblique: axis must be rows or cols, got {args['axis']!r}")
    if "iters" in args and not 1 <= args["iters"] <= 10_000:
        raise BadInput(f"invariant {kind}: iters must be in 1..10000")
    return Check(kind, args, vouches)


def parse_specs(specs: list[dict | str] | None) -> list[Check]:
    """Checks from specs (dicts or "kind:key=value" strings); BadInput names the bad one."""
    if specs is None:
        return []
    if isinstance(specs, (str, dict)):
        specs = [specs]
    if not isinstance(specs, (list, tuple)):
        raise BadInput(f"invariants must be a list of specs, not {type(specs).__name__}")
    return [_parse_one(s) for s in specs]


# ---- tensors as seen from one rank -------------------------------------------------------------------------

@dataclass
class View:
    """One rank's piece of a tensor: the local data, where it sits in the global tensor, how many copies."""

    local: Any
    shape: tuple
    offset: tuple
    replicas: int = 1                      # ranks holding this same piece (Replicate mesh dims)
    split: frozenset = frozenset()         # tensor dims sharded across ranks
    unsupported: str | None = None         # why this view cannot be combined (Partial, strided shards)

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
    partial: Any                        # float64 tensor, already weighted by 1/replicas
    finalize: Callable[[Any, Any], Local]   # (total, per_rank or None) -> Local
    scalar: bool = False


def _floating(t) -> bool:
    return t.is_floating_point() or t.is_complex()


def _within(value: float, lo: float, hi: float) -> bool:
    return lo <= value <= hi   # False for NaN


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
    import torch

    t = v.local
    if not _floating(t):
        return []
    # NaN and Inf propagate through a sum, so a finite sum proves every element finite at ~20x the speed of
    # isfinite(); a non-finite sum (NaN/Inf, or an overflow of finite values) takes the exact path.
    if math.isfinite(float((torch.view_as_real(t) if t.is_complex() else t).sum())) or bool(torch.isfinite(t).all()):
        return [Local(0)]
    bad = ~torch.isfinite(t.reshape(-1))
    first = int(bad.nonzero()[0, 0])
    return [Local(1, float(bad.sum()), _global_flat_index(v, first), expected=0)]


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
    if v.split == {0} and n * n <= SPECTRAL_GRAM_MAX:      # rows split: A^T A = sum of the ranks' W_r^T W_r
        gram, dim = torch.zeros(n, n, dtype=torch.float64), n
        gram += w.T @ w
    elif v.split == {1} and m * m <= SPECTRAL_GRAM_MAX:    # columns split: A A^T = sum of W_r W_r^T
        gram, dim = torch.zeros(m, m, dtype=torch.float64), m
        gram += w @ w.T
    else:
        return [Local(2, expected="sharded spectral check: Gram matrix too large or 2-D sharding")]

    def finalize(total, per_rank):
        return verdict(_sigma_of_gram(total.reshape(dim, dim), a["iters"], a["seed"]))
    return [Reduce((gram / v.replicas).reshape(-1), finalize)]


def _slices(check: Check, v: View, values, reduce_dim: int, expected, ok: Callable[[Any], Any],
            transform: Callable[[Any], Any]) -> list:
    """Per-slice sums of `values` along reduce_dim of a 2-D view, checked with `ok` after `transform`."""
    import torch

    keep = 1 - reduce_dim
    if reduce_dim not in v.split:       # complete slices on this rank: decide here
        sums = values.sum(dim=reduce_dim, dtype=torch.float64) if values.numel() else \
            torch.zeros(values.shape[keep], dtype=torch.float64)
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
        full[v.offset[keep]: v.offset[keep] + part.shape[0]] = part

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
    return _slices(check, v, sq, reduce_dim, r, lambda n: (n >= r * (1 - rtol)) & (n <= r * (1 + rtol)),
                   torch.sqrt)


def _simplex(check: Check, v: View) -> list:

    t = v.local
    if not _floating(t) or len(v.shape) == 0:
        return []
    atol = check.args["atol"]
    out = []
    neg = ~(t >= -atol)                  # local: every element non-negative (NaN fails)
    if bool(neg.any()):
        i = int(neg.reshape(-1).nonzero()[0, 0])
        out.append(Local(1, float(t.reshape(-1)[i]), _global_flat_index(v, i), expected=">= 0"))
    else:
        out.append(Local(0))
    if len(v.shape) == 1:            # one distribution: a single row
        vv = View(t.reshape(1, -1), (1,) + v.shape, (0,) + v.offset, v.replicas,
                  frozenset(d + 1 for d in v.split), v.unsupported)
    elif len(v.shape) == 2:          # one distribution per row
        vv = v
    elif not v.sharded:              # leading dims flattened: one distribution per last-dim slice
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


_PLANNERS = {"finite": _finite, "frobenius_sphere": _frobenius, "spectral_sphere": _spectral,
             "spectral_bound": _spectral, "oblique": _oblique, "simplex": _simplex}


# ---- running -----------------------------------------------------------------------------------------------

def _is_tensor(x) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def _plan(checks: list[Check], flat_state: dict, previous: dict | None):
    """[(check, name, plan)] in a deterministic order, plus the names each check matched."""
    items, matched = [], {}
    for ci, check in enumerate(checks):
        names = sorted(k for k in flat_state if check.matches(k))
        matched[ci] = 0
        for name in names:
            value = flat_state[name]
            if check.kind == "monotone":
                plans = [_monotone(check, value, (previous or {}).get(name))]
            elif not _is_tensor(value):
                continue
            else:
                try:
                    v = _view(value)
                    plans = _PLANNERS[check.kind](check, v)
                except Exception as e:  # never raise between collectives: every rank must reach them
                    plans = [Local(2, expected=f"{type(e).__name__}: {e}")]
            if plans:
                matched[ci] += 1
            items += [(ci, name, p) for p in plans]
    return items, matched


def _group_info(group):
    import torch.distributed as dist

    if group is False or not (dist.is_available() and dist.is_initialized()):
        return None, 0, 1
    group = group or dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def run_local(checks: list[Check], flat_state: dict, *, group=None, previous: dict | None = None) -> dict:
    """Evidence for this rank's state (collective over `group` when one is initialised; the same result on
    every rank). `previous` holds the last manifest's monotone values ({name: value})."""
    import torch
    import torch.distributed as dist

    items, matched = _plan(checks, flat_state, previous)
    group, rank, world = _group_info(group)
    n_local = sum(isinstance(p, Local) for _, _, p in items)
    scalars = [p for _, _, p in items if isinstance(p, Reduce) and p.scalar]
    vectors = [p for _, _, p in items if isinstance(p, Reduce) and not p.scalar]
    collectives = 0
    if world > 1:
        layout = repr([(ci, name, type(p).__name__, getattr(p, "scalar", None),
                        int(p.partial.numel()) if isinstance(p, Reduce) else 0) for ci, name, p in items])
        h = xxhash.xxh64_intdigest(layout.encode()) & ((1 << 62) - 1)
        guard = torch.tensor([h, -h, len(items), -len(items)], dtype=torch.int64)
        dist.all_reduce(guard, op=dist.ReduceOp.MAX, group=group)
        collectives += 1
        if int(guard[0]) != -int(guard[1]) or int(guard[2]) != -int(guard[3]):
            return evidence(INCONCLUSIVE, [{"code": "invariant_layout_mismatch",
                                            "detail": "ranks hold different tensors for the configured checks"}],
                            checks=[c.spec for c in checks], collectives=collectives)
    row_len = 3 * n_local + len(scalars)
    vec_len = sum(int(p.partial.numel()) for p in vectors)
    buf = torch.zeros(world * row_len + vec_len, dtype=torch.float64)
    row = buf[rank * row_len: (rank + 1) * row_len]
    i = 0
    for _, _, p in items:
        if isinstance(p, Local):
            row[3 * i: 3 * i + 3] = torch.tensor([p.code, p.value, p.index], dtype=torch.float64)
            i += 1
    for j, p in enumerate(scalars):
        row[3 * n_local + j] = p.partial.reshape(-1)[0]
    off = world * row_len
    for p in vectors:
        k = int(p.partial.numel())
        buf[off: off + k] = p.partial.reshape(-1)
        off += k
    if world > 1 and buf.numel():
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        collectives += 1
    rows = buf[: world * row_len].reshape(world, row_len)
    per_rank_local = rows[:, : 3 * n_local].reshape(world, n_local, 3)    # code, value, index per rank
    scalar_rows = rows[:, 3 * n_local:]                                     # per-rank partial sums
    vector_total = buf[world * row_len:]                                    # summed segments

    to_global = (lambda r: dist.get_global_rank(group, r)) if world > 1 and group is not dist.group.WORLD \
        else (lambda r: r)
    reasons, errors, values = [], [], {}
    li = si = 0
    off = 0
    for ci, name, p in items:
        check = checks[ci]
        if isinstance(p, Local):
            codes = per_rank_local[:, li, 0]
            failed = [r for r in range(world) if int(codes[r]) == 1]
            errored = [r for r in range(world) if int(codes[r]) == 2]
            first = (failed or errored or [rank])[0]
            result = Local(int(codes[first]), float(per_rank_local[first, li, 1]),
                           float(per_rank_local[first, li, 2]), p.expected)
            bad_ranks = failed or errored
            li += 1
        elif p.scalar:
            col = scalar_rows[:, si]
            result = p.finalize(col.sum(), col)
            bad_ranks = []
            if result.code:
                # a shard that alone exceeds the whole allowed sum is certainly bad; otherwise blame all holders
                bound = (check.args["radius"] * (1 + check.args["rtol"])) ** 2
                bad_ranks = [r for r in range(world) if not float(col[r]) <= bound] or \
                    [r for r in range(world) if float(col[r]) != 0.0]
            si += 1
        else:
            k = int(p.partial.numel())
            result = p.finalize(vector_total[off: off + k], None)
            off += k
            bad_ranks = list(range(world)) if result.code else []
        if check.kind == "monotone" and result.code == 0:
            values[name] = result.value
        if result.code == 0:
            continue
        entry = {"code": "invariant_failed" if result.code == 1 else "invariant_error", "check": check.kind,
                 "spec": check.label, "tensor": name, "value": _json_num(result.value),
                 "expected": result.expected, "ranks": sorted(to_global(r) for r in bad_ranks)}
        if result.index >= 0:
            entry["index"] = int(result.index)
        (reasons if result.code == 1 else errors).append(entry)
    for ci, n in matched.items():
        if n == 0:
            errors.append({"code": "invariant_no_match", "check": checks[ci].kind, "spec": checks[ci].label,
                           "detail": f"no tensor matches {checks[ci].glob!r}"})
    status = FAIL if reasons else INCONCLUSIVE if errors else PASS
    return evidence(status, reasons + errors, checks=[c.spec for c in checks],
                    checked={checks[ci].label: n for ci, n in matched.items()}, values=values,
                    collectives=collectives, reduced_floats=int(buf.numel()) if world > 1 else 0)


def _json_num(x: float):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def run_offline(checks: list[Check], tensors: dict, *, previous: dict | None = None) -> dict:
    """Evidence for full tensors read from disk (no process group involved)."""
    return run_local(checks, tensors, group=False, previous=previous)


def flatten(state: dict) -> dict:
    """The flat {fqn: value} view of a DCP state dict, with Stateful values expanded, as DCP names them on disk."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    expanded = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}
    return flatten_state_dict(expanded)[0]
