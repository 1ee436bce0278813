"""Capture one live invocation of a module: what went in, with which parameters, and the gradient that came back.

The hooks only read: inputs and parameters are detached clones, and the output's tensor hook returns None, so the
live autograd graph, .grad, parameters and RNG are exactly what they would be without them. Parameters are
cloned in the forward *pre*-hook, which runs after FSDP2's own (prepended) pre-forward hook has unsharded them:
the snapshot is the full parameter as the forward used it, under DDP, FSDP and HSDP alike.

Hooks go on the module its parent calls (a CheckpointWrapper or a per-block torch.compile wrapper included: their
hooks run eagerly around the live call); parameters are named and replayed on the unwrapped module.
A capture made with `params=False` (the save-boundary sweep) records no parameters: the sweep replays with the
parameters the module holds when the sweep runs, i.e. the state being saved, so no copy of the model is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map


def _clone(x: Any) -> Any:
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def _full(t: torch.Tensor) -> torch.Tensor:
    # A parameter still sharded at forward time (no unshard hook ran): gather it. Collective, but every rank
    # captures the same target in the same step, so it is matched.
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@dataclass
class Invocation:
    """One forward/backward of a target, in a form that can be sent to peers and re-executed there."""

    args: tuple
    kwargs: dict
    requires_grad: tuple          # per flattened (args, kwargs) leaf: did the live input require grad
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    training: dict[str, bool]     # submodule name -> .training at capture time
    rng: torch.Tensor             # CPU generator state before the forward
    device_rng: torch.Tensor | None
    autocast: tuple | None        # (device_type, dtype) when the forward ran under autocast
    grad_outputs: list = field(default_factory=list)  # per flattened output leaf: its grad, or None

    def to(self, device: torch.device | str) -> Invocation:
        move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x
        return Invocation(
            tree_map(move, self.args), tree_map(move, self.kwargs), self.requires_grad,
            {k: move(v) for k, v in self.params.items()}, {k: move(v) for k, v in self.buffers.items()},
            self.training, self.rng, self.device_rng, self.autocast, [move(g) for g in self.grad_outputs])


def current_state(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The module's parameters and buffers as they are now, full (a sharded DTensor is gathered: a collective on
    its mesh, which every rank reaches in the same order because the sweep walks the targets in one order)."""
    return ({n: _full(p).detach() for n, p in module.named_parameters()},
            {n: _full(b).detach() for n, b in module.named_buffers()})


def device_of(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return getattr(t, "device", torch.device("cpu"))
    return torch.device("cpu")


class ModuleCapture:
    """Arm on one module for one step; the first forward of the step (and its backward) is captured.

    module: where the hooks go (what the parent calls); inner: the unwrapped module whose parameters are snapshot
    and which replay re-executes (default: module itself); params: snapshot parameters and buffers."""

    def __init__(self, module: nn.Module, inner: nn.Module | None = None, *, params: bool = True):
        self.module = module
        self.inner = inner if inner is not None else module
        self.params = params
        self.invocation: Invocation | None = None
        self._handles: list = []
        self._pending_output = False  # the captured forward has not returned yet

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        self.disarm()
        self.invocation = None
        self._pending_output = False
        self._handles = [
            self.module.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.module.register_forward_hook(self._post),
        ]

    def disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.invocation is not None:  # activation recompute or a second micro-batch: keep the first
            return
        leaves, _ = tree_flatten((args, kwargs))
        inner = self.inner
        dev = device_of(inner)
        autocast = None
        if torch.is_autocast_enabled(dev.type):
            autocast = (dev.type, torch.get_autocast_dtype(dev.type))
        self.invocation = Invocation(
            args=tree_map(_clone, args), kwargs=tree_map(_clone, kwargs),
            requires_grad=tuple(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves),
            params={n: _full(p).detach().clone() for n, p in inner.named_parameters()} if self.params else {},
            buffers={n: _full(b).detach().clone() for n, b in inner.named_buffers()} if self.params else {},
            training={n: m.training for n, m in inner.named_modules()},
            rng=torch.get_rng_state(),
            device_rng=torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None,
            autocast=autocast,
        )
        self._pending_output = True

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        inv = self.invocation
        if inv is None or not self._pending_output:
            return
        self._pending_output = False
        outs, _ = tree_flatten(output)
        inv.grad_outputs = [None] * len(outs)
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and o.requires_grad:
                o.register_hook(self._grad_hook(inv, i))

    @staticmethod
    def _grad_hook(inv: Invocation, i: int):
        def hook(grad: torch.Tensor) -> None:
            if inv.grad_outputs[i] is None:
                inv.grad_outputs[i] = grad.detach().clone()
            # never change the live gradient
        return hook


__all__ = ["Invocation", "ModuleCapture", "current_state", "device_of"]
