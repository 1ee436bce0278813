"""Step stamps: when this rank left a step's synchronisation and when it reached the next one, taken by hooks, so
that a straggler is named by its compute, not by sampling noise.

Why: DDP's all-reduces are issued in C++, and the sampled count (observer/counts.py) says when this rank issued
its first collective of a step only to within a sampling period (40 ms at 25 Hz) plus a wait for the GIL: a 3x
straggler of a 50 ms step stood out in 2 of 3 runs, 2x never. A rank's compute is the time from the moment
every rank leaves a synchronisation together to the moment it has done its own work and can only wait; the fast
ranks then wait for the slow one inside the collective, where nobody can tell waiting from computing, but the
compute before it is exact:

  left     the optimizer's step pre-hook (`Optimizer.register_step_pre_hook`): backward has returned, so DDP's
           reducer has finished its all-reduces and FSDP2 its reduce-scatters, and every rank passes this point
           together. Without an optimizer, the step boundary (`Observer.step`) stands in, later by the optimizer
           step and whatever the script does before it calls step().
  arrived  the first of: a traced collective on a watched group (the tracer calls `Heartbeat.enter` with its
           position; exact: FSDP2's first all-gather, a user's Python all_reduce); when the forward itself
           issued a native collective (DDP's buffer broadcast, where every rank meets at the forward's start),
           the forward's start; else (DDP: the gradient all-reduces are issued in backward, asynchronously, and
           waited for only at backward's end) the end of this rank's own backward: the last gradient
           accumulated into a parameter (`Tensor.register_post_accumulate_grad_hook`), read at the next `left`.
           So a rank's extra time anywhere from the optimizer step to its last gradient (data loading, a slow
           layer in forward or in backward, host work after the step) is in its compute, and the fast ranks'
           wait for it is not. Without gradient hooks (no parameter fired one: frozen, or sharded by FSDP2) the
           forward's end stands in. When a native collective came before the forward (nothing to time it by),
           the step gets no stamp. A synchronous traced collective (a Python all_reduce or gather, done on
           return: a logged loss after the optimizer step) is an arrival that every rank leaves together, like
           the optimizer step: the compute goes on from its return to the next arrival, the segments added into
           the step's one stamp (heartbeat `_settle`), its wait left out.

Both on one clock per rank (no cross-host skew); each rank's stamps go into its heartbeat (a ring per step) and
the judge compares the ranks' median compute over windows (observer/stragglers.py, `ComputeStragglers`). With
each pair of stamps goes the training thread's run-queue delay between them (observer/cpuwait.py, read at both
stamps), which the judge subtracts: on a loaded host the scheduler serves the ranks unevenly, and a healthy
rank's wait for a core is not its compute.
A rank that is waiting between the two stamps is counted as computing: a collective on a side group (the
checkpointer's save) synchronises the ranks again, so on a save step every rank's compute includes the save and
the coordinator's extra work; medians over windows of several steps are what keep that from flagging anyone.

Cost: two forward hooks, one optimizer hook and, after the first step, gradient hooks on the `KEEP_GRAD_HOOKS`
parameters whose gradients came last (the first step hooks every parameter to learn which), a few microseconds
each per step, each with one read of the run-queue delay (a pread, about 2 us) (bench/observer_overhead.py reports `stamp_hooks_us`). Gradient hooks may run on autograd's
device threads: they only store a time; only the heartbeat's writer thread stamps. Hooks are removed by `remove`
(close). On GPUs the times are the host's (kernel launches), as every stamp here.
"""

from __future__ import annotations

import threading
import time

KEEP_GRAD_HOOKS = 4


