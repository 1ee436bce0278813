"""State dicts as flat {dotted key: leaf} maps: what consensus and the full signatures compare, key by key.

Tensors stay tensors; every other leaf becomes its canonical bytes (canonical.py: a set's order, a dict's
insertion order and a process's hash seed make no difference), or a `NotComparable` where a value has none
(canonical.py says which): consensus and the load signatures leave those out, with the reason recorded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from scout_ckpt.consensus.canonical import NotComparable, NotComparableError, comparable_leaf, leaf_bytes  # noqa: F401
from scout_ckpt.consensus.mesh import is_dtensor


def _is_stateful(obj: Any) -> bool:
    """DCP's Stateful protocol (state_dict + load_state_dict), checked by duck typing as its runtime_checkable
    isinstance does, without importing torch.distributed.checkpoint."""
    return (
        not isinstance(obj, (torch.Tensor, Mapping, type))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


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
        leaf = comparable_leaf(obj)
    if key in out:
        raise ValueError(f"two leaves of the state flatten to the same key {key!r}")
    out[key] = leaf


def flatten_state(state_dict: Mapping, *, keep_dtensor: bool = False) -> dict[str, Any]:
    """{dotted key: leaf}: nested dicts/lists/tuples become dotted keys, Stateful objects (modules, optimizers, DCP
    AppState wrappers) their state_dict(), DTensors their local tensor (or the DTensor with keep_dtensor), and
    non-tensor leaves their canonical bytes (`leaf_bytes`), so scalars such as the step and learning rate are
    compared too, or a `NotComparable` where a value has no canonical encoding. Insertion order follows the state
    dict."""
    out: dict[str, Any] = {}
    _walk(state_dict, "", out, keep_dtensor)
    return out


def holds_dtensor(state_dict: Mapping) -> bool:
    """Whether any leaf of the state is a DTensor."""
    return any(is_dtensor(v) for v in flatten_state(state_dict, keep_dtensor=True).values())
