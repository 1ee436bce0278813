"""Make a real job's gradient collectives visible to the collective tracer (`Observer.attach(model)`).

Why a comm hook for DDP: DistributedDataParallel's reducer all-reduces its gradient buckets in C++, which no
Python patch sees, so a hang or a desync inside backward left every rank's sequence number where it was. A
registered Python comm hook is called by the reducer for every bucket; the default one registered here
(`observed_allreduce_hook`) issues each bucket's async all-reduce through the tracer: every bucket gets a sequence
number and a fingerprint (the bucket's shape and dtype), and this rank's wait for it lasts until it completes.
It averages like torch's reference `allreduce_hook`, at less cost (see Cost below). The averaged gradients are
the same up to rounding (the built-in reducer multiplies by 1/world size as it copies into the bucket).

The rule for a user's own DDP comm hook. torch lets a DDP module hold one hook, registered once (a second
registration raises "register_comm_hook or register_builtin_comm_hook can only be called once"), and the reducer
cannot be asked which hook it holds. So:
  - a Python hook registered before the Checkpointer is kept as it is (torch 2.13 lists Python hooks in
    `ddp._comm_hooks`); its collectives go through `torch.distributed.*` and are seen, nothing is registered;
  - a hook the user wants registered is given to the observer instead, which registers it in place of the
    default: `Checkpointer(..., observer={"ddp_comm_hook": hook, "ddp_comm_state": state})`;
  - a built-in C++ hook (`_register_builtin_comm_hook`, e.g. FP16_COMPRESS) cannot be seen: a warning says so;
  - registering a hook after the Checkpointer fails in torch itself: register it before, or give it as above;
  - `observer={"ddp_comm_hook": False}` registers nothing (DDP's all-reduces then stay unseen).

Cost. With a Python hook the reducer copies gradients into the bucket without scaling them (without one it
folds the 1/world size into that copy), so averaging takes a pass of its own over the bucket, and every bucket
runs a Python callback. Torch's reference hook divides before the all-reduce, on the training thread, and the
tracer added a second completion callback. This hook instead: uses ReduceOp.AVG where the backend averages as it
reduces (NCCL), so there is no pass at all; elsewhere (gloo) divides the reduced bucket inside the one completion
callback, on the backend's thread, off the training thread's critical path (fp16 and narrower are divided first,
as the reference does, so that the sum cannot overflow); and ends the rank's wait for the tracer in that same
callback. bench/observer_overhead.py measures it against DDP without a hook.

FSDP2 (`fully_shard`) needs nothing: torch 2.13 issues its all-gathers and reduce-scatters as Python calls to
`dist.all_gather_single` / `dist.reduce_scatter_single`, which the tracer wraps.
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

    return frozenset(t for t in (torch.float16, getattr(torch, "float8_e4m3fn", None),
                                 getattr(torch, "float8_e5m2", None)) if t is not None)


_NARROW: frozenset = frozenset()  # fp16 and fp8: divided before the sum (filled at the first attach)


def attach(model, hook=None, state=None, tracer=None) -> str:
    """Registers the tracing comm hook on a DDP module. Returns what was done: "registered" (ours, or the
    given `hook`), "user_hook" (a Python hook was already there: kept, seen through torch.distributed),
    "builtin_hook" (a C++ hook holds the reducer: its collectives are not seen), "fsdp2" or "not_ddp"
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
            log.warning("observer: the DDP module already has a comm hook; the one given to the observer is "
                        "not registered (torch allows one)")
        return "user_hook"
    if hook is None:
        _NARROW = _NARROW or _narrow()
        hook, state = observed_allreduce_hook, HookState(model.process_group, tracer)
    try:
        model.register_comm_hook(state, hook)
    except RuntimeError as e:  # the reducer already holds a built-in (C++) hook
        log.warning("observer: cannot register a comm hook on the DDP module (%s); its gradient all-reduces "
                    "are not seen, so hangs and desyncs inside backward are seen only as stalls", e)
        return "builtin_hook"
    return "registered"
