"""How long a thread has waited for a CPU: the run-queue delay the kernel accounts per thread.

Why: the straggler rules compare each rank's compute per step (observer/stragglers.py). On a loaded host a
runnable training thread waits in the run queue before it gets a core, and that wait falls unevenly on the
ranks: measured as wall time it reads as compute, and a healthy rank that the scheduler served less for a few
seconds looks 1.5x slower than its peer. A straggler's extra time is its own (a slow data loader that sleeps, a
slow layer that computes), not a wait for a CPU, so the rules subtract the run-queue delay from the wall time
between two stamps: what is left is time on a CPU or off it by the thread's own choice (sleeping, blocking).

Source: /proc/self/task/TID/schedstat (Linux with CONFIG_SCHED_INFO, every mainstream kernel): "time on CPU,
time waiting on a run queue, timeslices", nanoseconds, updated when the thread gets a CPU, so a reading taken by
the thread itself includes the wait it just came out of. One pread of an fd kept open: about 2 us of CPU. Where
the file cannot be read (another OS, a kernel without it) the delay reads 0.0 and the rules fall back to wall
time. A hypervisor's steal time is not in it (the guest's scheduler never sees it).
"""

from __future__ import annotations

import os
import threading


class RunQueueWait:
    """The run-queue delay of the thread that created it (the training thread), readable from any thread."""

    def __init__(self):
        self._fd = -1
        try:
            self._fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
            self.seconds()
        except (OSError, ValueError, IndexError, AttributeError):
            self.close()

    def seconds(self) -> float:
        """Total seconds the thread has waited for a CPU since it started; 0.0 where it cannot be read."""
        fd = self._fd
        if fd < 0:
            return 0.0
        try:
            return int(os.pread(fd, 64, 0).split()[1]) * 1e-9
        except (OSError, ValueError, IndexError):
            return 0.0

    @property
    def available(self) -> bool:
        return self._fd >= 0

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = -1
