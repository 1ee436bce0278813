"""DCP storage writer that knows which files this rank wrote, hashes them as they are written, checks that what
it writes is finite, and lets a save be interrupted on purpose.

Each rank digests only the files it wrote itself (never one rank re-reading everyone's bytes); DCP's write
results name them. What is computed from the bytes as they pass through (file digests, consensus signatures,
finiteness) is write_pass.py. The fault hook lets tests and the demo SIGKILL a rank in the middle of a file.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItemType

from scout_ckpt.consensus.in_flight import InFlightDigests
from scout_ckpt.invariants.finite import is_finite
from scout_ckpt.save.fault_points import FaultHook
from scout_ckpt.save.write_pass import DigestingFileSystem, WritePass, finite_key


@contextlib.contextmanager
def _without_zip_crc():
    """torch.save without the CRC32 of each zip record, in this thread, for the duration of a DCP write.

    Why: torch.save computes a CRC32 of every tensor it writes (about 1 GB/s here: a 25 MB tensor takes 39 ms to
    serialize with it, 9 ms without), and nothing ever checks it: torch.load, and so DCP's reader, loads a record
    whose bytes were corrupted without a word (tests/test_checkpointer.py shows it). What checks the bytes of a
    scout-ckpt checkpoint is the xxh3-128 digest of every data file, computed while it is written and verified
    before every load and by certify. The files stay loadable by torch.load and DCP; zip tools other than torch's
    may warn about the zeroed CRC fields.

    The option is thread-local in torch 2.13 (torch.utils._config_module keeps user overrides in a ContextVar):
    only the thread that writes (DCP's FileSystemWriter with one thread writes in the caller's) is affected, and
    it gets its own setting back afterwards; a torch.save elsewhere in the process is untouched."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


class WritesRecorded:
    """What a scout-ckpt writer adds to a DCP storage writer (POSIX or object store): the data files this rank
    wrote, their in-flight digests (`self.fs.digests`), and the tensors it wrote that are not finite. Put first
    in the bases; the subclass sets `written`, `nonfinite`, `check_finite` and `fs`."""

    skip_zip_crc = False  # the POSIX writer's digests cover every byte it writes: see _without_zip_crc
    signs_in_flight = False  # whether its files sign the tensors consensus expects (the POSIX writer's do)
    # This save's consensus link (consensus/in_flight.py): `started` is set when DCP hands this rank its write plan
    # (DCP's planning, collectives and CPU, is done and the write, mostly waiting on the disk, begins; the
    # Checkpointer holds consensus hashing until then), `done` when the write is over.
    in_flight: InFlightDigests | None = None

    def file_digests(self) -> dict[str, tuple[int, str]]:
        """(size, digest) of the data files this rank wrote and hashed in flight (others must be read back)."""
        return {f: d for f, d in self.fs.digests.items() if f in self.written}

    def write_data(self, plan, planner):
        in_flight = self.in_flight
        try:
            tensors = [
                (item.index.fqn, planner.resolve_data(item))
                for item in plan.items
                if item.type != WriteItemType.BYTE_IO
            ]
            if in_flight is not None and self.signs_in_flight:
                in_flight.expect(t for _, t in tensors)
            # Large tensors are checked piece by piece as they are written (write_pass.py), the rest now; both with
            # the one finite check certify runs too (invariants/finite.py). Every tensor of the plan whose storage is
            # one buffer is kept under its key, so aliases of one storage in other dtypes are checked in each.
            checked_later: dict = {}
            if self.check_finite:
                for fqn, t in tensors:
                    key = finite_key(t) if self.signs_in_flight else None
                    if key is not None:
                        checked_later.setdefault(key, []).append((fqn, t))
                    elif isinstance(t, torch.Tensor) and not is_finite(t):
                        self.nonfinite.append(fqn)
            work = WritePass(in_flight if self.signs_in_flight else None, checked_later)
            if self.signs_in_flight:
                self.fs.work = work
            del tensors
            if in_flight is not None:
                in_flight.started.set()
            with _without_zip_crc() if self.skip_zip_crc else contextlib.nullcontext():
                fut = super().write_data(plan, planner)
        finally:
            if in_flight is not None:
                in_flight.release()
        self.nonfinite.extend(work.nonfinite)
        self.nonfinite.extend(fqn for fqn, t in work.unseen() if not is_finite(t))
        self.written.update(wr.storage_data.relative_path for wr in fut.wait())
        return fut


