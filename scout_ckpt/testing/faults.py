"""Fault injection for tests, benches and the demo: `with fault_points(hook): ckpt = Checkpointer(...)` calls
`hook(point, step)` at each of the Checkpointer's fault points (scout_ckpt/save/fault_points.py names them), for
the life of that Checkpointer. Not part of a production job's API."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from scout_ckpt.save import fault_points as _points
from scout_ckpt.save.fault_points import FaultHook


@contextlib.contextmanager
def fault_points(hook: FaultHook | None) -> Iterator[None]:
    """Checkpointers (and the integrations' drop-ins that make one) created inside take `hook`.

    Args:
        hook: called as hook(point, step) at before_write, during_write, after_write, before_rename,
            after_rename, retention, after_commit and after_load; None: no hook.
    """
    with _points.using(hook):
        yield


__all__ = ["FaultHook", "fault_points"]
