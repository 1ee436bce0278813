"""The run-queue wait the straggler rules subtract (observer/cpuwait.py), read from the kernel for real: a thread
that shares one CPU with a busy process waits for it, a sleeping one does not, and the waits fit in the wall time.

The oracle is the scheduler's own arithmetic, not the code under test: a thread is at any instant running, waiting
in the run queue, or asleep, never two at once, so over any stretch its CPU time (time.thread_time) plus its
run-queue wait never exceed the wall time that brackets both readings, and the time it sleeps is neither. Two
runnable processes pinned to one CPU share it, so the reader's thread waits at some point while it spins. No
duration is assumed: the test spins until the kernel has counted a wait, and bounds each reading by the wall time
it measured around it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from scout_ckpt.observer.cpuwait import RunQueueWait

pytestmark = pytest.mark.timing  # its outcome depends on timing: `make stress` runs it under load

SPINNER = "import os, sys; os.sched_setaffinity(0, {%d}); print('spinning', flush=True)\nwhile True: pass"
# The two clocks compared (the kernel's scheduler clock, CLOCK_MONOTONIC) may run at rates a hair apart.
CLOCK_RATE_SLACK = 1e-3


@pytest.fixture(autouse=True)
def schedstat():
    """Skipped on a kernel without per-thread schedstat, except under CI (CI=true, as .ci/run sets it), where the
    straggler rules' wait must be checked for real: there its absence fails, as tests/test_report.py does for
    chromium."""
    if RunQueueWait().available:
        return
    why = "no /proc/self/task/TID/schedstat here (a kernel built without CONFIG_SCHEDSTATS)"
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"CI must check the run-queue wait on a real kernel: {why}")
    pytest.skip(why)


def test_a_thread_sharing_its_cpu_waits_and_a_sleeping_one_does_not():
    cpu = sorted(os.sched_getaffinity(0))[0]
    spinner = subprocess.Popen([sys.executable, "-c", SPINNER % cpu], stdout=subprocess.PIPE, text=True)
    before = os.sched_getaffinity(0)
    try:
        assert spinner.stdout.readline().strip() == "spinning"  # pinned and running: no sleep stands for it
        os.sched_setaffinity(0, {cpu})
        wait = RunQueueWait()
        # the wall clock is read first and last, so it brackets the other two readings
        t0, w0, c0 = time.monotonic(), wait.seconds(), time.thread_time()
        deadline = t0 + 120.0  # only a broken reader gets here: the spinner shares the CPU from the start
        while wait.seconds() == w0 and time.monotonic() < deadline:
            pass
        w1, c1, t1 = wait.seconds(), time.thread_time(), time.monotonic()
    finally:
        os.sched_setaffinity(0, before)
        spinner.kill()
        spinner.wait()
    waited, ran, wall = w1 - w0, c1 - c0, t1 - t0
    assert waited > 0, (waited, ran, wall)
    assert ran + waited <= wall * (1 + CLOCK_RATE_SLACK), (waited, ran, wall)

    nap = 0.3
    t0, w0 = time.monotonic(), wait.seconds()
    time.sleep(nap)
    w1, t1 = wait.seconds(), time.monotonic()
    # asleep is not waiting for a CPU (the wake-up may be): the wait fits in what the nap left of the wall time
    assert w1 - w0 <= (t1 - t0 - nap) * (1 + CLOCK_RATE_SLACK) + CLOCK_RATE_SLACK * nap, (w1 - w0, t1 - t0)
    wait.close()
    assert wait.seconds() == 0.0
    assert not wait.available