def _layout_key(obj):
    """What a reused staging copy must match: the nesting, keys, and every plain tensor's dtype and shape (copy_
    would broadcast or convert silently across a mismatch). None where the state holds anything else (DTensor,
    ShardedTensor, unknown types): such a state is staged afresh every time."""
    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        return ("t", obj.dtype, tuple(obj.shape), obj.device.type)
    if isinstance(obj, dict):
        items = [(k, _layout_key(v)) for k, v in obj.items()]
        return None if any(v is None for _, v in items) else ("d", tuple(items))
    if isinstance(obj, (list, tuple)):
        items = [_layout_key(v) for v in obj]
        return None if any(v is None for v in items) else ("l", tuple(items))
    if obj is None or isinstance(obj, (int, float, str, bytes, io.BytesIO)):
        return ("v",)  # taken by reference at every staging, never from the cache
    return None


class StagingCache:
    """One host copy of a rank's state, reused by every async save of one Checkpointer: the copy is allocated once
    (the first staging, or when the state's layout changes) and later stagings only copy into it, so an async save
    blocks training for a memory copy, not for allocating and faulting in a fresh copy of the whole state. This is
    DCP's own `cache_staged_state_dict` (same torch helpers) without pinned memory, which needs an accelerator.

    Cost: the copy stays allocated between saves (every async save needs it during the save anyway). Safe because
    a Checkpointer starts a save only after the previous one committed (save() waits), so nothing still reads the
    copy when the next staging overwrites it."""

    def __init__(self) -> None:
        self._key = None
        self._copy = None

    def stage(self, state_dict):
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        key = _layout_key(state_dict)
        if key is None:
            self._key = self._copy = None
            return _copy_state_dict(state_dict, _create_cpu_state_dict(state_dict))
        if key != self._key:
            self._key, self._copy = None, _create_cpu_state_dict(state_dict)
            self._key = key
        return _copy_state_dict(state_dict, self._copy)

    def clear(self) -> None:
        self._key = self._copy = None


class ScoutWriter(WritesRecorded, FileSystemWriter):
    """FileSystemWriter (single file per rank, fsync on) that records the files it wrote and checks that the
    floating tensors it writes are finite: each rank checks exactly the items DCP assigned to it (replicated
    tensors are de-duplicated across ranks), so the check costs no rank more than its share."""

    # torch.save's per-record zip CRC32 costs about a third of a write's CPU (~1 GB/s) and torch.load never checks
    # it; the xxh3 file digests computed in flight cover every byte. The offline reader (dcp_entries._stored)
    # reads stored members after their local header, so it never relies on the CRC either.
    skip_zip_crc = True
    signs_in_flight = True

    def __init__(
        self,
        path: Path,
        *,
        step: int,
        fault_hook: FaultHook | None = None,
        check_finite: bool = True,
        stage_cache: StagingCache | None = None,
    ):
        # fsync on: done by the file system below at each file's close (write_pass.DigestingFileSystem), not by
        # DCP, so that the data file can say when the disk's flush begins
        super().__init__(str(path), single_file_per_rank=True, sync_files=False, thread_count=1)
        self.step = step
        self.stage_cache = stage_cache
        self.check_finite = check_finite
        self.written: set[str] = set()
        self.nonfinite: list[str] = []
        self.fs = DigestingFileSystem((lambda: fault_hook("during_write", step)) if fault_hook else None)

    def stage(self, state_dict):
        """An async save's staging: a CPU copy of the state (into `stage_cache` when given)."""
        if self.stage_cache is None:
            return super().stage(state_dict)
        self.per_thread_copy_ahead = 0  # as FileSystemWriter.stage: the staged state is already on the host
        return self.stage_cache.stage(state_dict)
