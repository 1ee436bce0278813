"""How captures travel from the source peer to the others: host tensors, one pickle per capture for its structure
(all of them in one broadcast_object_list), and every tensor in them as its own asynchronous byte broadcast over
the replay's gloo group: every object's tensors as one asynchronous byte broadcast of their own; and over which
ranks (`peer_group`: the peers a replay compares).

Why asynchronous, one object at a time: a sweep sends every target's block inputs and output gradients. Sent as
one blocking buffer, every peer waited for all of it before replaying the first target, and the receivers copied
each tensor out of it again. Now a peer replays target i as soon as target i's buffer has arrived, while gloo's
threads deliver the rest (`Arrivals.get`), and the receivers' tensors are aligned views of that buffer (no copy).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist


def host(obj: Any) -> Any:
    """Captures travel over gloo: host tensors."""
    return None if obj is None else obj.to("cpu")


class Arrivals:
    """The source's objects on every peer, each available (`get(i)`) once its own tensors have arrived.

    `present(i)`: did the source send an object at i (not None)? Known at once, before any tensor arrives.
    `wait_all()`: wait for every broadcast still in flight (idempotent); callers do before their next collective,
    so that a peer which skips an object (its replay failed) still completes every receive."""

    def __init__(self, objs: list | None, heads: list, works: list, bufs: list) -> None:
        self._objs = objs  # the source's own objects (None on the receivers)
        self._heads = heads  # per object: None, or (pickle bytes, [(dtype, shape, nbytes)])
        self._works = works  # per object: its pending broadcasts
        self._bufs = bufs  # per object: the receive buffers (uint8), in pickle order
        self._done: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self._heads)

    def present(self, i: int) -> bool:
        return self._heads[i] is not None

    def get(self, i: int) -> Any:
        """Object i (None when the source sent none), waiting for its tensors only."""
        if self._heads[i] is None:
            return None
        for w in self._works[i]:
            w.wait()
        self._works[i] = []
        if self._objs is not None:
            return self._objs[i]
        if i not in self._done:
            self._done[i] = unpickled(self._heads[i], self._bufs[i])
        return self._done[i]

    def wait_all(self) -> None:
        for i, works in enumerate(self._works):
            for w in works:
                w.wait()
            self._works[i] = []


def unpickled(head: tuple, bufs: list[torch.Tensor]) -> Any:
    """An object sent as `_pickled` framed it: its structure (`head`: pickle bytes and per tensor its dtype,
    shape and size) over the tensors' received bytes (`bufs`), which become aligned views, not copies."""
    data, metas = head
    views = [
        b.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
        for b, (dtype, shape, nbytes) in zip(bufs, metas)
    ]

    class _In(pickle.Unpickler):
        def persistent_load(self, pid):
            return views[pid]

    return _In(io.BytesIO(data)).load()


def _pickled(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """`obj` pickled with its plain tensors left out (persistent ids into the returned list)."""
    tensors: list[torch.Tensor] = []

    class _Out(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, torch.Tensor) and type(o) is torch.Tensor:
                tensors.append(o.detach().contiguous())
                return len(tensors) - 1
            return None

    buf = io.BytesIO()
    _Out(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue(), tensors


_ALIGN = 64  # every tensor starts at a multiple of this in its object's buffer: a view of any dtype, no copy


def _layout(metas: list) -> tuple[list[tuple[int, int]], int]:
    """(offset, nbytes) of each tensor in its object's buffer, and the buffer's size."""
    spans, at = [], 0
    for _, _, nbytes in metas:
        spans.append((at, nbytes))
        at += -(-nbytes // _ALIGN) * _ALIGN
    return spans, at


def broadcast_each(objs: list | None, src: int, group) -> Arrivals:
    """Send the source's list of objects (None entries allowed) to every peer: one broadcast_object_list of their
    structures, then each object's tensors as one asynchronous broadcast of their bytes, in list order (the same
    order on every peer). `objs` is read on the source only. Returns at once, before the tensors arrive."""
    me = dist.get_rank()
    heads: list = []
    sent: list[list[torch.Tensor]] = []
    if me == src:
        for obj in objs:
            if obj is None:
                heads.append(None)
                sent.append([])
                continue
            data, tensors = _pickled(obj)
            heads.append((data, [(t.dtype, tuple(t.shape), t.numel() * t.element_size()) for t in tensors]))
            sent.append(tensors)
    box = [heads]
    dist.broadcast_object_list(box, src=src, group=group)
    heads = box[0]
    works: list[list] = []
    bufs: list[list[torch.Tensor]] = []
    for i, head in enumerate(heads):
        metas = head[1] if head is not None else []
        spans, total = _layout(metas)
        if me == src:
            # one buffer per object: an optimizer capture is hundreds of small windows (one broadcast each was
            # hundreds of collectives); a block's capture is a few tensors, so the copy costs little
            flat = torch.empty(total, dtype=torch.uint8)
            for t, (at, n) in zip(sent[i], spans):
                if n:
                    flat[at : at + n].copy_(t.reshape(-1).view(torch.uint8))
        else:
            flat = torch.empty(total, dtype=torch.uint8)
        works.append([dist.broadcast(flat, src=src, group=group, async_op=True)] if total else [])
        bufs.append([flat[at : at + n] for at, n in spans])
    return Arrivals(objs if me == src else None, heads, works, bufs)


def broadcast_payload(obj: Any, src: int, group) -> Any:
    """One object from `src` to every peer (broadcast_each of one, waited for)."""
    return broadcast_each([obj], src, group).get(0)


def peer_group(groups, peers: str) -> tuple[Any, list[int]]:
    """The replica group when it can attribute on its own (3+ members, or peers="replicas"), else the world: a
    gloo group of replay's own over those ranks, and its members.

    Module targets replay full (unsharded) parameters and the optimizer recipe replays a broadcast slice, so any
    set of ranks is a valid peer set; the world is used where the replica group is missing (FSDP) or too small to
    name a culprit (HSDP with 2 replicas).

    Why groups of its own: save-time consensus exchanges on the consensus groups from a background thread (during
    a sync save's write, after a refused save, in an async save's commit thread), while replay's collectives run
    on the training thread (the sweep, the rotation in `step()`). Two threads' collectives on one gloo group
    interleave differently on different ranks ("Received data size doesn't match expected size"); on groups of
    their own they cannot. Collective over the world (new_group), in the same order on every rank."""
    import datetime

    if peers not in ("auto", "replicas", "world"):
        raise ValueError(f"peers must be auto, replicas or world, got {peers!r}")
    timeout = datetime.timedelta(seconds=groups.timeout_s)
    mine = list(groups.group_ranks)
    # the same decision on every rank: the replica groups partition the grid, so all have this one's size
    if groups.group is not None and len(mine) > 1 and (peers == "replicas" or (peers == "auto" and len(mine) >= 3)):
        handle = None
        for ranks in groups.groups:  # every replica group, created by every rank in the same order
            if len(ranks) < 2:
                continue
            pg = dist.new_group(ranks=list(ranks), backend="gloo", timeout=timeout)
            if groups.rank in ranks:
                handle = pg
        return handle, mine
    everyone = list(range(groups.world_size))
    return dist.new_group(ranks=everyone, backend="gloo", timeout=timeout), everyone


__all__ = ["Arrivals", "broadcast_each", "broadcast_payload", "host", "peer_group"]
