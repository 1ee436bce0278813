"""The fast tier's staging copy: the copy of each rank's state that a local save takes while training is held,
into buffers kept from one local save to the next.

Why reuse: `ckpt.step()` blocks for this copy, and a fresh `clone()` of every tensor at every local save pays for
allocating (and, on the host, page-faulting) a whole state's worth of memory each time, which is most of the
copy's cost on a large state. Here one buffer is allocated per tensor position in the state (its key path) and
re-allocated only when that tensor's shape, dtype, device or strides change; otherwise the save `copy_`s into it.
Positions that leave the state free their buffer.

Who else reads the buffers: only the tier's commit thread, which serializes them (and checks them finite) at the
start of its commit. The next local save joins that thread before it copies (LocalTier.save calls `wait()`
first), so a buffer is never overwritten while a commit reads it. A second set of buffers (double buffering) would
buy nothing: commits run one at a time on the tier's gloo group, so the next copy has to wait for the previous
commit anyway. The cost: the tier keeps one copy of the rank's state in memory between saves (on the tensors'
own device), where a fresh clone was freed after each commit.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


class StagingBuffers:
    """One Checkpointer's staging buffers, keyed by the tensor's path in the state."""

    def __init__(self):
        self._bufs: dict[tuple, torch.Tensor] = {}
        self.allocations = 0  # buffers allocated so far (a reused buffer is not counted again)

    def stage(self, tree):
        """A copy of `tree` (DTensors as their local shards, tensors detached) whose tensors are this object's
        buffers; containers are copied, other leaves shared. The copy stays valid until the next `stage`."""
        seen: set[tuple] = set()
        out = self._copy(tree, (), seen)
        for key in [k for k in self._bufs if k not in seen]:
            del self._bufs[key]
        return out

    def _copy(self, obj, path: tuple, seen: set):
        if isinstance(obj, DTensor):
            obj = obj.to_local()
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            if src.layout != torch.strided:  # sparse and other layouts: a fresh copy, as before
                return src.clone()
            buf = self._bufs.get(path)
            if (
                buf is None
                or buf.shape != src.shape
                or buf.dtype != src.dtype
                or buf.device != src.device
                or buf.stride() != src.stride()
            ):
                buf = torch.empty_like(src, memory_format=torch.preserve_format)
                self.allocations += 1
                self._bufs[path] = buf
            seen.add(path)
            with torch.no_grad():
                buf.copy_(src)
            return buf
        if isinstance(obj, dict):
            return {k: self._copy(v, path + (k,), seen) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, path + (i,), seen) for i, v in enumerate(obj))
        return obj
