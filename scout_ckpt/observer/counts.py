"""Native collective counts: what every watched process group has issued, read from torch's own C++ counter.

Why: DistributedDataParallel's reducer all-reduces in C++, where no Python patch sees it, and a Python comm hook
that would make it visible costs more than the 1% per step the observer may take (any Python hook stops DDP
folding 1/world into its bucket copy: torch's own reference hook alone costs 8%). torch 2.13's
`ProcessGroup._get_sequence_number_for_group()` returns the backend's collective counter, which gloo
(`ProcessGroupGloo::allreduce` & co.: `++seq_` before `enqueue`) and NCCL (`seqCollective_`, bumped at the top
of `collective()`) increment on the calling thread when a collective is *issued*, not when it completes. So a
rank's count says how many collectives it has entered, whoever issued them (the reducer, FSDP2, DCP, the
user), and a rank stuck behind the others, or one that issued a collective the others did not, shows in the
counts alone.

How it is read: a daemon thread in the trainer (`CollectiveCounter`) samples the watched groups every
`1/hz` seconds (default 25 Hz) and, when the sum changed, writes it and the time into the heartbeat's native
area (its own seqlock, single writer). At a step boundary (`boundary`, called by `Observer.step`) the
training thread notes the count; the first count above it is that step's *arrival*: the time this rank issued
its first collective of the step, which the judge compares across ranks (stragglers by arrival skew) where a
job has no step stamps (observer/stamps.py: exact, taken by hooks on the training thread; the sampled arrival
is the fallback without a model and optimizer).

Safety and cost, measured and read in the source: the call is a plain read of a 64-bit counter (gloo: no lock;
an aligned load on x86-64, so another thread reads it whole), 0.6 us per group here; a thread blocked in a
collective's wait has released the GIL, so the sampler keeps reading while the trainer is stuck. Between samples
the thread sleeps (no GIL held); what a sample costs is mostly the wake-up itself: 60-100 us of CPU per wake-up
on this loaded 2-core machine (load average ~20), i.e. about 1.3% of a core at 100 Hz, 0.3% at the default
25 Hz (bench/observer_overhead.py reports it as `sampler_cpu_per_s`). Why 25 Hz: hang detection needs far less
(stall_s is seconds), and an arrival is at most one period late (40 ms at 25 Hz, plus the wait for the GIL, up
to the 5 ms switch interval, when the trainer computes in Python); the straggler rule takes the median over the
steps of a window, but that noise was enough to miss a 3x straggler of a 50 ms step in 1 of 3 runs, which is why
the step stamps replaced it where a model and optimizer are given.

Which groups: WORLD, the DDP module's `process_group`, and every group of an FSDP2 module's device meshes
(`attach`), never the checkpointer's side groups. The sum over a fixed set is a position in program order that
every SPMD rank shares, so the tracer also records, for each Python-level collective on a watched group, the
position it takes (`position`), which lets the judge tell a Python collective from a native one issued at the
same position on another rank (a desync). Limits: collectives issued on a watched group from a thread other
than the training thread count like any other; a backend without sequence numbers (MPI, UCC) is not watched
(a WARNING says so), and the observer then sees only Python-level collectives there.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("scout_ckpt.observer")


def _reader(group):
    """The group's counter as a bound method, or None when its backend has none."""
    try:
        fn = group._get_sequence_number_for_group
        fn()
        return fn
    except (AttributeError, RuntimeError) as e:
        log.warning(
            "observer: cannot read the collective count of a process group (%s); its native "
            "collectives are not counted",
            e,
        )
        return None


