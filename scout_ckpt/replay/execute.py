"""Re-execution of a captured invocation on a copy of the module: the values replay fingerprints.

A copy, because the live module must not change by a bit (parameters, .grad, buffers, RNG streams). The copy keeps
the forward hooks that are part of the model's math -- the ones a user put on the target or inside it -- and drops
the plumbing: FSDP's and other frameworks' hooks (torch, deepspeed, megatron, accelerate, transformers, lightning,
torchtitan: they would issue collectives on the training group or record outputs) and scout-ckpt's own (they
would capture again). A user's hook that changes a block's output is what the live step computed, so the replay
must compute it too, or the live check (live.py) would see every healthy step disagree. A hook that must not
run on a replay (activation statistics, logging) can ask `replaying()`.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from scout_ckpt.replay import determinism
from scout_ckpt.replay.capture import Invocation, device_of
from scout_ckpt.replay.optimizer_replay import replay_signature_inputs
from scout_ckpt.replay.targets import original_class

# Forward-hook dicts whose user entries a replay keeps (with their flag dicts, keyed by the same hook ids).
_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
# Hooks of these packages are plumbing (collectives, recording, our own capture), never the model's math.
_PLUMBING = (
    "torch",
    "scout_ckpt",
    "deepspeed",
    "megatron",
    "accelerate",
    "transformers",
    "lightning",
    "pytorch_lightning",
    "torchtitan",
    "torchft",
)
_replaying = 0


def replaying() -> bool:
    """Is a replay running (on this thread's process)? For a user's forward hook that must not see replayed
    tensors as live (statistics, logging): `if scout_ckpt.replay.replaying(): return`."""
    return _replaying > 0


def _plumbing(hook) -> bool:
    """Is `hook` a framework's or scout-ckpt's, not the user's? Unknown origins count as plumbing."""
    fn = hook
    while True:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__func__"):  # a bound method
            fn = fn.__func__
        else:
            break
    mod = getattr(fn, "__module__", None)
    if not isinstance(mod, str):
        return True
    return mod.split(".", 1)[0] in _PLUMBING


def _user_hooks(m: nn.Module, root_ids: tuple[frozenset, frozenset] | None) -> dict:
    """The forward-hook dicts of a replay copy of `m`: its user hooks only. On the replayed root, whose captured
    inputs already passed the pre-hooks that ran before the capture's and whose live output is the one the hooks
    before the capture's post-hook made, only the others (`root_ids`: the ids of the pre-hooks that ran after the
    capture's, and of the post-hooks that ran before it, as the capture saw them)."""
    out: dict = {}
    keep: dict[str, set] = {}
    for name in _FORWARD_HOOKS:
        hooks = getattr(m, name, None)
        if not isinstance(hooks, dict):
            continue
        kept = type(hooks)()
        for hid, h in hooks.items():
            if _plumbing(h):
                continue
            if root_ids is not None and hid not in root_ids[0 if name == "_forward_pre_hooks" else 1]:
                continue
            kept[hid] = h
        out[name], keep[name] = kept, set(kept)
    for name in _HOOK_FLAGS:
        flags = getattr(m, name, None)
        if isinstance(flags, dict):
            ids = keep.get("_forward_pre_hooks" if "pre" in name else "_forward_hooks", set())
            out[name] = type(flags)((k, v) for k, v in flags.items() if k in ids)
    return out


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def replay_copy(module: nn.Module, inv: Invocation, hook_ids: tuple[frozenset, frozenset] | None = None) -> nn.Module:
    """A copy of `module` holding the captured parameters and buffers, with its users' forward hooks only.

    Plumbing hooks are dropped (module docstring); a user's forward hooks are kept, on the root only those the
    live call ran outside the capture (`hook_ids`: ModuleCapture.hook_ids, when the capture sat on `module`
    itself; None: it sat on a wrapper around it, and every hook of `module` ran inside it).
    Backward and state-dict hooks are dropped. The replay re-executes the module's own forward code.

    The copy is structural, not a `copy.deepcopy`: every submodule is a new object of its author's class (FSDP2's
    dynamic subclass undone) with its own `_parameters`, `_buffers` and `_modules` dicts, empty hook dicts and
    composable-API registries (FSDP2 state: process groups, meshes), its plain tensor attributes cloned, and its
    other attributes shared with the live module (read, not written, by a forward). Parameters and buffers are the
    capture's, cloned (a forward that writes a buffer -- BatchNorm's running stats -- writes the copy's). A deepcopy
    walked every attribute of every submodule and was 8% of a DDP sweep."""
    return _structural_copy(module, {}, hook_ids, "", (inv, {}, {}))


def _structural_copy(
    m: nn.Module, memo: dict[int, nn.Module], root_ids: tuple[frozenset, frozenset] | None, prefix: str, swap: tuple
) -> nn.Module:
    """`m` (named `prefix` under the replayed root) and its submodules as new module objects (see replay_copy); a
    submodule registered twice is copied once (memo), as deepcopy would. The walk visits the modules in the order
    `named_modules` does and each parameter (buffer) under the first name it meets it by, the order and names of
    `named_parameters` (`named_buffers`), which name the capture's copies: so the copy's parameters, buffers and
    training flags are set in this one walk (`swap`: the invocation, name by live tensor, fresh tensor by name)."""
    root = not memo
    if id(m) in memo:
        return memo[id(m)]
    new = object.__new__(original_class(m))
    memo[id(m)] = new
    d = dict(m.__dict__)
    for name in _HOOK_DICTS:
        if isinstance(d.get(name), dict):
            d[name] = type(d[name])()
    d.update(_user_hooks(m, root_ids if root else None))
    for name, v in d.items():
        if name.startswith("__composable_api_state_key") and isinstance(v, (dict, list)):
            d[name] = type(v)()
        elif isinstance(v, torch.Tensor):
            d[name] = v.detach().clone()
    inv, names, fresh = swap
    dot = prefix + "." if prefix else ""
    params = {}
    for leaf, p in m._parameters.items():
        if p is not None:
            n = names.setdefault(id(p), dot + leaf)
            if n not in fresh:
                fresh[n] = nn.Parameter(inv.params[n].clone(), requires_grad=p.requires_grad)
            p = fresh[n]
        params[leaf] = p
    bufs = {}
    for leaf, b in m._buffers.items():
        if b is not None:
            n = "buffer:" + names.setdefault(("buffer", id(b)), dot + leaf)
            if n not in fresh:
                fresh[n] = inv.buffers[n[len("buffer:") :]].clone()
            b = fresh[n]
        bufs[leaf] = b
    d["_parameters"], d["_buffers"] = params, bufs
    d["_non_persistent_buffers_set"] = set(m._non_persistent_buffers_set)
    d["training"] = inv.training.get(prefix, m.training)
    d["_modules"] = {
        k: None if c is None else _structural_copy(c, memo, None, dot + k, swap) for k, c in m._modules.items()
    }
    new.__dict__.update(d)
    return new


@contextlib.contextmanager
def replay_mode(device: torch.device, deterministic: bool):
    """Deterministic algorithms on and RNG streams forked for the duration; both restored after."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    devices = [device] if device.type == "cuda" else []
    global _replaying
    _replaying += 1
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            if deterministic:  # strict on CUDA: warn-only leaves attention's backward non-deterministic
                torch.use_deterministic_algorithms(True, warn_only=determinism.replay_warn_only(device))
            with torch.enable_grad():
                yield
    finally:
        _replaying -= 1
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def replay_module(
    module: nn.Module, inv: Invocation, deterministic: bool = True, hook_ids: tuple[frozenset, frozenset] | None = None
) -> tuple[list[str], list[torch.Tensor]]:
    """Forward and backward of the captured invocation on a copy: (labels, tensors) to fingerprint. The first
    labels, output[i], are the output's tensors in the order the live signatures (Invocation.live) list them."""
    device = device_of(module)
    inv = inv.to(device)
    mod = replay_copy(module, inv, hook_ids)
    with replay_mode(device, deterministic):
        # own storage: a received state is a view into its transport buffer, and set_rng_state reads the storage
        # from its start (a view at an offset crashed the process)
        torch.set_rng_state(inv.rng.clone())
        if inv.device_rng is not None:
            torch.cuda.set_rng_state(inv.device_rng.cpu().clone(), device)
        leaves, spec = tree_flatten((inv.args, inv.kwargs))
        leaves = [
            x.detach().clone().requires_grad_(rg) if isinstance(x, torch.Tensor) else x
            for x, rg in zip(leaves, inv.requires_grad)
        ]
        args, kwargs = tree_unflatten(leaves, spec)
        # the live forward's autocast state, whatever the caller of on_step has on
        ac = (
            torch.autocast(inv.autocast[0], dtype=inv.autocast[1])
            if inv.autocast
            else torch.autocast(device.type, enabled=False)
        )
        with ac:
            out = mod(*args, **kwargs)
        outs, _ = tree_flatten(out)
        roots = [
            (o, g)
            for o, g in zip(outs, inv.grad_outputs)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        x_in = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
        named = [(n, p) for n, p in mod.named_parameters() if p.requires_grad]  # one walk of the copy
        names, params = [n for n, _ in named], [p for _, p in named]
        grads: tuple = ()
        if roots and (x_in or params):
            grads = torch.autograd.grad([o for o, _ in roots], x_in + params, [g for _, g in roots], allow_unused=True)
    empty = torch.zeros(0)
    labels = [f"output[{i}]" for i, o in enumerate(outs) if isinstance(o, torch.Tensor)]
    tensors = [o.detach() for o in outs if isinstance(o, torch.Tensor)]
    grads = list(grads) or [None] * (len(x_in) + len(params))
    labels += [f"grad_input[{i}]" for i in range(len(x_in))] + [f"grad_param:{n}" for n in names]
    tensors += [empty if g is None else g for g in grads]
    return labels, tensors


def replay_target(recipe: str, cap, payload, deterministic: bool, optimizer) -> tuple[list[str], list[torch.Tensor]]:
    """One target's replay, whatever its recipe: a module's invocation on a copy (replay_module), or the
    optimizer's captured windows through a fresh optimizer of the live one's class (optimizer_replay)."""
    if recipe != "optimizer":
        return replay_module(cap.inner, payload, deterministic, cap.hook_ids if cap.module is cap.inner else None)
    if payload.unsupported:
        return ["unsupported"], [torch.zeros(1)]
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    return replay_signature_inputs(type(optimizer), optimizer.defaults, payload.to(device), cap.capture)


__all__ = ["replay_copy", "replay_mode", "replay_module", "replay_target", "replaying"]
