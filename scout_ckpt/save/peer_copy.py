"""Moving a rank's local-tier file between nodes over the Checkpointer's gloo group.

Why over the group rather than a file copy: the group reaches every node whatever its filesystems are, and on one
host (the tests) it costs one memcpy more than a copy would. Each rank's node is `rank // local_world_size`
(torchrun numbers ranks node by node); the copies of rank R go to the same local rank on the next `replicas`
nodes of the ring of node ranks, so losing any one node leaves every rank's file on another node.

Every function here is collective over `group`: each rank makes the same sends and receives in the same order,
computed from values every rank holds (the ring, or an all_gathered table), so nothing can deadlock.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def ring_holders(rank: int, world: int, local_world: int, replicas: int) -> list[int]:
    """The ranks that hold copies of `rank`'s file: the same local rank on the next `replicas` nodes (capped at
    nodes - 1)."""
    nodes = max(1, world // local_world)
    return [(rank + j * local_world) % world for j in range(1, min(replicas, nodes - 1) + 1)]


def _send(blob: bytes, dst: int, group) -> None:
    dist.send(torch.tensor([len(blob)], dtype=torch.int64), dst=dst, group=group)
    if blob:
        dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst=dst, group=group)


def _recv(src: int, group) -> bytes:
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src=src, group=group)
    if int(n[0]) == 0:
        return b""
    buf = torch.empty(int(n[0]), dtype=torch.uint8)
    dist.recv(buf, src=src, group=group)
    return buf.numpy().tobytes()


def ring_exchange(blob: bytes, rank: int, world: int, local_world: int, replicas: int, group) -> dict[int, bytes]:
    """Send this rank's `blob` to its holders and receive the blobs this rank holds: {owner rank: bytes}.
    Round j: every rank sends to rank + j*L and receives from rank - j*L, sizes first, both posted before either
    is waited on (isend/irecv), so no order of ranks can deadlock."""
    got: dict[int, bytes] = {}
    nodes = max(1, world // local_world)
    payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    for j in range(1, min(replicas, nodes - 1) + 1):
        dst, src = (rank + j * local_world) % world, (rank - j * local_world) % world
        n_out, n_in = torch.tensor([len(blob)], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        works = [dist.isend(n_out, dst=dst, group=group), dist.irecv(n_in, src=src, group=group)]
        for w in works:
            w.wait()
        buf = torch.empty(int(n_in[0]), dtype=torch.uint8)
        works = ([dist.isend(payload, dst=dst, group=group)] if len(blob) else []) + (
            [dist.irecv(buf, src=src, group=group)] if buf.numel() else []
        )
        for w in works:
            w.wait()
        got[src] = buf.numpy().tobytes()
    return got


def fetch(rank: int, plan: list[tuple[int, int]], blobs: dict[int, bytes], group) -> bytes | None:
    """Collective: carry out `plan`, [(owner, holder)] in the same order on every rank: the holder sends the
    owner's file (from `blobs`, {owner: bytes} that this rank holds), the owner receives it. Returns what this
    rank received for itself (None if it was not an owner in the plan)."""
    mine = None
    for owner, holder in plan:
        if rank == holder:
            _send(blobs[owner], owner, group)
        elif rank == owner:
            mine = _recv(holder, group)
    return mine
