"""The out-of-band hang observer: heartbeat (training side), collective fingerprints, the observer process,
stragglers and hardware health.

Names are imported lazily (PEP 562): the observer process imports this package and must not pay for torch,
which only `CollectiveTracer` needs.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Heartbeat": "scout_ckpt.observer.heartbeat",
    "HeartbeatReader": "scout_ckpt.observer.heartbeat",
    "PHASES": "scout_ckpt.observer.heartbeat",
    "CollectiveTracer": "scout_ckpt.observer.fingerprints",
    "CollectiveCounter": "scout_ckpt.observer.counts",
    "Observer": "scout_ckpt.observer.handle",
    "attribute": "scout_ckpt.observer.verdicts",
    "channel_dir": "scout_ckpt.observer.handle",
    "StackDumper": "scout_ckpt.observer.stacks",
    "StragglerMonitor": "scout_ckpt.observer.stragglers",
    "ArrivalStragglers": "scout_ckpt.observer.stragglers",
    "ComputeStragglers": "scout_ckpt.observer.stragglers",
    "StepStamps": "scout_ckpt.observer.stamps",
    "NvmlHealthSource": "scout_ckpt.observer.health",
    "NullHealthSource": "scout_ckpt.observer.health",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'scout_ckpt.observer' has no attribute {name!r}")
