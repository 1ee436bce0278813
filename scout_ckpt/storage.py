"""DCP storage writer that knows which files this rank wrote, and where a save can be interrupted on purpose.

Each rank hashes only the files it wrote itself (never one rank re-reading everyone's bytes); DCP's write
results name them. The fault hook lets tests and the demo SIGKILL a rank in the middle of a file.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import WriteItemType

FaultHook = Callable[[str, int], None]


class _HookedFile(io.BufferedWriter):
    """A file whose first write is flushed half-way and then hands control to the fault hook."""

    def __init__(self, raw, on_first_write: Callable[[], None]):
        super().__init__(raw)
        self._on_first_write = on_first_write

    def write(self, data) -> int:
        if self._on_first_write is None:
            return super().write(data)
        hook, self._on_first_write = self._on_first_write, None
        view = memoryview(data).cast("B")
        half = max(1, len(view) // 2)
        n = super().write(view[:half])
        self.flush()
        os.fsync(self.fileno())
        hook()
        return n + super().write(view[half:])


class _HookedFileSystem(FileSystem):
    def __init__(self, on_first_write: Callable[[], None]):
        super().__init__()
        self._on_first_write = on_first_write

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode and str(path).endswith(".distcp") and self._on_first_write is not None:
            hook, self._on_first_write = self._on_first_write, None
            with _HookedFile(io.FileIO(str(path), "w"), hook) as stream:
                yield stream
        else:
            with super().create_stream(path, mode) as stream:
                yield stream


def is_finite(t: torch.Tensor) -> bool:
    """NaN/Inf check at the cost of a vectorized sum (2 ms per 10M fp32 here, against 70 ms for
    isfinite().all()): NaN and Inf propagate through a sum; only an overflowing sum needs the exact check."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    acc = torch.float32 if t.element_size() < 4 else t.dtype
    if bool(torch.isfinite(t.sum(dtype=acc))):
        return True
    return bool(torch.isfinite(t).all())


class ScoutWriter(FileSystemWriter):
    """FileSystemWriter (single file per rank, fsync on) that records the files it wrote and checks that the
    floating tensors it writes are finite: each rank checks exactly the items DCP assigned to it (replicated
    tensors are de-duplicated across ranks), so the check costs no rank more than its share."""

    def __init__(self, path: Path, *, step: int, fault_hook: FaultHook | None = None, check_finite: bool = True):
        super().__init__(str(path), single_file_per_rank=True, sync_files=True, thread_count=1)
        self.step = step
        self.check_finite = check_finite
        self.written: set[str] = set()
        self.nonfinite: list[str] = []
        if fault_hook is not None:
            self.fs = _HookedFileSystem(lambda: fault_hook("during_write", step))

    def write_data(self, plan, planner):
        if self.check_finite:
            for item in plan.items:
                if item.type != WriteItemType.BYTE_IO:
                    data = planner.resolve_data(item)
                    if isinstance(data, torch.Tensor) and not is_finite(data):
                        self.nonfinite.append(item.index.fqn)
        fut = super().write_data(plan, planner)
        self.written.update(wr.storage_data.relative_path for wr in fut.wait())
        return fut
