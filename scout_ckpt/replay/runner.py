"""The in-situ SDC replay runner: re-execute one captured layer (or optimizer slice) per step on every peer.

Why it exists: a rank whose arithmetic is silently wrong contaminates the all-reduced gradients of every replica,
so the replicas' parameters stay bit-identical and checkpoint consensus sees nothing. Replaying the *same* captured
invocation on every peer and comparing exact signatures (C3) exposes the rank that computes differently.

Protocol, driven by `on_step(step)` (called after each optimizer step):
  on_step(S-1)  arm capture hooks on the target the schedule gives step S
  step S        the hooks clone the target's inputs, parameters, RNG state and output gradient
  on_step(S)    disarm; the source peer (rotating) broadcasts its capture over the peer group; every peer
                re-executes it on copies; C3 over the signatures -> one replay row, identical on all peers.
All communication is on gloo side groups, never the training group; live grads, parameters, buffers and RNG
streams are never touched (replay runs under `torch.random.fork_rng` on deep copies).
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from scout_ckpt.consensus.c3 import c3_over_group
from scout_ckpt.consensus.signatures import replica_signatures
from scout_ckpt.consensus.timing import Confirmer, robust_outliers
from scout_ckpt.replay.capture import Invocation, ModuleCapture, device_of
from scout_ckpt.replay.optimizer_replay import OptimizerCapture, replay_signature_inputs, supports
from scout_ckpt.replay.schedule import Schedule, Target, discover_targets

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


# ---- re-execution on copies -----------------------------------------------------------------------------------

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


# ---- the runner -----------------------------------------------------------------------------------------------

class ReplayRunner:
    """Replays one scheduled target per `interval` steps across the peer group; see the module docstring.

    groups: a consensus.groups.ConsensusGroups; its gloo groups carry all replay traffic. peers: "auto" uses the
    replica group when it has 3+ members and the world group otherwise (pure FSDP, 2-way HSDP); "replicas" or
    "world" force one. `on_step` returns replay rows for the ledger, identical on all peers.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, groups,
                 targets: list[Target] | None = None, interval: int = 1, deterministic: bool = True,
                 peers: str = "auto", opt_params: int = 4, opt_elems: int = 4096, straggler_rounds: int = 3):
        self.model = model
        self.optimizer = optimizer
        self.deterministic = deterministic
        self.rank = dist.get_rank()
        opt = optimizer if optimizer is not None and supports(optimizer) else None
        # What replay does not check, for `explain`: an optimizer whose update is not elementwise.
        self.not_covered = [] if optimizer is None or opt is not None else [
            f"optimizer {type(optimizer).__name__} (not elementwise: slice replay does not apply)"]
        self._targets = list(targets) if targets is not None else discover_targets(model, opt)
        self.schedule = Schedule(self._targets, interval)
        self.group, self.peers = _peer_group(groups, peers)
        modules = dict(model.named_modules())
        self._captures: dict[str, Any] = {}
        for recipe, name in self._targets:
            if recipe == "optimizer":
                if optimizer is None:
                    raise ValueError("replay target 'optimizer' needs the optimizer")
                self._captures[name] = OptimizerCapture(optimizer, opt_params, opt_elems)
            else:
                if name not in modules:
                    raise ValueError(f"replay target {name!r} is not a submodule of the model")
                self._captures[name] = ModuleCapture(modules[name])
        self._armed: tuple[int, Target] | None = None
        self._events: list[dict] = []
        self._confirmer = Confirmer(straggler_rounds)
        self._reported: set[int] = set()

    def targets(self) -> list[Target]:
        """The coverage set: a step certifies only if each has a clean replay since the last certified step."""
        return list(self._targets)

    def events(self) -> list[dict]:
        """Straggler events found from replay timings so far (identical on all peers)."""
        return list(self._events)

    def begin(self, step: int) -> None:
        """Arm for step+1 before the first on_step (e.g. right after resuming at `step`)."""
        self.close()
        self._arm(step + 1)

    def close(self) -> None:
        for cap in self._captures.values():
            cap.disarm()
        self._armed = None

    def on_step(self, step: int) -> list[dict]:
        """Called once per optimizer step, after it, on every rank: replay what step `step` captured, arm next."""
        rows: list[dict] = []
        armed, self._armed = self._armed, None
        if armed is not None:
            self._captures[armed[1][1]].disarm()
            if armed[0] == step:
                row = self._replay(step, armed[1])
                if row is not None:
                    rows.append(row)
        self._arm(step + 1)
        return rows

    def _arm(self, step: int) -> None:
        target = self.schedule.target_for(step)
        if target is not None:
            self._captures[target[1]].arm()
            self._armed = (step, target)

    # ---- one replay --------------------------------------------------------------------------------------------

    def _replay(self, step: int, target: Target) -> dict | None:
        recipe, name = target
        cap = self._captures[name]
        src = self.peers[self.schedule.source_index(step, len(self.peers))]
        payload = None
        if self.rank == src:
            payload = _cpu(cap.invocation if recipe != "optimizer" else cap.capture)
        box = [payload]
        dist.broadcast_object_list(box, src=src, group=self.group)
        payload = box[0]
        if payload is None:  # the source never ran the target this step: nothing to compare, no row
            return None
        t0 = time.perf_counter()
        try:
            labels, tensors = self._execute(recipe, cap, payload)
            sigs = replica_signatures(tensors)
        except Exception as e:  # noqa: BLE001 -- a peer that cannot replay must not leave the others waiting
            warnings.warn(f"replay of {name} at step {step} failed on rank {self.rank}: {e!r}")
            labels, sigs = [], None
        elapsed = time.perf_counter() - t0
        # One small gather first: every peer's time and whether it has signatures to compare (and how many).
        header = self._gather([elapsed, float(sigs is not None), float(len(labels))])
        durations = {r: h[0] for r, h in header.items()}
        self._timing(step, target, durations)
        detail: dict = {"source": src, "peers": list(self.peers), "signatures": len(labels),
                        "durations": {str(r): round(d, 6) for r, d in durations.items()}}
        failed = sorted(r for r, h in header.items() if not h[1])
        if failed or len({h[2] for h in header.values()}) > 1:
            status, ranks = "INCONCLUSIVE", []
            detail["failed_ranks"] = failed
            detail["counts"] = {str(r): int(h[2]) for r, h in header.items()}
        else:
            verdict = c3_over_group(sigs, self.group, self.peers, names=labels)
            status, ranks, why = _summarise(verdict)
            detail.update(why)
        if recipe == "optimizer" and payload.unsupported:
            status, detail["unsupported"] = "INCONCLUSIVE", payload.unsupported
        return {"step": step, "recipe": recipe, "target": name, "status": status, "ranks": ranks,
                "duration_s": max(durations.values()), "detail": detail}

    def _execute(self, recipe: str, cap, payload) -> tuple[list[str], list[torch.Tensor]]:
        if recipe != "optimizer":
            return replay_module(cap.module, payload, self.deterministic)
        if payload.unsupported:
            return ["unsupported"], [torch.zeros(1)]
        device = next((p.device for g in self.optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        return replay_signature_inputs(type(self.optimizer), self.optimizer.defaults, payload.to(device),
                                       cap.capture)

    def _gather(self, values: list[float]) -> dict[int, list[float]]:
        mine = torch.tensor(values, dtype=torch.float64)
        out = [torch.zeros_like(mine) for _ in self.peers]
        dist.all_gather(out, mine, group=self.group)
        return {r: t.tolist() for r, t in zip(self.peers, out)}

    def _timing(self, step: int, target: Target, durations: dict[int, float]) -> None:
        confirmed = self._confirmer.update(robust_outliers(durations))
        new = {r: v for r, v in confirmed.items() if r not in self._reported}
        self._reported = set(confirmed)  # a rank that recovers and slows down again is reported again
        for rank, slowdown in sorted(new.items()):
            self._events.append({"kind": "straggler", "ranks": [rank], "step": step,
                                 "detail": {"slowdown": round(float(slowdown), 3), "source": "replay",
                                            "target": target[1]}})


def _cpu(obj: Any) -> Any:
    """Captures travel through broadcast_object_list on gloo: host tensors."""
    return None if obj is None else obj.to("cpu")


def _peer_group(groups, peers: str) -> tuple[Any, list[int]]:
    """The replica group when it can attribute on its own (3+ members, or peers="replicas"), else the world.

    Module targets replay full (unsharded) parameters and the optimizer recipe replays a broadcast slice, so any
    set of ranks is a valid peer set; the world is used where the replica group is missing (FSDP) or too small to
    name a culprit (HSDP with 2 replicas)."""
    if peers not in ("auto", "replicas", "world"):
        raise ValueError(f"peers must be auto, replicas or world, got {peers!r}")
    mine = list(groups.group_ranks)
    if groups.group is not None and len(mine) > 1 and (peers == "replicas" or (peers == "auto" and len(mine) >= 3)):
        return groups.group, mine
    return groups.world_group, list(range(groups.world_size))


def _summarise(verdict) -> tuple[str, list[int], dict]:
    """Row status, attributed global ranks, and what disagreed (at most 16 signature names, and how the peers
    split on the first of them)."""
    detail: dict = {"disagree": list(verdict.disagreeing_names[:16]), "n_disagree": len(verdict.disagreeing)}
    if verdict.disagreeing:
        first = verdict.per_tensor[verdict.disagreeing[0]]
        detail["split"] = [[verdict.group_ranks[p] for p in cls] for cls in first.classes]
    return verdict.status.upper(), sorted(verdict.attributed_ranks), detail


__all__ = ["ReplayRunner", "replay_copy", "replay_module", "replay_mode"]
