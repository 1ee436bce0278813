"""Optimizer replay: re-run the update of a window of every parameter on copies, a different window each round.

Elementwise optimizers (SGD, Adam(W), RMSprop, ...) update each element from that element's parameter, gradient
and state alone, so any contiguous window of a parameter can be updated in isolation by a fresh optimizer of the
same class and hyperparameters and must land on the same bits as the live update. Two checks come out of one
capture: every peer re-runs the *source's* pre-step windows (a persistently wrong optimizer kernel on a peer
shows), and every peer re-runs *its own* windows and compares with its own live result (a corrupted live update
shows, also on FSDP shards, which no other rank holds). The self-check result -- a count of mismatching elements --
is the same on every healthy rank, so it can go through C3 with the replayed values.

Coverage: every round covers EVERY parameter tensor that has a gradient. A budget of `max_elems` elements per round
is shared out in proportion to each tensor's size (at least `MIN_WINDOW` elements, or the whole tensor), so every
tensor is cut into about the same number of windows W (W = 1 when the whole model fits the budget). Round r
replays window (r + phase) mod W of each tensor; the last window ends on the tensor's last element. So any W
consecutive rounds cover every element of every parameter, and which window a round takes depends only on the
round number, the tensor's position and a fixed seed: every rank picks the same windows without communicating
(under FSDP each rank windows its own shard by the same rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import optim

from scout_ckpt.options import DEFAULT_OPT_ELEMS

# Optimizers whose update of one element reads only that element (and scalar state such as `step`).
ELEMENTWISE = tuple(
    getattr(optim, n)
    for n in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
    if hasattr(optim, n)
)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def supports(optimizer) -> bool:
    return isinstance(optimizer, ELEMENTWISE)


def unwrap_optimizer(optimizer):
    """The torch optimizer inside a framework's wrapper: accelerate's AcceleratedOptimizer (and wrappers like
    it) subclasses Optimizer without being the optimizer that steps, and keeps that one as `.optimizer`. Replay
    and shard evidence read and replay the update of the wrapped one; a wrapper left as it is silently turned
    optimizer replay off. Anything else is returned as it is."""
    seen = 0
    while (
        optimizer is not None
        and not supports(optimizer)
        and seen < 4
        and isinstance(getattr(optimizer, "optimizer", None), optim.Optimizer)
    ):
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, read directly: `to_local()` is an autograd Function call (~0.1 ms each), and the
    capture reads several tensors per parameter every armed step (it was most of an armed FSDP step's extra)."""
    if type(t) is torch.Tensor:
        return t
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        return local
    return t.to_local() if hasattr(t, "to_local") else t


MIN_WINDOW = 64  # smallest window cut from a tensor (or the whole tensor when smaller)
DEFAULT_ELEMS = DEFAULT_OPT_ELEMS  # elements per round, over all tensors (declared with the options)


