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

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

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


class ScoutWriter(FileSystemWriter):
    """FileSystemWriter (single file per rank, fsync on) that records the files it wrote."""

    def __init__(self, path: Path, *, step: int, fault_hook: FaultHook | None = None):
        super().__init__(str(path), single_file_per_rank=True, sync_files=True, thread_count=1)
        self.step = step
        self.written: set[str] = set()
        if fault_hook is not None:
            self.fs = _HookedFileSystem(lambda: fault_hook("during_write", step))

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        self.written.update(wr.storage_data.relative_path for wr in fut.wait())
        return fut
