"""Cross-rank replay of the optimizer update of single-owner shards (pure FSDP2: no replica to compare with).

Why: under `fully_shard` each element of the model lives on one rank only, and that rank alone applies its
optimizer update. A rank whose arithmetic is silently wrong (or a fault that perturbs its live update) leaves a
wrong shard that no replica contradicts. Elementwise optimizers (Adam, AdamW, SGD) update an element from that
element's parameter, gradient and state alone, so any rank can recompute a *slice* of rank r's update from the
pre-step slices and the group's hyperparameters, and must land on the same bits.

Coverage. Each rank's local shards are cut into units of at most `chunk` elements (per parameter). At start-up a
fixed permutation of the units is drawn from `random.Random(f"{seed}:{rank}")` -- every rank can compute every
other rank's choice, no collective is needed to agree on it -- and step s checks `per_step` consecutive positions
of it, wrapping around. So any `cycle` consecutive steps cover every unit of every rank (`cycle` =
ceil(max units over ranks / per_step), agreed once at start-up).

Who recomputes (per step s, owner r): the owner itself ("self") and `peers` other ranks, (r + 1 + (s + j) % (W -
1)) % W for j < peers, so the verifiers rotate. Two all_gather_object calls on a side gloo group per step (by
default on a worker thread, overlapped with the next step): the owners' pre-step slices (raw bytes) with the
digests (xxh3-128) of their live results, then every rank's digests of its recomputations. Every rank then holds
the same data and `decide` (shard_plan.py) gives the same verdicts everywhere. Each rank receives every rank's
slices (W x per_step x chunk elements x ~5 tensors): fine to a few dozen ranks; beyond, send each capture only to
its verifiers.

Attribution (`decide`), per owner r:
  * the owner's live result differs from the owner's own recomputation: the live update on r was wrong (a fault
    between the kernel and memory, a perturbed update): r is attributed, with 2 ranks already;
  * else the owner (live == self) and each peer vote with their digests: a value held by a strict majority of
    the voters wins and every other voter is attributed ("shard_update_mismatch" for the owner,
    "shard_recompute_mismatch" for a peer); no strict majority (e.g. owner vs one peer, W == 2) is
    inconclusive and names both. A persistently wrong kernel on r (live and self-recompute agree, both wrong) is
    thus attributed only with 2+ peers (W >= 3); with 2 ranks it is detected, not attributed.

Determinism (the oracle for zero false positives, measured with torch 2.13 on CPU): the recomputation uses a fresh
optimizer of the same class with the group's hyperparameters and `foreach=False, fused=False` (the single-tensor
path), on the same dtype and device as the live shard. Live single-tensor and foreach updates match it bit for bit
on any slice. A *fused* live update does not: fused AdamW differs from single-tensor AdamW in the last bit on most
slices, and even fused-on-a-slice differs from fused-on-the-whole tensor at slice tails (vectorized body vs
scalar tail). Fused optimizers are therefore refused at construction, as are optimizer classes other than
Adam, AdamW and SGD (exact class: a subclass may override `step`). Not yet verified on CUDA (no GPU here): a live
CUDA foreach kernel against the single-tensor recomputation may differ by FMA contraction; run
tests/test_fsdp_evidence.py's slice oracle on the device before trusting a CUDA run's mismatches.

What it cannot see: a *transient* fault in a unit not sampled that step (a persistent one is caught within one
cycle); faults in forward/backward (the module replay's job); a change after the step (`at_rest.AtRestGuard`).
"""

from __future__ import annotations

import datetime
import math
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import xxhash
from torch import optim

from scout_ckpt import policy
from scout_ckpt.replay.shard_plan import (
    KIND,
    Unit,
    decide,
    permutation,
    plan_units,
    positions,
    shard_replay_evidence,
    verifiers,
    worst,
)

SUPPORTED = (optim.Adam, optim.AdamW, optim.SGD)


class UnsupportedOptimizer(ValueError):
    """The optimizer's update cannot be recomputed bit for bit on a slice (class or kernel not supported)."""


