"""State dicts as flat {dotted key: leaf} maps: what consensus and the full signatures compare, key by key."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import torch

from scout_ckpt.consensus.mesh import is_dtensor

def _is_stateful(obj: Any) -> bool:
    """DCP's Stateful protocol (state_dict + load_state_dict), checked by duck typing as its runtime_checkable
    isinstance does, without importing torch.distributed.checkpoint."""
    return (not isinstance(obj, (torch.Tensor, Mapping, type)) and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")


def leaf_bytes(obj: Any) -> bytes:
    """Stable bytes of a non-tensor leaf, identical on every rank for equal values: the type's name, then JSON for
    scalars (floats keep their exact repr), the buffer of a numpy array, or the repr with object addresses removed
    for anything else."""
    typ = type(obj)
    head = f"{typ.__module__}.{typ.__qualname__}:".encode()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return head + json.dumps(obj).encode()
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return head + bytes(obj)
    if typ.__module__ == "numpy":
        import numpy as np

        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            return head + f"{arr.dtype.str}{arr.shape}:".encode() + arr.tobytes()
        if isinstance(obj, np.generic):
            return head + f"{obj.dtype.str}:".encode() + obj.tobytes()
    return head + _ADDR.sub("", repr(obj)).encode()


def _walk(obj: Any, key: str, out: dict, keep_dtensor: bool) -> None:
    if is_dtensor(obj):
        leaf = obj if keep_dtensor else obj.to_local()
    elif isinstance(obj, torch.Tensor):
        leaf = obj
    elif _is_stateful(obj):
        _walk(obj.state_dict(), key, out, keep_dtensor)
        return
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _walk(v, f"{key}.{k}" if key else str(k), out, keep_dtensor)
        return
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{key}.{i}" if key else str(i), out, keep_dtensor)
        return
    else:
        leaf = leaf_bytes(obj)
    if key in out:
        raise ValueError(f"two leaves of the state flatten to the same key {key!r}")
    out[key] = leaf


def flatten_state(state_dict: Mapping, *, keep_dtensor: bool = False) -> dict[str, Any]:
    """{dotted key: leaf}: nested dicts/lists/tuples become dotted keys, Stateful objects (modules, optimizers, DCP
    AppState wrappers) their state_dict(), DTensors their local tensor (or the DTensor with keep_dtensor), and
    non-tensor leaves stable bytes (`leaf_bytes`), so scalars such as the step and learning rate are compared too.
    Insertion order follows the state dict."""
    out: dict[str, Any] = {}
    _walk(state_dict, "", out, keep_dtensor)
    return out


def holds_dtensor(state_dict: Mapping) -> bool:
    """Whether any leaf of the state is a DTensor."""
    return any(is_dtensor(v) for v in flatten_state(state_dict, keep_dtensor=True).values())
