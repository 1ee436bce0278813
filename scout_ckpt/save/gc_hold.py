"""Python's older-generation garbage collections held off while save() blocks training.

Why: a save allocates tens of thousands of container objects (DCP's plans and write items, the consensus rows,
the replay sweep's module copies and messages, the ledger rows). Every 700 net allocations trigger a young
(generation 0) collection, every 10 of those a generation-1 collection, and every 10 of those may trigger a full
(generation 2) collection, which walks every tracked object of the process: 100-300 ms in a small training job on
this project's 2-core test host (docs/benchmarks.md, "Save cost"). A full collection inside a save stops every
thread of the rank (the write, the consensus hashing and the replay sweep hold the GIL by turns), and the other
ranks wait for it at the save's next collective.

While the hold is on, the thresholds of generations 1 and 2 are raised out of reach: young collections go on as
before and free the cyclic garbage the save makes as it goes (a save's replays leave some, tensors included, so
turning collection off altogether would keep every replay's copies alive until the save ends), while the
collections that walk the older objects wait until the save is over, when the application's own thresholds are
back and decide as they would have.

Held only on the training thread's blocking part of save() (an async save's commit thread runs beside training
and never holds it), re-entrant, restored on every path (exceptions too), and a no-op where the application turned
automatic collection off.
"""

from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] | None = None  # the thresholds the outermost hold found (None: it changed nothing)
_OUT_OF_REACH = 1 << 30


@contextlib.contextmanager
def collection_held():
    """Generations 1 and 2 not collected automatically in the block; the previous thresholds back afterwards."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = None
            thresholds = gc.get_threshold()
            if gc.isenabled() and thresholds[0] > 0:
                _saved = thresholds
                gc.set_threshold(thresholds[0], _OUT_OF_REACH, _OUT_OF_REACH)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                gc.set_threshold(*_saved)
                _saved = None