def check_supported(optimizer: optim.Optimizer) -> None:
    """Raise UnsupportedOptimizer, saying why, unless the optimizer is exactly Adam/AdamW/SGD, not fused."""
    cls = type(optimizer)
    if cls not in SUPPORTED:
        raise UnsupportedOptimizer(
            f"shard update replay supports {', '.join(c.__name__ for c in SUPPORTED)} (exact classes), not "
            f"{cls.__module__}.{cls.__qualname__}: its update cannot be recomputed on a slice"
        )
    for gi, g in enumerate(optimizer.param_groups):
        if g.get("fused"):
            raise UnsupportedOptimizer(
                f"param group {gi} uses fused=True: fused kernels are not bitwise reproducible on a slice; "
                "use the default (foreach) or foreach=False to enable shard update replay"
            )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


# ---- recomputation -------------------------------------------------------------------------------------------


def digest(tensors: list[torch.Tensor]) -> str:
    """xxh3-128 of the tensors' raw bytes, in order (host copies: slices are small)."""
    h = xxhash.xxh3_128()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _result(param: torch.Tensor, state: dict) -> list[torch.Tensor]:
    return [param] + [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]


def recompute_group(
    cls, hyper: dict, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict], device=None
) -> list[list[torch.Tensor]]:
    """Units of one param group, recomputed by one fresh `cls` on the single-tensor path (it loops over its
    parameters, so each unit sees exactly the arithmetic it would alone): per unit [param] + state (sorted keys)."""
    mv = (lambda v: v.to(device)) if device is not None else (lambda v: v)
    ps = []
    for param, grad in zip(params, grads):
        p = torch.nn.Parameter(mv(param).clone())
        p.grad = mv(grad).clone()
        ps.append(p)
    group = dict(hyper, params=ps)
    for k in ("foreach", "fused"):
        if k in group:
            group[k] = False
    opt = cls([group])
    for p, state in zip(ps, states):
        if state:
            opt.state[p] = {k: (mv(v).clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    opt.step()
    return [_result(p.detach(), opt.state[p]) for p in ps]


def recompute(
    cls, hyper: dict, param: torch.Tensor, grad: torch.Tensor, state: dict, device=None
) -> list[torch.Tensor]:
    """One unit's update, recomputed by a fresh `cls` on the single-tensor path: [param] + state (sorted keys)."""
    return recompute_group(cls, hyper, [param], [grad], [state], device)[0]


@dataclass
class _Capture:
    step: int
    units: list[Unit]
    groups: list[int]
    hyper: list[dict]
    params: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    state: list[dict]
    live: list[str] = field(default_factory=list)
    after: list[list[torch.Tensor]] = field(default_factory=list)

    def pre(self) -> dict:
        """What travels to the verifiers: pre-step slices as raw host bytes (pickling tensors costs 10x more),
        live digests (the live tensors stay home). `unpack` turns it back into tensors."""
        return {
            "step": self.step,
            "units": self.units,
            "groups": self.groups,
            "hyper": self.hyper,
            "live": self.live,
            "params": [_pack(p) for p in self.params],
            "grads": [_pack(g) for g in self.grads],
            "state": [{k: _pack(v) for k, v in st.items()} for st in self.state],
        }


class _Raw(tuple):
    """(dtype name, shape, bytes) of a tensor in flight."""


def _pack(v):
    if not isinstance(v, torch.Tensor):
        return v
    t = v.detach().contiguous().cpu()
    return _Raw(
        (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    )


def _unpack_one(v):
    if not isinstance(v, _Raw):
        return v
    dtype, shape, data = v
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


def unpack(pre: dict) -> dict:
    """A peer's capture (`_Capture.pre`) with its tensors rebuilt."""
    return dict(
        pre,
        params=[_unpack_one(p) for p in pre["params"]],
        grads=[_unpack_one(g) for g in pre["grads"]],
        state=[{k: _unpack_one(v) for k, v in st.items()} for st in pre["state"]],
    )


# ---- the collective driver -----------------------------------------------------------------------------------


class ShardUpdateReplay:
    """Step hooks that capture this rank's units of the step, and `on_step`, which cross-checks them.

    Construction is collective (every rank, same order, at start-up): it creates a gloo side group unless one is
    given, and agrees on the cycle length with one all_gather. `on_step(step)` is collective too: every rank calls
    it once after each optimizer step (with the same step number), and every rank gets the same row back. A rank
    that fails to recompute still reaches both gathers (its digests are None -> inconclusive for that owner).
    Live tensors, gradients and RNG streams are only read (cloned slices), so training is bitwise unchanged.
    """

    def __init__(
        self,
        optimizer: optim.Optimizer,
        model: torch.nn.Module | None = None,
        *,
        group=None,
        chunk: int = 4096,
        per_step: int = 4,
        cycle: int | None = None,
        peers: int = 2,
        seed: int = 0,
        start_step: int = 0,
        background: bool = True,
        timeout_s: float = 300.0,
    ):
        """chunk: elements per unit; per_step: units each rank checks per step; cycle: if given, per_step is
        raised so that every unit is checked within `cycle` steps (cost per step grows as the model over cycle);
        peers: verifiers per owner besides itself (2 attributes persistent faults on 3+ ranks); seed: the
        permutation's seed (same on all ranks); start_step: the step the schedule counts from; background: run
        each step's exchange and recomputation on a worker thread (its own gloo group, so it never meets the
        training collectives) while the next step trains."""
        check_supported(optimizer)
        if chunk < 1 or per_step < 1 or peers < 1:
            raise ValueError("chunk, per_step and peers must be >= 1")
        self.optimizer, self.chunk, self.per_step, self.peers, self.seed = optimizer, chunk, per_step, peers, seed
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = (
            group
            if group is not None
            else dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        )
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self._params: dict[str, tuple[int, torch.Tensor]] = {}
        for gi, g in enumerate(optimizer.param_groups):
            for pi, p in enumerate(g["params"]):
                if p.requires_grad:
                    self._params[names.get(id(p), f"{gi}.{pi}")] = (gi, p)
        self.units = plan_units([(n, _local(p).numel()) for n, (_, p) in self._params.items()], chunk)
        self.order = permutation(len(self.units), seed, self.rank)
        counts = [None] * self.world
        dist.all_gather_object(counts, len(self.units), group=self.group)
        self.unit_counts = [int(c) for c in counts]
        if cycle is not None:
            self.per_step = per_step = max(per_step, math.ceil(max(self.unit_counts) / max(1, cycle)))
        self.cycle = max(1, max(math.ceil(c / per_step) for c in self.unit_counts))
        self.start = start_step
        self._next = start_step + 1
        self._cap: _Capture | None = None
        self.timings: dict[str, float] = {}  # the last exchange's phases (for the bench)
        self.cpu_s = {"hooks": 0.0, "exchange": 0.0}  # CPU seconds spent so far, by the hooks and the exchanges
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="scout-shard-replay") if background else None
        self._job: Future | None = None
        self._handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def close(self) -> list[dict]:
        """Remove the hooks; finish the exchange in flight (collective) and return its row."""
        for h in self._handles:
            h.remove()
        self._handles = []
        rows = self.flush()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        return rows

    def begin(self, step: int) -> None:
        """Resume at `step` (collective: finishes the exchange in flight, whose row is dropped): the next optimizer
        step is step + 1 (the coverage schedule is unchanged)."""
        self.flush()
        self._next, self._cap = step + 1, None

    # -- hooks (inside optimizer.step, this rank only) --

    def _pre(self, opt, args, kwargs) -> None:
        c0 = time.thread_time()
        try:
            self._capture_pre(opt)
        finally:
            self.cpu_s["hooks"] += time.thread_time() - c0

    def _post(self, opt, args, kwargs) -> None:
        c0 = time.thread_time()
        try:
            self._capture_post(opt)
        finally:
            self.cpu_s["hooks"] += time.thread_time() - c0

    def _capture_pre(self, opt) -> None:
        units = [self.units[self.order[i]] for i in positions(self._next, self.start, self.per_step, len(self.units))]
        cap = _Capture(self._next, units, [], [], [], [], [])
        for u in units:
            gi, p = self._params[u.param]
            sl = slice(u.offset, u.offset + u.length)
            cap.groups.append(gi)
            cap.hyper.append({k: v for k, v in opt.param_groups[gi].items() if k != "params"})
            cap.params.append(_local(p).detach().reshape(-1)[sl].clone())
            cap.grads.append(None if p.grad is None else _local(p.grad).detach().reshape(-1)[sl].clone())
            st = {}
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and _local(v).shape == _local(p).shape:
                    st[k] = _local(v).detach().reshape(-1)[sl].clone()
                elif isinstance(v, torch.Tensor):
                    st[k] = _local(v).detach().clone()
                else:
                    st[k] = v
            cap.state.append(st)
        self._cap = cap

    def _capture_post(self, opt) -> None:
        cap = self._cap
        if cap is None or cap.after:
            return
        for u, g in zip(cap.units, cap.grads):
            _, p = self._params[u.param]
            sl = slice(u.offset, u.offset + u.length)
            after = [_local(p).detach().reshape(-1)[sl].clone()]
            if g is not None:  # the optimizer skips a parameter without a gradient: no state to compare
                st = opt.state.get(p, {})
                after += [
                    (
                        _local(st[k]).detach().reshape(-1)[sl]
                        if _local(st[k]).shape == _local(p).shape
                        else _local(st[k]).detach()
                    ).clone()
                    for k in sorted(st)
                    if isinstance(st[k], torch.Tensor)
                ]
            cap.after.append(after)
            cap.live.append(digest(after))

    # -- collective --

    def _recompute(
        self, pre: dict, device, live: list[list[torch.Tensor]] | None = None
    ) -> tuple[list[str], dict[int, str]]:
        """Digests of the recomputed units; with `live` (the owner's own after-tensors), also where the first
        differing element of each differing unit is ({unit index: "param[flat index]:tensor"})."""
        cls = type(self.optimizer)
        results: dict[int, list[torch.Tensor]] = {}
        by_group: dict[int, list[int]] = {}
        for i in range(len(pre["units"])):
            if pre["grads"][i] is None:  # not updated: the parameter must be unchanged
                results[i] = [pre["params"][i]]
            else:
                by_group.setdefault(pre["groups"][i], []).append(i)
        for idx in by_group.values():
            outs = recompute_group(
                cls,
                pre["hyper"][idx[0]],
                [pre["params"][i] for i in idx],
                [pre["grads"][i] for i in idx],
                [pre["state"][i] for i in idx],
                device,
            )
            results.update(zip(idx, outs))
        out, where = [], {}
        for i, u in enumerate(pre["units"]):
            res = results[i]
            out.append(digest(res))
            if live is not None and out[-1] != pre["live"][i]:
                st = self.optimizer.state.get(self._params[u.param][1], {})
                labels = ["param"] + sorted(k for k, v in st.items() if isinstance(v, torch.Tensor))
                where[i] = _first_difference(u, live[i], res, labels)
        return out, where

    def on_step(self, step: int) -> list[dict]:
        """Collective, after optimizer step `step` on every rank (same step number): cross-check that step's
        capture, arm the next. Returns the rows finished so far, identical on every rank: with `background` the
        exchange of step S runs on a worker thread while step S+1 trains and its row comes back from the next
        `on_step` (or `flush`); otherwise at once. A row: {"step", "status", "ranks" (attributed), "reasons",
        "owners": {rank: status}, "units": {rank: n}}."""
        cap, self._cap = self._cap, None
        self._next = step + 1
        if cap is not None and (cap.step != step or len(cap.live) != len(cap.units)):
            cap = None
        rows = self.flush()
        if self._pool is None:
            return rows + [self._exchange(step, cap)]
        self._job = self._pool.submit(self._exchange, step, cap)
        return rows

    def flush(self) -> list[dict]:
        """Wait for the exchange in flight (every rank: it is collective) and return its row. Call before a save's
        evidence is computed, so that the save's own step is decided."""
        job, self._job = self._job, None
        return [job.result()] if job is not None else []

    def _exchange(self, step: int, cap: _Capture | None) -> dict:
        c0 = time.thread_time()
        try:
            return self._exchange_unguarded(step, cap)
        except Exception as e:  # noqa: BLE001 -- a broken side channel must not stop training: fail closed instead
            warnings.warn(f"shard replay exchange at step {step} failed on rank {self.rank}: {e!r}")
            return {
                "step": step,
                "status": policy.INCONCLUSIVE,
                "ranks": [],
                "owners": {},
                "units": {},
                "reasons": [
                    {"code": "shard_replay_error", "ranks": [self.rank], "step": step, "detail": repr(e)[:200]}
                ],
            }
        finally:
            self.cpu_s["exchange"] += time.thread_time() - c0

    def _exchange_unguarded(self, step: int, cap: _Capture | None) -> dict:
        t0 = time.perf_counter()
        mine = cap.pre() if cap is not None else None
        caps: list = [None] * self.world
        dist.all_gather_object(caps, mine, group=self.group)
        t1 = time.perf_counter()
        device = next((_local(p).device for _, p in self._params.values()), torch.device("cpu"))
        computed: dict[int, list[str] | None] = {}
        where: dict[int, str] = {}
        for owner in [self.rank] + [
            o for o in range(self.world) if self.rank in verifiers(o, step, self.world, self.peers)
        ]:
            if caps[owner] is None:
                continue
            try:
                computed[owner], w = self._recompute(
                    unpack(caps[owner]), device, cap.after if owner == self.rank else None
                )
                where.update(w)
            except Exception as e:  # noqa: BLE001 -- every rank must still reach the next gather
                computed[owner] = None
                warnings.warn(f"shard replay of rank {owner}'s update at step {step} failed on rank {self.rank}: {e!r}")
        t2 = time.perf_counter()
        every: list = [None] * self.world
        dist.all_gather_object(every, (computed, where), group=self.group)
        self.timings = {
            "gather_captures_s": t1 - t0,
            "recompute_s": t2 - t1,
            "gather_digests_s": time.perf_counter() - t2,
        }
        owners: dict[int, str] = {}
        reasons: list[dict] = []
        for owner in range(self.world):
            live = caps[owner]["live"] if caps[owner] is not None else None
            got = {v: every[v][0][owner] for v in range(self.world) if owner in every[v][0]}
            st, why = decide(owner, live, got)
            owners[owner] = st
            for r in why:
                if "units" in r:  # name them: parameter, flat range of the local shard, first differing element
                    units = caps[owner]["units"]
                    r["where"] = [
                        every[owner][1].get(i)
                        or f"{units[i].param}[{units[i].offset}:{units[i].offset + units[i].length}]"
                        for i in r.pop("units")
                    ]
                reasons.append(dict(r, step=step))
        status = worst(owners.values())
        ranks = sorted({r for x in reasons if x["code"].endswith("_mismatch") for r in x["ranks"]})
        return {
            "step": step,
            "status": status,
            "ranks": ranks,
            "reasons": reasons,
            "owners": {str(o): s for o, s in owners.items()},
            "units": {str(o): len(caps[o]["units"]) if caps[o] else 0 for o in range(self.world)},
        }


def _first_difference(u: Unit, live: list[torch.Tensor], res: list[torch.Tensor], labels: list[str]) -> str:
    """Where the owner's live result and its recomputation first differ, e.g. "blocks.0.fc1.weight[517]:param"."""
    for j, (a, b) in enumerate(zip(live, res)):
        a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{u.param}[{u.offset}:{u.offset + u.length}]:{_label(labels, j)}(shape)"
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        diff = (a.view(bits) != b.view(bits)).nonzero()
        if diff.numel():
            k = int(diff[0])
            return (
                f"{u.param}[{u.offset + k}]:{_label(labels, j)}"
                if a.numel() == u.length
                else f"{u.param}:{_label(labels, j)}"
            )
    return f"{u.param}[{u.offset}:{u.offset + u.length}]:count"


def _label(labels: list[str], j: int) -> str:
    return labels[j] if j < len(labels) else f"result{j}"


__all__ = [
    "KIND",
    "SUPPORTED",
    "ShardUpdateReplay",
    "Unit",
    "UnsupportedOptimizer",
    "check_supported",
    "decide",
    "digest",
    "permutation",
    "plan_units",
    "positions",
    "recompute",
    "shard_replay_evidence",
    "verifiers",
]
