"""The run-queue wait the straggler rules subtract (observer/cpuwait.py), read from the kernel for real: a thread
that shares one CPU with a busy process waits for it, a sleeping one does not, and the waits fit in the wall time.

The oracle is the scheduler's own arithmetic, not the code under test: two runnable processes pinned to one CPU
each get part of it, so over a second of spinning the reader's thread waited a good part of that second (at least
a tenth, whatever else runs), and its CPU time (time.thread_time) plus its wait never exceed the wall time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from scout_ckpt.observer.cpuwait import RunQueueWait

pytestmark = pytest.mark.skipif(not RunQueueWait().available, reason="no /proc/self/task/TID/schedstat here")


def test_a_thread_sharing_its_cpu_waits_and_a_sleeping_one_does_not():
    cpu = sorted(os.sched_getaffinity(0))[0]
    spinner = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {%d})\nwhile True: pass" % cpu])
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})
        wait = RunQueueWait()
        time.sleep(0.3)                                # let the spinner start and take the CPU
        w0, c0, t0 = wait.seconds(), time.thread_time(), time.monotonic()
        while time.monotonic() - t0 < 1.0:
            pass
        w1, c1, t1 = wait.seconds(), time.thread_time(), time.monotonic()
    finally:
        os.sched_setaffinity(0, before)
        spinner.kill()
        spinner.wait()
    waited, ran, wall = w1 - w0, c1 - c0, t1 - t0
    assert waited > 0.1, (waited, ran, wall)
    assert ran + waited <= wall + 0.05, (waited, ran, wall)

    w0 = wait.seconds()
    time.sleep(0.3)
    assert wait.seconds() - w0 < 0.3                    # asleep is not waiting for a CPU (the wake-up may be)
    wait.close()
    assert wait.seconds() == 0.0 and not wait.available
