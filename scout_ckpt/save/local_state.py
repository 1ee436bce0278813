"""What the fast tier saves of a rank's state, and how many ranks share a node: the rank's own tensors (DTensors
as their local shards), the names of its non-finite tensors, and torchrun's LOCAL_WORLD_SIZE. Apart from
local_tier.py so that the save's protocol reads on its own."""

from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor

from scout_ckpt.invariants.finite import can_be_nonfinite, is_finite


def local_tree(obj):
    """The state as this rank holds it: DTensors as their local shards, tensors detached, containers copied."""
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, dict):
        return {k: local_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local_tree(v) for v in obj)
    return obj


def nonfinite(obj, prefix: str = "") -> list[str]:
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        return [] if not can_be_nonfinite(obj.dtype) or is_finite(obj) else [prefix.rstrip(".")]
    if isinstance(obj, dict):
        return [n for k, v in obj.items() for n in nonfinite(v, f"{prefix}{k}.")]
    if isinstance(obj, (list, tuple)):
        return [n for i, v in enumerate(obj) for n in nonfinite(v, f"{prefix}{i}.")]
    return []


def local_world_size(world: int) -> int:
    """Ranks per node: torchrun's LOCAL_WORLD_SIZE (the same on every node), else the whole world on one node."""
    try:
        n = int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return world
    return n if n > 0 and world % n == 0 else world