class CollectiveCounter:
    """Samples the watched groups' native collective counts into the heartbeat from a daemon thread."""

    def __init__(self, heartbeat, groups=(), *, hz: float = 25.0, ignore=()):
        self.hb = heartbeat
        self.period = 1.0 / hz if hz > 0 else 0.0
        self._ignored = {id(g) for g in ignore if g is not None}
        self._groups: list = []
        self._ids: set[int] = set()
        self._fns: tuple = ()
        self._boundary: tuple[int, int] | None = None  # (next step, count at the previous step's end)
        self._arrived: int | None = None
        self._last = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.cpu_s = 0.0  # CPU seconds the sampling threads used (counted when each stops)
        self.watch(*groups)

    # ---- which groups ------------------------------------------------------------------------------------

    def watch(self, *groups) -> list:
        """Adds groups (deduplicated; side groups refused). Call on every rank at the same program point (the
        sum must stay comparable across ranks). Returns the groups now watched."""
        fns = list(self._fns)
        for g in groups:
            if g is None or id(g) in self._ids or id(g) in self._ignored:
                continue
            fn = _reader(g)
            if fn is None:
                continue
            self._groups.append(g)
            self._ids.add(id(g))
            fns.append(fn)
        self._fns = tuple(fns)  # one reference store: the sampler sees the old or the new tuple, never half
        return list(self._groups)

    def ignore(self, *groups) -> None:
        """Side groups that `watch` must refuse from now on (a second Checkpointer's, sharing this process's
        observer)."""
        self._ignored.update(id(g) for g in groups if g is not None)

    def watches(self, group) -> bool:
        return id(group) in self._ids

    def count(self) -> int:
        return sum(f() for f in self._fns)

    def position(self, group) -> int:
        """The position the next collective on `group` takes among the watched groups' collectives (the count
        after it is issued), or 0 when `group` is not watched. `group` None is WORLD."""
        if group is None:
            import torch.distributed as dist

            group = dist.group.WORLD
        if id(group) not in self._ids:
            return 0
        return self.count() + 1

    # ---- the training thread --------------------------------------------------------------------------

    def boundary(self, step: int) -> None:
        """Step `step` is done: the next collective issued starts step + 1 (its arrival)."""
        try:
            self._boundary = (step + 1, self.count())
        except RuntimeError:  # the group is gone (destroy_process_group)
            pass

    # ---- the sampler ------------------------------------------------------------------------------------

    def sample(self) -> int:
        """One sample: publishes the count when it changed (any thread; the sampler's, or the trainer's own at
        an uncaught exception, when the sampler is about to stop)."""
        c = self.count()
        if c != self._last:
            now = time.time()
            self._last = c
            b = self._boundary
            if b is not None and c > b[1] and b[0] != self._arrived:
                self._arrived = b[0]
                self.hb.native(c, now, b[0])
            else:
                self.hb.native(c, now)
        return c

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                time.sleep(self.period)  # cheaper per wake-up than Event.wait (72 vs 100 us of CPU, loaded)
                if self._stop.is_set():
                    return
                try:
                    self.sample()
                except Exception:  # a group destroyed under us, the heartbeat closed: stop quietly
                    if self._stop.is_set():
                        return
                    time.sleep(self.period)
        finally:
            self.cpu_s += time.thread_time()  # this thread's own CPU since it started (what the sampling costs)

    def start(self) -> "CollectiveCounter":
        """Starts (or restarts, after `stop`) the sampling thread."""
        self.sample()
        self._stop.clear()
        if self.period > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="scout-observer-counts", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0 + self.period)
            self._thread = None


def model_groups(model) -> list:
    """The process groups a model's own collectives run on: a DDP module's `process_group`, the groups of
    every device mesh of its DTensor parameters (FSDP2, HSDP, TP)."""
    groups = []
    pg = getattr(model, "process_group", None)
    if pg is not None:
        groups.append(pg)
    meshes = {}
    try:
        from torch.distributed.tensor import DTensor

        for p in model.parameters():
            if isinstance(p, DTensor):
                meshes[id(p.device_mesh)] = p.device_mesh
    except ImportError:
        pass
    for mesh in meshes.values():
        try:
            groups.extend(mesh.get_all_groups())
        except Exception as e:  # a mesh without groups of its own
            log.warning("observer: cannot list the groups of a device mesh (%s)", e)
    return groups
