"""One streaming pass over a DCP step dir: file digests, structure, finiteness and invariants from the same reads.

Why one pass: hashing every file and then reading every tensor back through the entries would read the bytes twice
and hold every tensor of the checkpoint in memory at once. Here each data file is read once, front to back, by one
loop (scan_reader.py, `Reader.pump`): PIECE bytes at a time into the thread's reused buffer, each piece hashed
right after the read, while it is in the cache. Each storage entry (one tensor chunk or plain value, a
`torch.save` archive) is first dry-run from a second descriptor (`dcp_entries.tensor_layout`: the zip and inner
pickle checks `load_entry` makes, and where the one storage lies). Then, for a plain tensor entry:
- when every check that applies to it is element-wise (`finite`, `frobenius_sphere`: `invariants.stream`), each
  piece of its bytes is checked right after it was hashed (a sum, a sum of squares; an exact element check only
  when a sum is not finite) and nothing of the tensor is kept;
- otherwise (spectral, oblique, simplex and monotone checks need the whole tensor) its bytes are read straight
  into a tensor of its shape over the thread's entry buffer, hashed piece by piece on the way, and given to
  `invariants.run_offline`.
Anything else (a plain value, an unusual layout) is read into the entry buffer and opened from it with
`dcp_entries.load_entry` (`weights_only`). Files go in parallel threads (reads, xxh3 and torch ops release the
GIL); each thread runs torch single-threaded. Peak memory per thread: the piece buffer and its float32 scratch
(2 x PIECE), plus, only for tensors a whole-tensor check matches, an entry buffer the size of the largest such
chunk; plus the tensors split over several entries while they are assembled for such checks.

Trust: the entries are parsed before the file's digest is known to match; parsing is the path built for
untrusted folders (`adopt`), and the invariants evidence is only used when the bytes evidence passes. When the
metadata cannot be read, or its declared entries do not fit the files (`storage_problems`), nothing is parsed and
`invariants()` returns None: the caller then takes the old read-back path, which reports the problem as before.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from scout_ckpt.errors import BadInput
from scout_ckpt.format.scan_reader import PIECE, Memory, Reader, direct_layout, read_file
from scout_ckpt.policy import FAIL, INCONCLUSIVE, PASS, evidence


def _merge(checks: list, results: list[dict]) -> dict:
    """One evidence from per-tensor `run_offline` results, as one call over all tensors would give it: failures
    in check order then tensor order, then errors, and `invariant_no_match` only for a check no tensor matched."""
    order = {c.label: i for i, c in enumerate(checks)}
    rs = [r for ev in results for r in ev["reasons"] if r["code"] != "invariant_no_match"]
    key = lambda r: (order.get(r.get("spec"), len(order)), str(r.get("tensor")))  # noqa: E731
    reasons = sorted((r for r in rs if r["code"] == "invariant_failed"), key=key)
    errors = sorted((r for r in rs if r["code"] != "invariant_failed"), key=key)
    checked = {c.label: sum((ev.get("checked") or {}).get(c.label, 0) for ev in results) for c in checks}
    for c in checks:
        if checked[c.label] == 0:
            errors.append(
                {
                    "code": "invariant_no_match",
                    "check": c.kind,
                    "spec": c.label,
                    "detail": f"no tensor matches {c.glob!r}",
                }
            )
    values: dict = {}
    for ev in results:
        values.update(ev.get("values") or {})
    status = FAIL if reasons else INCONCLUSIVE if errors else PASS
    return evidence(
        status,
        reasons + errors,
        checks=[c.spec for c in checks],
        checked=checked,
        values=values,
        collectives=0,
        reduced_floats=0,
    )


class _Tensor(NamedTuple):
    """What the pass needs of a tensor's metadata: its torch dtype and its full size."""

    dtype: Any
    size: tuple


