"""Make a real job's gradient collectives visible to the collective tracer (`Observer.attach(model)`).

Why a comm hook for DDP: DistributedDataParallel's reducer all-reduces its gradient buckets in C++, which no
Python patch sees, so a hang or a desync inside backward left every rank's sequence number where it was. A
registered Python comm hook is called by the reducer for every bucket; the default one registered here is
torch's reference `allreduce_hook` (divide by the group size, then an async SUM all-reduce), which calls
`torch.distributed.all_reduce` and so goes through the tracer: every bucket gets a sequence number and a
fingerprint (the bucket's shape and dtype), and its wait lasts until the all-reduce completes. The averaged
gradients are the same up to rounding (the built-in reducer multiplies by 1/world size as it copies into the
bucket; the hook divides the bucket).

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

Cost: the reference hook divides the bucket in a pass of its own (the built-in reducer folds the division into
its copy into the bucket) and runs a Python callback per bucket. Measured with tests/scripts/observer_overhead.py
on a 1M-parameter CPU model (11 ms of CPU per step): about 1 ms per step, so it matters only where a step is
that short; on an accelerator the division is one elementwise kernel over the gradients.

FSDP2 (`fully_shard`) needs nothing: torch 2.13 issues its all-gathers and reduce-scatters as Python calls to
`dist.all_gather_single` / `dist.reduce_scatter_single`, which the tracer wraps.
"""

from __future__ import annotations

import logging

log = logging.getLogger("scout_ckpt.observer")


def attach(model, hook=None, state=None) -> str:
    """Registers the tracing comm hook on a DDP module. Returns what was done: "registered" (ours, or the
    given `hook`), "user_hook" (a Python hook was already there: kept, seen through torch.distributed),
    "builtin_hook" (a C++ hook holds the reducer: its collectives are not seen), "fsdp2" or "not_ddp"
    (nothing to do)."""
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
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        hook, state = allreduce_hook, model.process_group
    try:
        model.register_comm_hook(state, hook)
    except RuntimeError as e:  # the reducer already holds a built-in (C++) hook
        log.warning("observer: cannot register a comm hook on the DDP module (%s); its gradient all-reduces "
                    "are not seen, so hangs and desyncs inside backward are seen only as stalls", e)
        return "builtin_hook"
    return "registered"
