"""Python's automatic garbage collection held off while save() blocks training.

Why: a save allocates tens of thousands of short-lived container objects (DCP's plans and write items, the
consensus rows, the replay sweep's tensors and messages, the ledger rows). Each 700 net allocations trigger a
young collection, each 10 of those an older one, and every 10 of those may trigger a full (generation 2)
collection, which walks every tracked object of the process: about 300,000 in a small training job, 100-140 ms
on this project's 2-core test host (docs/benchmarks.md, "Save cost"). A full collection inside a save stops
every thread of the rank (the write, the consensus hashing and the replay sweep hold the GIL by turns), and the
other ranks wait for it at the save's next collective. With collection held off, the save's allocations cost no
collection while it runs; when it ends, the next allocation of the training step triggers one young collection of
whatever the save left alive (the objects still referenced; what reference counting freed is gone already), and
the older generations' counters have not moved, so the save no longer advances the process towards a full
collection.

Safe because a save is bounded: the cyclic garbage it leaves (if any) is collected at the next collection, after
save() returns. Held only on the training thread's blocking part of save() (an async save's commit thread runs
beside training and never holds it), re-entrant, and never enables collection that the application itself had
disabled. Exceptions restore the previous setting.
"""

from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0
_restore = False  # whether the outermost hold found collection enabled


@contextlib.contextmanager
def collection_held():
    """Automatic collection off for the block; back on afterwards if it was on when the outermost hold began."""
    global _depth, _restore
    with _lock:
        if _depth == 0:
            _restore = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _restore:
                gc.enable()