class StepScan:
    """The one pass over one step dir. `hasher` has the signature of `digests.digest_files` and is what
    `verify.verify_files(hasher=...)` calls; `invariants()` gives the invariants evidence afterwards (or None:
    take the read-back path)."""

    def __init__(self, step_dir: str | os.PathLike, specs: list, threads: int | None = None):
        from scout_ckpt import invariants

        self.step_dir = Path(step_dir)
        self.checks = invariants.parse_specs(specs)
        self.threads = threads
        self._lock = threading.Lock()
        self._local = threading.local()
        self.direct = 0  # entries read straight into their tensor
        self.streamed = 0  # entries checked piece by piece (nothing of them kept)
        self._results: list[dict] = []
        self._plain: dict[str, Any] = {}  # non-tensor entries (a saved step counter, ...)
        self._parts: dict[str, list] = {}  # fqn -> [tensor being assembled, elements still missing]
        self._streams: dict[str, Any] = {}  # fqn -> its TensorStream, or None (checked whole)
        self._entries: dict[str, list] = {}  # real path of a data file -> [(offset, length, fqn, chunk)]
        self._expected = 0  # entries declared; _seen counts those parsed
        self._seen = 0
        self._failed: str | None = None
        self._plan()

    def _plan(self) -> None:
        from scout_ckpt.format.dcp_files import load_metadata, storage_problems
        from scout_ckpt.format.dcp_meta import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata, torch_dtype
        from scout_ckpt.format.safepaths import inside

        try:
            md = load_metadata(self.step_dir)
        except BadInput as e:
            self._failed = str(e)
            return
        if storage_problems(self.step_dir, md):
            self._failed = "storage problems"
            return
        for fqn, item in md.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                chunks = [(c, md.storage_data[MetadataIndex(fqn, c.offsets)]) for c in item.chunks]
                item = _Tensor(torch_dtype(item.properties.dtype), tuple(item.size))
            elif isinstance(item, BytesStorageMetadata):
                chunks = [(None, md.storage_data[MetadataIndex(fqn)])]
            else:
                continue
            for chunk, info in chunks:
                if getattr(info, "transform_descriptors", None):
                    self._failed = f"{fqn} is stored with transforms"
                    return
                path = inside(self.step_dir, info.relative_path)
                if path is None:
                    self._failed = "storage file outside the checkpoint"
                    return
                self._entries.setdefault(os.path.realpath(path), []).append(
                    (info.offset, info.length, fqn, chunk, item)
                )
                self._expected += 1

    # ---- the pass ----------------------------------------------------------------------------------------------

    def hasher(
        self, paths, threads: int | None = None, progress: Callable[[int], None] | None = None
    ) -> dict[str, tuple[int, str]]:
        """{str(path): (size, "xxh3_128:hex")} of every path, as `digest_files` gives it; the data files' entries
        are checked on the way."""
        paths = [str(p) for p in paths]
        if not paths:
            return {}
        n = self.threads or threads or min(len(paths), os.cpu_count() or 1, 8)
        # largest first, so that the last file to start is a small one
        order = sorted(paths, key=lambda p: -sum(e[1] for e in self._entries.get(p, [])))
        # Our own threads even for one file, each running torch single-threaded: the files are the parallelism,
        # and an OpenMP team per reduction on a loaded machine waits for its workers to be scheduled (measured:
        # 200 sums of 4 MB took 4.2 s with 2 OpenMP threads under load 15, 0.12 s with 1). set_num_threads sets
        # the calling thread's team size, but also the default that threads not yet using torch start from (and
        # the caller's own, if it has not run a parallel op yet): the caller's value is read first and put back.
        before = torch.get_num_threads()
        try:
            with ThreadPoolExecutor(
                n, thread_name_prefix="scout-scan", initializer=torch.set_num_threads, initargs=(1,)
            ) as pool:
                return dict(zip(order, pool.map(lambda p: self._file(p, progress), order)))
        finally:
            torch.set_num_threads(before)

    def _file(self, path: str, progress) -> tuple[int, str]:
        """(size, digest) of one file, read once front to back (scan_reader.read_file); its entries are checked
        from the same pieces."""
        entries = sorted(self._entries.get(path, []), key=lambda e: e[0]) if self._failed is None else []
        return read_file(path, entries, self._entry_pass, progress, self._piece)

    def _entry_pass(self, r: Reader, layout_f, off: int, length: int, fqn: str, chunk, item) -> int:
        """Read one entry (hashing it) and check it: streamed piece by piece, read into a tensor over the
        thread's buffer, or opened with `load_entry`. Returns the bytes read."""
        lay = self._direct(layout_f, off, length, chunk, item)
        st = self._stream(fqn, item) if chunk is not None else None
        if lay is None:  # a plain value or an unusual layout: through torch.load (weights_only)
            buf = self._buffer(length)
            got = r.pump(length, into=buf)
            if got == length:
                self._entry(buf, fqn, chunk, item, st)
            return got
        start, nbytes = lay
        got = r.pump(start)
        if got != start:
            return got
        dtype, size = item.dtype, tuple(chunk.sizes)
        if st is not None:  # the checks run on each piece while it is in the cache; nothing is kept
            scratch = self._scratch()
            itemsize = dtype.itemsize

            def each(piece, done: int) -> None:
                if len(piece) % itemsize == 0:
                    st.update(piece.view(dtype), scratch, done // itemsize, chunk)

            n = r.pump(nbytes, each=each)
            if n == nbytes:
                self._streamed(fqn, st)
        else:  # checks that need the whole tensor: fill it straight from the file
            raw = self._buffer(nbytes)
            n = r.pump(nbytes, into=raw)
            if n == nbytes:
                self._check(fqn, chunk, item, raw.view(dtype).view(size))
        got += n
        if n != nbytes:
            return got
        return got + r.pump(length - start - nbytes)

    def _stream(self, fqn: str, item):
        """The TensorStream checking this tensor piece by piece (shared by its chunks), or None when a check
        needs the whole tensor (it is then read into memory and given to `run_offline`)."""
        from scout_ckpt.invariants.stream import TensorStream, streams

        dtype = item.dtype
        with self._lock:
            if fqn in self._streams:
                return self._streams[fqn]
            st = None
            if streams(self.checks, fqn, dtype):
                st = TensorStream(self.checks, fqn, dtype, tuple(item.size))
            self._streams[fqn] = st
            return st

    def _streamed(self, fqn: str, st) -> None:
        """One more entry of a streamed tensor checked; its evidence once every element was seen."""
        with self._lock:
            self._seen += 1
            self.streamed += 1
            if st.done and not st.reported:
                st.reported = True
                if st.todo:
                    self._results.append(st.evidence())

    def _direct(self, f, off: int, length: int, chunk, item):
        """(start, count) of a tensor entry's bytes when they may be read straight into a tensor of the chunk's
        shape (scan_reader.direct_layout), else None (and for any non-tensor entry)."""
        if chunk is None:
            return None
        lay = direct_layout(f, off, length, tuple(chunk.sizes), item.dtype)
        if lay is not None:
            with self._lock:
                self.direct += 1
        return lay

    def _buffer(self, n: int):
        """n bytes of this thread's entry buffer (a uint8 tensor), grown to the largest entry it has read into
        memory: reused, so its pages are faulted in once, and never zero-filled while holding the GIL."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < n:
            buf = self._local.buf = None
            buf = self._local.buf = torch.empty(n, dtype=torch.uint8)
        return buf[:n]

    def _piece(self):
        """This thread's piece buffer (what the hasher reads into)."""
        p = getattr(self._local, "piece", None)
        if p is None:
            p = self._local.piece = torch.empty(PIECE, dtype=torch.uint8)
        return p

    def _scratch(self):
        from scout_ckpt.invariants.stream import Scratch

        s = getattr(self._local, "scratch", None)
        if s is None:
            s = self._local.scratch = Scratch()
        return s

    def _entry(self, buf, fqn: str, chunk, item, st=None) -> None:
        """Open one entry from its buffer and check it (or file it for assembly). Any refusal is recorded and the
        read-back path then reports it exactly as before."""
        from scout_ckpt.format.dcp_entries import load_entry

        try:
            value = load_entry(Memory(buf.numpy()), 0, len(buf))
        except BadInput as e:
            self._fail(f"{fqn}: {e}")
            return
        if chunk is None:
            with self._lock:
                self._plain[fqn] = value
                self._seen += 1
            return
        if st is None:
            self._check(fqn, chunk, item, value)
        elif self._matches(fqn, chunk, item, value):
            st.update(value.reshape(-1), self._scratch(), 0, chunk)
            self._streamed(fqn, st)

    def _check(self, fqn: str, chunk, item, value) -> None:
        """Check one tensor chunk against its metadata, then its invariants (once its tensor is whole)."""
        from scout_ckpt.invariants import run_offline

        if not self._matches(fqn, chunk, item, value):
            return
        whole = tuple(chunk.sizes) == tuple(item.size)
        if not whole:
            value = self._assemble(fqn, chunk, item, value)
        if value is not None:
            ev = run_offline(self.checks, {fqn: value}) if self.checks else None
            with self._lock:
                if ev is not None:
                    self._results.append(ev)
        with self._lock:
            self._seen += 1

    def _matches(self, fqn: str, chunk, item, value) -> bool:
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(chunk.sizes) or value.dtype != item.dtype:
            self._fail(f"{fqn}: chunk does not match its metadata")
            return False
        return True

    def _assemble(self, fqn: str, chunk, item, value):
        """Copy a chunk into its tensor; the full tensor once its last chunk arrived, else None."""

        with self._lock:
            if fqn not in self._parts:
                self._parts[fqn] = [torch.empty(item.size, dtype=item.dtype), math.prod(item.size)]
            part = self._parts[fqn]
        dst = part[0]
        for d, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes)):
            dst = dst.narrow(d, o, n)
        dst.copy_(value)
        with self._lock:
            part[1] -= value.numel()
            if part[1] > 0:
                return None
            del self._parts[fqn]
            return part[0]

    def _fail(self, why: str) -> None:
        with self._lock:
            self._failed = self._failed or why

    def invariants(self) -> dict | None:
        """Invariants evidence over every entry seen in the pass; None if the pass could not vouch for all of
        them (then read the tensors back: `certify.offline_invariants`)."""
        if (
            self._failed is not None
            or self._seen != self._expected
            or self._parts
            or any(st is not None and not st.done for st in self._streams.values())
        ):
            return None
        from scout_ckpt.invariants import run_offline

        results = list(self._results)
        if self._plain and self.checks:
            results.append(run_offline(self.checks, dict(self._plain)))
        return _merge(self.checks, results)