def _slice(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return _local(t).detach().reshape(-1)[start : start + n].clone()


def _windows_of(tensors: list[torch.Tensor], spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Copies of tensors[i].flatten()[s:s+n] for every (s, n) of `spans`, made by one torch.cat (one copy kernel
    instead of one clone per window; the copies are views into that one buffer). Same dtype and device required;
    callers fall back to _slice otherwise."""
    if not tensors:
        return []
    # a contiguous tensor's window is one as_strided view (one dispatch, not detach+reshape+narrow: a capture
    # cuts a few windows per parameter every armed step)
    flat = torch.cat(
        [
            t.detach().as_strided((n,), (1,), t.storage_offset() + s)
            if t.is_contiguous()
            else t.detach().reshape(-1).narrow(0, s, n)
            for t, (s, n) in zip(tensors, spans)
        ]
    )
    return list(torch.split(flat, [n for _, n in spans]))


def windows(numels: list[int], budget: int, rnd: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """(start, length, n_windows) for each tensor of `numels` in round `rnd` (see the module docstring).

    Pure: the same arguments give the same windows on every rank and after a restart."""
    total = sum(numels)
    out = []
    for i, n in enumerate(numels):
        m = n if total <= budget else min(n, max(MIN_WINDOW, -(-n * budget // total)))
        w = -(-n // m)
        k = (rnd + (i * 7919 + seed * 104729) % w) % w
        out.append((min(k * m, n - m), m, w))
    return out


@dataclass
class SliceCapture:
    """Pre-step inputs of the update (hyperparameters, parameter, grad and state windows) and the live result."""

    names: list[str] = field(default_factory=list)  # "group.index" of each windowed parameter
    hyper: list[dict] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    state: list[dict] = field(default_factory=list)
    after_params: list[torch.Tensor] = field(default_factory=list)
    after_state: list[dict] = field(default_factory=list)
    unsupported: str | None = None
    starts: list[int] = field(default_factory=list)  # each window's first element (of the local tensor)
    round: int = 0
    cycle: int = 1  # rounds after which every element was covered

    @property
    def elements(self) -> int:
        """Parameter elements whose update this capture replays."""
        return sum(p.numel() for p in self.params)

    def pre(self) -> SliceCapture:
        """What a peer needs to replay it (the live results stay home)."""
        return SliceCapture(
            self.names,
            self.hyper,
            self.params,
            self.grads,
            self.state,
            unsupported=self.unsupported,
            starts=self.starts,
            round=self.round,
            cycle=self.cycle,
        )

    def to(self, device) -> SliceCapture:
        """The pre-step part on `device`: host copies travel to peers, replays run where the live update ran."""

        def mv(v):
            return v.to(device) if isinstance(v, torch.Tensor) else v

        return SliceCapture(
            self.names,
            self.hyper,
            [mv(p) for p in self.params],
            [mv(g) for g in self.grads],
            [{k: mv(v) for k, v in st.items()} for st in self.state],
            unsupported=self.unsupported,
            starts=self.starts,
            round=self.round,
            cycle=self.cycle,
        )


class OptimizerCapture:
    """Step pre/post hooks that snapshot a window of every parameter with a gradient (see the module docstring).

    `arm(rnd)` chooses round `rnd`'s windows; callers pass a number every rank derives from the step alone."""

    def __init__(self, optimizer: optim.Optimizer, max_elems: int = DEFAULT_ELEMS, seed: int = 0):
        if max_elems < 1:
            raise ValueError(f"optimizer replay needs max_elems >= 1, got {max_elems}")
        self.optimizer = optimizer
        self.max_elems = max_elems
        self.seed = seed
        self.round = 0
        self.capture: SliceCapture | None = None
        self._chosen: list[tuple[int, int, torch.Tensor, int, int]] = []
        self._handles: list = []

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self, rnd: int = 0) -> None:
        self.disarm()
        self.capture = None
        self.round = rnd
        self._handles = [
            self.optimizer.register_step_pre_hook(self._pre),
            self.optimizer.register_step_post_hook(self._post),
        ]

    def disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pick(self) -> list[tuple[int, int, torch.Tensor, int, int, int]]:
        """(group, index, param, start, length, n_windows) for every parameter that will be updated."""
        cands = [
            (gi, pi, p)
            for gi, g in enumerate(self.optimizer.param_groups)
            for pi, p in enumerate(g["params"])
            if p.grad is not None and _local(p).numel() > 0
        ]
        wins = windows([_local(p).numel() for _, _, p in cands], self.max_elems, self.round, self.seed)
        return [(gi, pi, p, s, n, w) for (gi, pi, p), (s, n, w) in zip(cands, wins)]

    def _pre(self, opt, args, kwargs) -> None:
        if self.capture is not None:
            return
        cap = SliceCapture(round=self.round)
        self._chosen = []
        picked = self._pick()
        locals_ = [_local(p) for _, _, p, *_ in picked]
        hyper: dict[int, dict] = {}  # one copy per parameter group (its windows share it)
        for (gi, pi, p, s, n, w), lp in zip(picked, locals_):
            state: dict = {}
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    lv = _local(v)
                    if lv.shape == lp.shape:
                        state[k] = None  # windowed below, with every other tensor's window of this key
                    elif lv.numel() == 1:
                        state[k] = lv.detach().clone()
                    else:
                        cap.unsupported = f"state {k!r} of param {gi}.{pi} is not elementwise ({tuple(lv.shape)})"
                else:
                    state[k] = v
            cap.names.append(f"{gi}.{pi}")
            if gi not in hyper:
                hyper[gi] = {k: v for k, v in opt.param_groups[gi].items() if k != "params"}
            cap.hyper.append(hyper[gi])
            cap.state.append(state)
            cap.starts.append(s)
            cap.cycle = max(cap.cycle, w)
            self._chosen.append((gi, pi, p, s, n))
        spans = [(s, n) for *_, s, n in self._chosen]
        cap.params = _batched(locals_, spans)
        cap.grads = _batched([_local(p.grad) for _, _, p, _, _ in self._chosen], spans)
        for k in {k for st in cap.state for k, v in st.items() if v is None}:
            idx = [i for i, st in enumerate(cap.state) if k in st and st[k] is None]
            for i, t in zip(
                idx, _batched([_local(opt.state[self._chosen[i][2]][k]) for i in idx], [spans[i] for i in idx])
            ):
                cap.state[i][k] = t
        self.capture = cap

    def _post(self, opt, args, kwargs) -> None:
        cap = self.capture
        if cap is None or cap.after_params or len(self._chosen) != len(cap.params):
            return
        spans = [(s, n) for *_, s, n in self._chosen]
        locals_ = [_local(p) for _, _, p, _, _ in self._chosen]
        cap.after_params = _batched(locals_, spans)
        after: list[dict] = [{} for _ in self._chosen]
        windowed: dict[str, list[int]] = {}
        for i, ((gi, pi, p, s, n), lp) in enumerate(zip(self._chosen, locals_)):
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    lv = _local(v)
                    if lv.shape == lp.shape:
                        windowed.setdefault(k, []).append(i)
                        after[i][k] = None
                    else:
                        after[i][k] = lv.detach().clone()
        for k, idx in windowed.items():
            for i, t in zip(
                idx, _batched([_local(opt.state[self._chosen[i][2]][k]) for i in idx], [spans[i] for i in idx])
            ):
                after[i][k] = t
        cap.after_state = after
        self._chosen = []


def _batched(tensors: list[torch.Tensor], spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """_windows_of when every tensor shares one dtype and device, else one _slice each."""
    if tensors and len({(t.dtype, t.device) for t in tensors}) == 1:
        return _windows_of(tensors, spans)
    return [_slice(t, s, n) for t, (s, n) in zip(tensors, spans)]


def _fresh(cls, group: dict, defaults: dict):
    try:
        return cls([group])
    except TypeError:  # a subclass whose constructor needs arguments the group does not name
        return cls([group], **defaults)


def replay_update(cls, defaults: dict, cap: SliceCapture) -> tuple[list[torch.Tensor], list[dict]]:
    """Re-run the update of each captured window with a fresh optimizer of class `cls`: new params, new state.

    One fresh optimizer per live parameter group (the windows of a group share its hyperparameters), and within a
    group the windows that agree on everything but their elements (dtypes, devices, state keys, scalar state such
    as `step`, bit for bit) are updated as ONE tensor, cut back into windows after: the optimizers here are
    elementwise, so an element's update does not depend on the tensor it sits in, and a round over a model's
    hundreds of tensors costs a few optimizer kernels instead of a dozen per window (the per-window loop was most
    of a sweep's optimizer replay). The live update ran on whole tensors, the windows start anywhere in them: the
    self-check has always relied on that independence of position."""
    groups: dict[str, dict[tuple, list[int]]] = {}
    for i, name in enumerate(cap.names):
        groups.setdefault(name.split(".", 1)[0], {}).setdefault(_bucket(cap, i), []).append(i)
    out_params: list = [None] * len(cap.params)
    out_state: list = [None] * len(cap.params)
    for buckets in groups.values():
        ps, members = [], []
        for idx in buckets.values():
            ps.append(_merged_param(cap, idx))
            members.append(idx)
        first = next(iter(buckets.values()))[0]
        opt = _fresh(cls, dict(cap.hyper[first], params=ps), defaults)
        for idx, p in zip(members, ps):
            st = _merged_state(cap, idx)
            if st:
                opt.state[p] = st
        opt.step()
        for idx, p in zip(members, ps):
            sizes = [cap.params[i].numel() for i in idx]
            state = {k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
            cut = {
                k: (v.split(sizes) if len(idx) > 1 and v.shape == p.shape else [v] * len(idx)) for k, v in state.items()
            }
            for j, (i, w) in enumerate(zip(idx, p.detach().split(sizes) if len(idx) > 1 else [p.detach()])):
                out_params[i] = w
                out_state[i] = {k: parts[j] for k, parts in cut.items()}
    return out_params, out_state


def _bucket(cap: SliceCapture, i: int) -> tuple:
    """Windows with equal keys can be updated as one tensor (replay_update). A window of fewer than 2 elements
    stays alone: its elementwise state could not be told apart from scalar state by shape."""
    p, g = cap.params[i], cap.grads[i]
    if p.ndim != 1 or p.numel() < 2 or g is None or g.shape != p.shape:
        return ("alone", i)
    key: list = [p.dtype, p.device, g.dtype, g.device]
    for k in sorted(cap.state[i]):
        v = cap.state[i][k]
        if isinstance(v, torch.Tensor) and v.shape == p.shape:
            key.append((k, "window", v.dtype, v.device))
        elif isinstance(v, torch.Tensor):
            bits = v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            key.append((k, "scalar", v.dtype, v.device, tuple(v.shape), bits))
        elif v is None or isinstance(v, (bool, int, float, str)):
            key.append((k, "value", type(v).__name__, repr(v)))
        else:
            return ("alone", i)
    return tuple(key)


def _merged_param(cap: SliceCapture, idx: list[int]) -> torch.nn.Parameter:
    if len(idx) == 1:
        p = torch.nn.Parameter(cap.params[idx[0]].clone())
        p.grad = cap.grads[idx[0]].clone()
    else:
        p = torch.nn.Parameter(torch.cat([cap.params[i] for i in idx]))
        p.grad = torch.cat([cap.grads[i] for i in idx])
    return p


def _merged_state(cap: SliceCapture, idx: list[int]) -> dict:
    st0 = cap.state[idx[0]]
    if len(idx) == 1:
        return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st0.items()}
    n = cap.params[idx[0]].shape
    out = {}
    for k, v in st0.items():
        if isinstance(v, torch.Tensor) and v.shape == n:
            out[k] = torch.cat([cap.state[i][k] for i in idx])
        else:
            out[k] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def _flat(params: list[torch.Tensor], state: list[dict]) -> tuple[list[str], list[torch.Tensor]]:
    labels, tensors = [], []
    for i, (p, st) in enumerate(zip(params, state)):
        labels.append(f"param[{i}]")
        tensors.append(p)
        for k in sorted(st):
            labels.append(f"state[{i}].{k}")
            tensors.append(st[k])
    return labels, tensors


def _mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel(), 1)
    it = _INT[a.element_size()]
    x, y = a.contiguous().view(it), b.contiguous().view(it)
    return 0 if torch.equal(x, y) else int((x != y).sum())  # equal (the usual case): no mask, no count


def _all_mismatches(live: list[torch.Tensor], mine: list[torch.Tensor]) -> int:
    """sum(_mismatches(a, b)) over the pairs, in one comparison per dtype when the shapes pair up (one kernel,
    not one per tensor: a round compares a few tensors per parameter)."""
    pairs = list(zip(live, mine))
    by_dtype: dict[torch.dtype, tuple[list, list]] = {}
    for a, b in pairs:
        if a.shape != b.shape or a.dtype != b.dtype:
            return sum(_mismatches(a, b) for a, b in pairs)
        if a.numel():
            xs, ys = by_dtype.setdefault(a.dtype, ([], []))
            xs.append(a if a.ndim == 1 else a.reshape(-1))  # windows are 1-D already: no reshape call
            ys.append(b if b.ndim == 1 else b.reshape(-1))
    return sum(_mismatches(torch.cat(xs), torch.cat(ys)) for xs, ys in by_dtype.values())


def _all_equal(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    """Every pair the same bits, stopping at the first that is not: a peer's own windows under FSDP come from
    another shard and differ at once, and counting how many elements differ (as the self-check must) was most of
    a sweep's optimizer replay there."""
    for a, b in zip(xs, ys):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.numel():
            it = _INT[a.element_size()]
            if not torch.equal(a.contiguous().view(it), b.contiguous().view(it)):
                return False
    return True


def same_inputs(a: SliceCapture, b: SliceCapture) -> bool:
    """Do two captures hold the same pre-step windows, bit for bit (and the same names, starts, hyperparameters
    and scalar state)? Bits, not values: 0.0 and -0.0, or two NaNs, may update differently."""
    if (
        a.names != b.names
        or a.starts != b.starts
        or a.unsupported != b.unsupported
        or len(a.params) != len(b.params)
        or len(a.grads) != len(b.grads)
        or len(a.state) != len(b.state)
        or len(a.hyper) != len(b.hyper)
    ):
        return False
    # The windows of one parameter group share one hyperparameter dict (in a capture, and after pickling, which
    # keeps shared objects shared): each distinct pair is compared once, not once per window (it was half the
    # cost of a sweep's optimizer replay).
    seen: set[tuple[int, int]] = set()
    for x, y in zip(a.hyper, b.hyper):
        if (id(x), id(y)) not in seen:
            if not _same(x, y):
                return False
            seen.add((id(x), id(y)))
    ta, tb = list(a.params) + list(a.grads), list(b.params) + list(b.grads)
    for sa, sb in zip(a.state, b.state):
        if sorted(sa) != sorted(sb):
            return False
        for k in sa:
            if isinstance(sa[k], torch.Tensor) and isinstance(sb[k], torch.Tensor):
                ta.append(sa[k])
                tb.append(sb[k])
            elif not _same(sa[k], sb[k]):
                return False
    return all(x.device == y.device for x, y in zip(ta, tb)) and _all_equal(ta, tb)


def _same(x, y) -> bool:
    """Plain values (hyperparameters: numbers, tuples, dicts; scalar tensors by bits) equal?"""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (
            isinstance(x, torch.Tensor)
            and isinstance(y, torch.Tensor)
            and x.device == y.device
            and _mismatches(x.detach().reshape(-1), y.detach().reshape(-1)) == 0
        )
    if isinstance(x, dict) and isinstance(y, dict):
        return sorted(x, key=str) == sorted(y, key=str) and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_same(u, v) for u, v in zip(x, y))
    try:
        return type(x) is type(y) and bool(x == y)
    except Exception:  # noqa: BLE001 -- an exotic hyperparameter that cannot be compared: replay both
        return False


def replay_signature_inputs(
    cls, defaults: dict, source: SliceCapture, own: SliceCapture | None
) -> tuple[list[str], list[torch.Tensor]]:
    """The tensors a peer puts through C3: its replay of the source's slice, and its self-check.

    The self-check is one fixed-shape tensor [elements where live != own replay, live update missing] so that it
    compares across FSDP ranks whose shards (and slice sizes) differ: zeros on every healthy rank.
    """
    replayed = replay_update(cls, defaults, source)
    labels, tensors = _flat(*replayed)
    labels = [f"replay.{x}" for x in labels]
    bad, missing = 0, 1
    if own is not None and own.after_params and own.unsupported is None:
        missing = 0
        _, live = _flat(own.after_params, own.after_state)
        # Replicas (DDP, HSDP's replicate dim) hold bit-identical windows: the source's replay is then this rank's
        # replay of its own windows (the same inputs through the same kernel on the same rank), so it is not run
        # twice. Shards (FSDP) differ and replay their own.
        _, mine = _flat(*(replayed if same_inputs(source, own) else replay_update(cls, defaults, own)))
        bad = _all_mismatches(live, mine) + abs(len(live) - len(mine))
    labels.append("live_vs_replay")
    tensors.append(torch.tensor([bad, missing], dtype=torch.int64))
    return labels, tensors


__all__ = [
    "ELEMENTWISE",
    "OptimizerCapture",
    "SliceCapture",
    "replay_signature_inputs",
    "replay_update",
    "same_inputs",
    "supports",
    "windows",
]
