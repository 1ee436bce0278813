"""DistributedDataParallel under the observer: counted by default, traced through a comm hook on request.

Why no hook by default. DDP's reducer all-reduces its gradient buckets in C++, which no Python patch sees. A
Python comm hook makes each bucket visible, but it costs more than the observer may take (1% per step): with
any Python hook the reducer copies gradients into the bucket without scaling them (without one it folds the
1/world size into that copy), so averaging takes a pass of its own, and every bucket runs a Python callback.
Measured (bench/observer_overhead.py, 2 gloo ranks, MLP 4x512, batch 32 / 128): torch's reference
`allreduce_hook` alone 1.089 / 1.081 of plain DDP's CPU time, the traced hook below 1.134 / 1.069. So by
default nothing is registered: DDP's all-reduces are counted from its process group's own C++ sequence number
(observer/counts.py), which is incremented when each bucket's all-reduce is issued. That is enough to attribute
a hang (the rank whose count stays behind the others' is not in the collective they wait in), to name a
straggler (the rank whose compute per step, to the end of its own backward, is longest: observer/stamps.py) and to
catch a rank-dependent extra Python collective (the others issued a native collective at the position it
took), and a collective that fails under a rank (a DDP all-reduce raising in backward) marks that rank a victim, not a culprit.

What only the traced hook gives: a fingerprint per bucket (its shape and dtype), so a rank whose *buckets*
differ from the others' (a different model or bucket layout, same count) is a desync by fingerprint rather
than a hang or a crash; and each bucket's wait in the busy time. Opt in with
`observer=ObserverOptions(ddp_comm_hook="traced")`: `observed_allreduce_hook` issues each bucket's all-reduce through the
tracer, averaging like torch's reference `allreduce_hook`, at less cost than it: ReduceOp.AVG where the
backend averages as it reduces (NCCL), else (gloo) the division runs in the all-reduce's one completion
callback, off the training thread (fp16 and narrower are divided first, as the reference does, so that the
sum cannot overflow), and that callback also ends the rank's wait for the tracer.

A user's own DDP comm hook. torch lets a DDP module hold one hook, registered once (a second registration
raises "register_comm_hook or register_builtin_comm_hook can only be called once"), and the reducer cannot be
asked which hook it holds. With the default nothing is registered, so any hook the user registers, before or
after the Checkpointer, is the module's, and its collectives are counted (and, when they go through
`torch.distributed.*`, traced). With a hook given to the observer
(`observer=ObserverOptions(ddp_comm_hook=hook, ddp_comm_state=state)`) or "traced":
  - a Python hook registered before the Checkpointer is kept as it is (torch 2.13 lists Python hooks in
    `ddp._comm_hooks`), nothing is registered;
  - a built-in C++ hook (`_register_builtin_comm_hook`, e.g. FP16_COMPRESS) holds the reducer: a warning says
    the traced hook could not be registered (its collectives are still counted).

FSDP2 (`fully_shard`) needs nothing: torch 2.13 issues its all-gathers and reduce-scatters as Python calls to
`dist.all_gather_single` / `dist.reduce_scatter_single`, which the tracer wraps, and its mesh groups are
counted too.
"""

from __future__ import annotations

import logging

log = logging.getLogger("scout_ckpt.observer")


class HookState:
    """The observed hook's state: the DDP module's process group, its size, and how to average."""

    __slots__ = ("group", "op", "size", "tracer")

    def __init__(self, group, tracer=None):
        import torch.distributed as dist

        self.group = group if group is not None else dist.group.WORLD
        self.size = self.group.size()
        self.tracer = tracer
        self.op = dist.ReduceOp.AVG if _averages_natively(self.group) else dist.ReduceOp.SUM


def _averages_natively(group) -> bool:
    import torch.distributed as dist

    try:
        return dist.get_backend(group) == "nccl"
    except (RuntimeError, ValueError):
        return False


def observed_allreduce_hook(state: HookState, bucket):
    """Averages `bucket` across `state.group` like torch's `allreduce_hook`, through the tracer, with one
    completion callback (which also ends this rank's wait in the heartbeat). Falls back to the untraced call
    once the tracer is uninstalled (after Checkpointer.close()): the hook stays registered on the module."""
    import torch.distributed as dist

    tensor = bucket.buffer()
    n = state.size
    avg = state.op == dist.ReduceOp.AVG
    first = not avg and tensor.dtype in _NARROW
    if first:
        tensor.div_(n)
    tracer = state.tracer
    if tracer is not None and tracer._wrappers:
        work, box = tracer.issue_async("all_reduce", tensor, op=state.op, group=state.group)
    else:
        work, box = dist.all_reduce(tensor, op=state.op, group=state.group, async_op=True), None
    hb = tracer.hb if box is not None else None
    after = not avg and not first and n > 1

    def done(fut):
        try:
            out = fut.value()[0]
        except BaseException:
            if hb is not None:
                hb.completed(box, True)
            raise
        if hb is not None:
            hb.completed(box)
        if after:
            out.div_(n)
        return out

    return work.get_future().then(done)


def _narrow():
    import torch

    return frozenset(
        t
        for t in (torch.float16, getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
        if t is not None
    )


_NARROW: frozenset = frozenset()  # fp16 and fp8: divided before the sum (filled at the first attach)


def kind_of(model) -> str:
    """What the observer does with `model` by default (no hook): "counted" (a DDP module: its all-reduces are
    counted natively), "fsdp2" (DTensor parameters: traced and counted), "not_ddp"."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "counted"
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "fsdp2"
    return "not_ddp"


def attach(model, hook=None, state=None, tracer=None) -> str:
    """Registers a comm hook on a DDP module (the opt-in: `ddp_comm_hook="traced"` gives `hook` None, ours; or
    the user's `hook`). Returns what was done: "registered" (ours, or the
    given `hook`), "user_hook" (a Python hook was already there: kept, seen through torch.distributed),
    "builtin_hook" (a C++ hook holds the reducer: its collectives are counted, not traced), "fsdp2" or "not_ddp"
    (nothing to do)."""
    global _NARROW
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in model.parameters()):
            return "fsdp2"
        return "not_ddp"
    if getattr(model, "_comm_hooks", None):
        if hook is not None:
            log.warning(
                "observer: the DDP module already has a comm hook; the one given to the observer is "
                "not registered (torch allows one)"
            )
        return "user_hook"
    if hook is None:
        _NARROW = _NARROW or _narrow()
        hook, state = observed_allreduce_hook, HookState(model.process_group, tracer)
    try:
        model.register_comm_hook(state, hook)
    except RuntimeError as e:  # the reducer already holds a built-in (C++) hook
        log.warning(
            "observer: cannot register a comm hook on the DDP module (%s); its gradient all-reduces "
            "are counted, not traced (no fingerprints per bucket)",
            e,
        )
        return "builtin_hook"
    return "registered"
