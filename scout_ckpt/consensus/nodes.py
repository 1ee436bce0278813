"""A job's nodes as torchrun lays them out, and the point-to-point links their aggregators use.

A node is what torchrun calls one: LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, and global ranks contiguous per node
(torchrun assigns them so). Its aggregator is its local rank 0. Without these variables, on a single node, or with
values that do not describe a node of this job, `plan` gives None and callers keep their flat collectives.

The links are point-to-point messages on a gloo group the caller owns (a length, then the pickled payload, as
gather_object pickles), so no process group is created for them: a save's commit thread or consensus's hashing
thread could not create one safely. Both the commit's per-node gather (save/node_manifest.py) and consensus's
per-node exchange (consensus/node_exchange.py) use them, each on its own group.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Any, Mapping

COORDINATOR = 0
LEN_TAG, DATA_TAG = 4101, 4102


@dataclass(frozen=True)
class NodePlan:
    """This rank's node: its number (GROUP_RANK), its aggregator (local rank 0) and its ranks."""

    node: int
    leader: int
    members: tuple[int, ...]
    world: int


def plan(rank: int, world: int, env: Mapping[str, str] | None = None) -> NodePlan | None:
    """The node of `rank` from torchrun's environment, or None where the flat collectives apply (no torchrun, a
    single node, or values that do not describe a node of this job)."""
    env = os.environ if env is None else env
    try:
        local, size, node = (int(env[k]) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"))
    except (KeyError, ValueError):
        return None
    if not (0 <= local < size < world) or node < 0 or rank - local < 0:
        return None
    leader = rank - local
    return NodePlan(node=node, leader=leader, members=tuple(range(leader, min(leader + size, world))), world=world)


def wire(obj) -> bytes:
    """The bytes one message carries (pickled, as gather_object pickles)."""
    return pickle.dumps(obj)


def send(obj, dst: int, group, tag: int = LEN_TAG) -> None:
    """Send `obj` to global rank `dst` on `group`: its length (tag), then its pickle (tag + 1)."""
    import torch
    import torch.distributed as dist

    data = wire(obj)
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst, group=group, tag=tag)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst, group=group, tag=tag + 1)


def recv(src: int | None, group, tag: int = LEN_TAG) -> tuple[Any, int]:
    """(object, sender's global rank) of the next message from `src` (None: from any rank) on `group`."""
    import torch
    import torch.distributed as dist

    n = torch.zeros(1, dtype=torch.int64)
    sender = dist.recv(n, src=src, group=group, tag=tag)
    buf = torch.empty(int(n[0]), dtype=torch.uint8)
    dist.recv(buf, src=sender, group=group, tag=tag + 1)
    return pickle.loads(buf.numpy().tobytes()), sender  # this job's own ranks, trusted as gather_object trusts them