class StepStamps:
    """Registers the hooks on `model` (forward pre and post, parameters' gradient accumulation) and `optimizer`
    (step pre), which stamp the heartbeat `hb`; `counter` (observer/counts.py) tells whether a native collective
    was issued in between."""

    def __init__(self, hb, counter, model=None, optimizer=None):
        self.hb, self.counter = hb, counter
        self._owner = hb.owner
        self._pre: tuple[float, int, float] | None = None
        self._fwd_end: tuple[float, float] | None = None  # the forward ended with nothing issued since `left`:
        # arrival pending; (time, run-queue wait then)
        self._handles: list = []
        self._grad_t: list[tuple[float, float]] = []  # per hooked parameter: (when its gradient was last
        self._wait = hb.cpu_wait  # accumulated, the run-queue wait then)
        self._grad_handles: dict[int, object] = {}
        self._learned = False
        hb.count_fn = self._count  # a synchronous traced collective starts a new segment of the step there
        if model is not None:
            self._handles.append(model.register_forward_pre_hook(self._forward_pre, prepend=True))
            self._handles.append(model.register_forward_hook(self._forward_post))
            self._hook_grads(model)
        hooked = False
        # a wrapper that never ran Optimizer.__init__ (accelerate's AcceleratedOptimizer) has no hook registry:
        # the torch optimizer it wraps (`.optimizer`), whose step it calls, gets the hook
        for opt in (optimizer, getattr(optimizer, "optimizer", None)):
            try:
                self._handles.append(opt.register_step_pre_hook(self._optimizer_pre))
                hooked = True
                break
            except (AttributeError, TypeError):
                continue
        self.on_boundary = not hooked  # no optimizer: the step boundary is where the rank left the sync

    def _hook_grads(self, model) -> None:
        try:
            params = [p for p in model.parameters() if p.requires_grad]
        except Exception:
            return
        for p in params:
            i = len(self._grad_t)
            self._grad_t.append((0.0, 0.0))
            try:
                self._grad_handles[i] = p.register_post_accumulate_grad_hook(self._grad_hook(i))
            except (AttributeError, RuntimeError):
                self._grad_t.pop()
                break

    def _grad_hook(self, i: int):
        times, wait = self._grad_t, self._wait

        def hook(_param) -> None:
            times[i] = (time.time(), wait.seconds())

        return hook

    def _last_grad(self, since: float) -> tuple[float, float] | None:
        """(the end of this rank's own backward since `since`, the run-queue wait then), or None (no gradient
        hook fired). After the first step that saw gradients, only the KEEP_GRAD_HOOKS parameters whose
        gradients came last stay hooked."""
        if not self._grad_t:
            return None
        fired = [(t, i) for i, (t, _w) in enumerate(self._grad_t) if t > since]
        if not fired:
            return None
        if not self._learned:
            self._learned = True
            keep = {i for _t, i in sorted(fired)[-KEEP_GRAD_HOOKS:]}
            for i, h in list(self._grad_handles.items()):
                if i not in keep:
                    h.remove()
                    del self._grad_handles[i]
        return self._grad_t[max(fired)[1]]

    def _count(self) -> int:
        try:
            return self.counter.count()
        except RuntimeError:  # a group destroyed meanwhile
            return -1

    def leave(self) -> None:
        """This rank leaves a synchronisation now. A pending arrival (the forward ended with nothing issued) is
        stamped first, at the end of this rank's backward where gradient hooks saw it; then the first call after
        an arrival sets `left`."""
        hb = self.hb
        if threading.get_ident() != self._owner:
            return
        fwd_end, self._fwd_end = self._fwd_end, None
        if hb.left is not None and fwd_end is not None:
            t, waited = self._last_grad(fwd_end[0]) or fwd_end
            if t < hb.left[0]:  # its own work ended before a synchronous collective it left since (heartbeat
                t, waited = hb.left[0], hb.left[2]  # `_settle`): nothing more to add to the step
            hb.stamp(hb.left[0], t, waited - hb.left[2])
        if hb.left is None:
            hb.left = (time.time(), self._count(), self._wait.seconds())
            self._pre = None

    def _optimizer_pre(self, optimizer, args, kwargs) -> None:
        self.leave()

    def _forward_pre(self, module, args) -> None:
        if self.hb.left is not None and threading.get_ident() == self._owner:
            self._pre = (time.time(), self._count(), self._wait.seconds())

    def _forward_post(self, module, args, output) -> None:
        hb = self.hb
        left = hb.left
        if left is None or threading.get_ident() != self._owner:
            return
        now = time.time()
        pre, self._pre = self._pre, None
        if self._count() == left[1]:
            if self._fwd_end is None:  # nothing issued yet: the first collective comes in backward
                self._fwd_end = (now, self._wait.seconds())  # (several forwards before a step: the first)
        elif pre is not None and pre[1] == left[1]:
            self._fwd_end = None
            hb.stamp(left[0], pre[0], pre[2] - left[2])  # the forward issued it (DDP's buffer broadcast): its start
        else:
            self._fwd_end = None
            hb.left = None  # a native collective before the forward: no stamp this step
            hb.discard()

    def remove(self) -> None:
        for h in self._handles + list(self._grad_handles.values()):
            h.remove()
        self._handles, self._grad_handles = [], {}
        self.hb.left, self.hb.count_fn = None, None
        self._fwd_end = None
