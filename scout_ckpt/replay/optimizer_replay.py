"""Optimizer replay on a bounded slice: re-run the update of a few parameters' first elements on copies.

Elementwise optimizers (SGD, Adam(W), RMSprop, ...) update each element from that element's parameter, gradient
and state alone, so the first `max_elems` elements of a parameter can be updated in isolation by a fresh optimizer
of the same class and hyperparameters and must land on the same bits as the live update. Two checks come out of
one capture: every peer re-runs the *source's* pre-step slice (a persistently wrong optimizer kernel on a peer
shows), and every peer re-runs *its own* slice and compares with its own live result (a corrupted live update
shows, also on FSDP shards, which no other rank holds). The self-check result -- a count of mismatching elements -- is the
same on every healthy rank, so it can go through C3 with the replayed values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import optim

# Optimizers whose update of one element reads only that element (and scalar state such as `step`).
ELEMENTWISE = tuple(getattr(optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
    if hasattr(optim, n))
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def supports(optimizer) -> bool:
    return isinstance(optimizer, ELEMENTWISE)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _slice(t: torch.Tensor, n: int) -> torch.Tensor:
    return _local(t).detach().reshape(-1)[:n].clone()


@dataclass
class SliceCapture:
    """Pre-step inputs of the update (hyperparameters, parameter, grad and state slices) and the live result."""

    names: list[str] = field(default_factory=list)       # "group.index" of each sliced parameter
    hyper: list[dict] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    state: list[dict] = field(default_factory=list)
    after_params: list[torch.Tensor] = field(default_factory=list)
    after_state: list[dict] = field(default_factory=list)
    unsupported: str | None = None

    def pre(self) -> "SliceCapture":
        """What a peer needs to replay it (the live results stay home)."""
        return SliceCapture(self.names, self.hyper, self.params, self.grads, self.state, unsupported=self.unsupported)

    def to(self, device) -> "SliceCapture":
        """The pre-step part on `device`: host copies travel to peers, replays run where the live update ran."""
        mv = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return SliceCapture(self.names, self.hyper, [mv(p) for p in self.params], [mv(g) for g in self.grads],
                            [{k: mv(v) for k, v in st.items()} for st in self.state], unsupported=self.unsupported)


class OptimizerCapture:
    """Step pre/post hooks that snapshot `max_params` parameters (spread over the list) x `max_elems` elements."""

    def __init__(self, optimizer: optim.Optimizer, max_params: int = 4, max_elems: int = 4096):
        self.optimizer = optimizer
        self.max_params = max_params
        self.max_elems = max_elems
        self.capture: SliceCapture | None = None
        self._chosen: list[tuple[int, int, torch.Tensor, int]] = []
        self._handles: list = []

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        self.disarm()
        self.capture = None
        self._handles = [self.optimizer.register_step_pre_hook(self._pre),
                         self.optimizer.register_step_post_hook(self._post)]

    def disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pick(self) -> list[tuple[int, int, torch.Tensor]]:
        cands = [(gi, pi, p) for gi, g in enumerate(self.optimizer.param_groups) for pi, p in enumerate(g["params"])
                 if p.grad is not None and _local(p).numel() > 0]
        if len(cands) <= self.max_params:
            return cands
        k = self.max_params
        return [cands[round(i * (len(cands) - 1) / (k - 1))] for i in range(k)] if k > 1 else cands[:1]

    def _pre(self, opt, args, kwargs) -> None:
        if self.capture is not None:
            return
        cap = SliceCapture()
        self._chosen = []
        for gi, pi, p in self._pick():
            n = min(self.max_elems, _local(p).numel())
            state = {}
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    lv = _local(v)
                    if lv.shape == _local(p).shape:
                        state[k] = _slice(v, n)
                    elif lv.numel() == 1:
                        state[k] = lv.detach().clone()
                    else:
                        cap.unsupported = f"state {k!r} of param {gi}.{pi} is not elementwise ({tuple(lv.shape)})"
                else:
                    state[k] = v
            cap.names.append(f"{gi}.{pi}")
            cap.hyper.append({k: v for k, v in opt.param_groups[gi].items() if k != "params"})
            cap.params.append(_slice(p, n))
            cap.grads.append(_slice(p.grad, n))
            cap.state.append(state)
            self._chosen.append((gi, pi, p, n))
        self.capture = cap

    def _post(self, opt, args, kwargs) -> None:
        cap = self.capture
        if cap is None or cap.after_params or len(self._chosen) != len(cap.params):
            return
        for gi, pi, p, n in self._chosen:
            cap.after_params.append(_slice(p, n))
            cap.after_state.append({k: (_slice(v, n) if _local(v).shape == _local(p).shape else _local(v).detach().clone())
                                    for k, v in opt.state.get(p, {}).items() if isinstance(v, torch.Tensor)})
        self._chosen = []


def _fresh(cls, group: dict, defaults: dict):
    try:
        return cls([group])
    except TypeError:  # a subclass whose constructor needs arguments the group does not name
        return cls([group], **defaults)


def replay_update(cls, defaults: dict, cap: SliceCapture) -> tuple[list[torch.Tensor], list[dict]]:
    """Re-run the update of each captured slice with a fresh optimizer of class `cls`: new params, new state."""
    out_params, out_state = [], []
    for hyper, p0, g, st in zip(cap.hyper, cap.params, cap.grads, cap.state):
        p = torch.nn.Parameter(p0.clone())
        p.grad = g.clone()
        opt = _fresh(cls, dict(hyper, params=[p]), defaults)
        if st:
            opt.state[p] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
        opt.step()
        out_params.append(p.detach())
        out_state.append({k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)})
    return out_params, out_state


def _flat(params: list[torch.Tensor], state: list[dict]) -> tuple[list[str], list[torch.Tensor]]:
    labels, tensors = [], []
    for i, (p, st) in enumerate(zip(params, state)):
        labels.append(f"param[{i}]"); tensors.append(p)
        for k in sorted(st):
            labels.append(f"state[{i}].{k}"); tensors.append(st[k])
    return labels, tensors


def _mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel(), 1)
    it = _INT[a.element_size()]
    return int((a.contiguous().view(it) != b.contiguous().view(it)).sum())


def replay_signature_inputs(cls, defaults: dict, source: SliceCapture, own: SliceCapture | None
                            ) -> tuple[list[str], list[torch.Tensor]]:
    """The tensors a peer puts through C3: its replay of the source's slice, and its self-check.

    The self-check is one fixed-shape tensor [elements where live != own replay, live update missing] so that it
    compares across FSDP ranks whose shards (and slice sizes) differ: zeros on every healthy rank.
    """
    labels, tensors = _flat(*replay_update(cls, defaults, source))
    labels = [f"replay.{x}" for x in labels]
    bad, missing = 0, 1
    if own is not None and own.after_params and own.unsupported is None:
        missing = 0
        _, live = _flat(own.after_params, own.after_state)
        _, mine = _flat(*replay_update(cls, defaults, own))
        bad = sum(_mismatches(a, b) for a, b in zip(live, mine)) + abs(len(live) - len(mine))
    labels.append("live_vs_replay")
    tensors.append(torch.tensor([bad, missing], dtype=torch.int64))
    return labels, tensors


__all__ = ["ELEMENTWISE", "supports", "SliceCapture", "OptimizerCapture", "replay_update",
           "replay_signature_inputs"]
