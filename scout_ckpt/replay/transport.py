"""How captures travel from the source peer to the others: host tensors, one pickle for the structure and one
flat byte buffer for every tensor in it (a broadcast over the replay's gloo group)."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist


def host(obj: Any) -> Any:
    """Captures travel over gloo: host tensors."""
    return None if obj is None else obj.to("cpu")


def broadcast_payload(obj: Any, src: int, group) -> Any:
    """broadcast_object_list, with the tensors sent as one flat byte buffer: pickling each tensor (torch.save
    per storage) cost more than the replay itself for a sweep of every target."""
    tensors: list[torch.Tensor] = []

    class _Out(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, torch.Tensor) and type(o) is torch.Tensor:
                tensors.append(o.detach().contiguous())
                return len(tensors) - 1
            return None

    head = None
    if dist.get_rank() == src:
        buf = io.BytesIO()
        _Out(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        head = (buf.getvalue(), [(t.dtype, tuple(t.shape), t.numel() * t.element_size()) for t in tensors])
    box = [head]
    dist.broadcast_object_list(box, src=src, group=group)
    data, metas = box[0]
    total = sum(m[2] for m in metas)
    if dist.get_rank() == src:
        flat = (torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors
                else torch.empty(0, dtype=torch.uint8))
    else:
        flat = torch.empty(total, dtype=torch.uint8)
    if total:
        dist.broadcast(flat, src=src, group=group)
    if dist.get_rank() == src:
        return obj
    views, at = [], 0
    for dtype, shape, nbytes in metas:
        views.append(flat[at:at + nbytes].view(dtype).reshape(shape).clone() if nbytes else
                     torch.empty(shape, dtype=dtype))
        at += nbytes

    class _In(pickle.Unpickler):
        def persistent_load(self, pid):
            return views[pid]

    return _In(io.BytesIO(data)).load()


__all__ = ["broadcast_payload", "host"]
