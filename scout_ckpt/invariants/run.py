"""Running checks: one layout guard and one all_reduce per save (run_local), or on full tensors read from disk
(run_offline)."""

from __future__ import annotations

import math

import xxhash

from scout_ckpt.invariants.checks import _PLANNERS, Local, Reduce, _monotone, _view
from scout_ckpt.invariants.specs import Check
from scout_ckpt.policy import FAIL, INCONCLUSIVE, PASS, evidence


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
        layout = repr(
            [
                (
                    ci,
                    name,
                    type(p).__name__,
                    getattr(p, "scalar", None),
                    int(p.partial.numel()) if isinstance(p, Reduce) else 0,
                )
                for ci, name, p in items
            ]
        )
        h = xxhash.xxh64_intdigest(layout.encode()) & ((1 << 62) - 1)
        guard = torch.tensor([h, -h, len(items), -len(items)], dtype=torch.int64)
        dist.all_reduce(guard, op=dist.ReduceOp.MAX, group=group)
        collectives += 1
        if int(guard[0]) != -int(guard[1]) or int(guard[2]) != -int(guard[3]):
            return evidence(
                INCONCLUSIVE,
                [
                    {
                        "code": "invariant_layout_mismatch",
                        "detail": "ranks hold different tensors for the configured checks",
                    }
                ],
                checks=[c.spec for c in checks],
                collectives=collectives,
            )
    row_len = 3 * n_local + len(scalars)
    vec_len = sum(int(p.partial.numel()) for p in vectors)
    buf = torch.zeros(world * row_len + vec_len, dtype=torch.float64)
    row = buf[rank * row_len : (rank + 1) * row_len]
    i = 0
    for _, _, p in items:
        if isinstance(p, Local):
            row[3 * i : 3 * i + 3] = torch.tensor([p.code, p.value, p.index], dtype=torch.float64)
            i += 1
    for j, p in enumerate(scalars):
        row[3 * n_local + j] = p.partial.reshape(-1)[0]
    off = world * row_len
    for p in vectors:
        k = int(p.partial.numel())
        buf[off : off + k] = p.partial.reshape(-1)
        off += k
    if world > 1 and buf.numel():
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        collectives += 1
    rows = buf[: world * row_len].reshape(world, row_len)
    per_rank_local = rows[:, : 3 * n_local].reshape(world, n_local, 3)  # code, value, index per rank
    scalar_rows = rows[:, 3 * n_local :]  # per-rank partial sums
    vector_total = buf[world * row_len :]  # summed segments

    to_global = (
        (lambda r: dist.get_global_rank(group, r)) if world > 1 and group is not dist.group.WORLD else (lambda r: r)
    )
    reasons: list[dict] = []
    errors: list = []
    values: dict = {}
    li = si = 0
    off = 0
    for ci, name, p in items:
        check = checks[ci]
        if isinstance(p, Local):
            codes = per_rank_local[:, li, 0]
            failed = [r for r in range(world) if int(codes[r]) == 1]
            errored = [r for r in range(world) if int(codes[r]) == 2]
            first = (failed or errored or [rank])[0]
            result = Local(
                int(codes[first]), float(per_rank_local[first, li, 1]), float(per_rank_local[first, li, 2]), p.expected
            )
            bad_ranks = failed or errored
            li += 1
        elif p.scalar:
            col = scalar_rows[:, si]
            result = p.finalize(col.sum(), col)
            bad_ranks = []
            if result.code:
                # a shard that alone exceeds the whole allowed sum is certainly bad; otherwise blame all holders
                bound = (check.args["radius"] * (1 + check.args["rtol"])) ** 2
                bad_ranks = [r for r in range(world) if not float(col[r]) <= bound] or [
                    r for r in range(world) if float(col[r]) != 0.0
                ]
            si += 1
        else:
            k = int(p.partial.numel())
            result = p.finalize(vector_total[off : off + k], None)
            off += k
            bad_ranks = list(range(world)) if result.code else []
        if check.kind == "monotone" and result.code == 0:
            values[name] = result.value
        if result.code == 0:
            continue
        entry = {
            "code": "invariant_failed" if result.code == 1 else "invariant_error",
            "check": check.kind,
            "spec": check.label,
            "tensor": name,
            "value": _json_num(result.value),
            "expected": result.expected,
            "ranks": sorted(to_global(r) for r in bad_ranks),
        }
        if result.index >= 0:
            entry["index"] = int(result.index)
        (reasons if result.code == 1 else errors).append(entry)
    for ci, n in matched.items():
        if n == 0:
            errors.append(
                {
                    "code": "invariant_no_match",
                    "check": checks[ci].kind,
                    "spec": checks[ci].label,
                    "detail": f"no tensor matches {checks[ci].glob!r}",
                }
            )
    status = FAIL if reasons else INCONCLUSIVE if errors else PASS
    return evidence(
        status,
        reasons + errors,
        checks=[c.spec for c in checks],
        checked={checks[ci].label: n for ci, n in matched.items()},
        values=values,
        collectives=collectives,
        reduced_floats=int(buf.numel()) if world > 1 else 0,
    )


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
