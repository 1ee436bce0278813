"""Re-execution of a captured invocation on a hook-free copy of the module: the values replay fingerprints.

A copy, because the live module must not change by a bit (parameters, .grad, buffers, RNG streams), and hook-free,
because FSDP's hooks would issue collectives on the training group, ours would capture again, and a user's would
see replayed tensors as if they were live.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from scout_ckpt.replay.capture import Invocation, device_of

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def replay_copy(module: nn.Module, inv: Invocation) -> nn.Module:
    """A deep copy of `module` holding the captured parameters and buffers, without any module hooks.

    Hooks are dropped: FSDP's would issue collectives on the training group, ours would capture again, and a
    user's (activation statistics, logging) would see replayed tensors as if they were live. The replay
    re-executes the module's own forward code.

    The live parameters are not copied at all (the memo maps them to themselves and they are swapped for the
    snapshot right after), so FSDP's sharded DTensors and their meshes never get deep-copied, and FSDP2 modules
    come back as their original class."""
    memo: dict[int, Any] = {}
    for m in module.modules():
        for name in _HOOK_DICTS:
            d = m.__dict__.get(name)
            if isinstance(d, dict):
                memo[id(d)] = type(d)()
        for name, v in m.__dict__.items():  # composable-API registries (FSDP2 state: process groups, meshes)
            if name.startswith("__composable_api_state_key") and isinstance(v, (dict, list)):
                memo[id(v)] = type(v)()
    for t in list(module.parameters()) + list(module.buffers()):
        memo[id(t)] = t
    mod = _deepcopy_unwrapped(module, memo)
    canon = {id(p): n for n, p in mod.named_parameters()}
    canon_b = {id(b): n for n, b in mod.named_buffers()}
    fresh: dict[str, torch.Tensor] = {}
    for sub in mod.modules():
        for leaf, p in list(sub._parameters.items()):
            if p is not None:
                n = canon[id(p)]
                if n not in fresh:
                    fresh[n] = nn.Parameter(inv.params[n].clone(), requires_grad=p.requires_grad)
                sub._parameters[leaf] = fresh[n]
        for leaf, b in list(sub._buffers.items()):
            if b is not None:
                n = "buffer:" + canon_b[id(b)]
                if n not in fresh:
                    fresh[n] = inv.buffers[canon_b[id(b)]].clone()
                sub._buffers[leaf] = fresh[n]
    for n, m in mod.named_modules():
        m.training = inv.training.get(n, m.training)
    return mod


def _deepcopy_unwrapped(module: nn.Module, memo: dict) -> nn.Module:
    """copy.deepcopy, except that FSDP2 modules (whose __deepcopy__ refuses) come back as their original class."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return copy.deepcopy(module, memo)
    wrapped = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in wrapped:  # empty shells first, so references between them resolve through the memo
        cls = type(m).__mro__[type(m)._orig_cls_mro_index]
        memo[id(m)] = object.__new__(cls)
    for m in wrapped:
        memo[id(m)].__dict__.update(copy.deepcopy(m.__dict__, memo))
    return memo[id(module)] if id(module) in memo else copy.deepcopy(module, memo)


@contextlib.contextmanager
def replay_mode(device: torch.device, deterministic: bool):
    """Deterministic algorithms on and RNG streams forked for the duration; both restored after."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            if deterministic:
                torch.use_deterministic_algorithms(True, warn_only=True)
            with torch.enable_grad():
                yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def replay_module(module: nn.Module, inv: Invocation, deterministic: bool = True
                  ) -> tuple[list[str], list[torch.Tensor]]:
    """Forward and backward of the captured invocation on a copy: (labels, tensors) to fingerprint."""
    device = device_of(module)
    inv = inv.to(device)
    mod = replay_copy(module, inv)
    with replay_mode(device, deterministic):
        torch.set_rng_state(inv.rng)
        if inv.device_rng is not None:
            torch.cuda.set_rng_state(inv.device_rng, device)
        leaves, spec = tree_flatten((inv.args, inv.kwargs))
        leaves = [x.detach().clone().requires_grad_(rg) if isinstance(x, torch.Tensor) else x
                  for x, rg in zip(leaves, inv.requires_grad)]
        args, kwargs = tree_unflatten(leaves, spec)
        # the live forward's autocast state, whatever the caller of on_step has on
        ac = (torch.autocast(inv.autocast[0], dtype=inv.autocast[1]) if inv.autocast
              else torch.autocast(device.type, enabled=False))
        with ac:
            out = mod(*args, **kwargs)
        outs, _ = tree_flatten(out)
        roots = [(o, g) for o, g in zip(outs, inv.grad_outputs)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        x_in = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
        names = [n for n, p in mod.named_parameters() if p.requires_grad]
        params = [p for p in mod.parameters() if p.requires_grad]
        grads: tuple = ()
        if roots and (x_in or params):
            grads = torch.autograd.grad([o for o, _ in roots], x_in + params, [g for _, g in roots],
                                        allow_unused=True)
    empty = torch.zeros(0)
    labels = [f"output[{i}]" for i, o in enumerate(outs) if isinstance(o, torch.Tensor)]
    tensors = [o.detach() for o in outs if isinstance(o, torch.Tensor)]
    grads = list(grads) or [None] * (len(x_in) + len(params))
    labels += [f"grad_input[{i}]" for i in range(len(x_in))] + [f"grad_param:{n}" for n in names]
    tensors += [empty if g is None else g for g in grads]
    return labels, tensors


__all__ = ["replay_copy", "replay_mode", "replay_module"]
