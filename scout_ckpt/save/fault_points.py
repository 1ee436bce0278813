"""The fault points of a save and a load, where tests, benches and the demo inject faults (a SIGKILL inside the
write, a flipped bit before the rename, a slow commit): before_write, during_write, after_write, before_rename,
after_rename, retention (coordinator), after_commit, after_load.

Not an option of the Checkpointer: a production job has no fault hook. `scout_ckpt.testing.fault_points(hook)`
sets one for the Checkpointers made inside it (each keeps the hook it was made with)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Callable

FaultHook = Callable[[str, int], None]

_current: FaultHook | None = None


def current() -> FaultHook | None:
    """The hook a Checkpointer made now takes (None outside `scout_ckpt.testing.fault_points`)."""
    return _current


@contextlib.contextmanager
def using(hook: FaultHook | None) -> Iterator[None]:
    """Checkpointers made inside take `hook` (scout_ckpt.testing.fault_points; a drop-in that makes its
    Checkpointer later, at the framework's setup, keeps `current()` from its own construction and makes it here)."""
    global _current
    previous, _current = _current, hook
    try:
        yield
    finally:
        _current = previous
