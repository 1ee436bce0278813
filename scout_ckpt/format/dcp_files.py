"""Reading DCP checkpoint folders offline, without a process group and without trusting them.

DCP's `.metadata` is a pickle, and `FileSystemReader.read_metadata` hands it to `pickle.load`: a crafted file runs
code, or allocates without bound (`bytearray(1 << 34)` is a 40-byte pickle). `load_metadata` therefore:

- refuses a file over `SCOUT_CKPT_MAX_METADATA_BYTES` (default 64 MiB) before reading it, and anything that is not
  a regular file (a FIFO would block, `/dev/zero` never ends);
- unpickles with the pure-Python unpickler (`dcp_pickle`; its memo is a dict: the C unpickler's memo is an array
  that a 10-byte `LONG_BINPUT 2**28` grows to gigabytes) restricted three ways: only the globals DCP 2.13 writes there (listed by
  recording `find_class` on real DDP, FSDP2, optimizer and bytes checkpoints); only the opcodes such a pickle uses
  (no sets, extensions, persistent ids, buffers, INST/OBJ); and each constructor only with the argument types DCP
  gives it (`torch.Size(tuple of ints)`, a path from strings, a dataclass by `__new__` with no arguments and a
  `BUILD` of its own fields). DCP's classes are built as the light stand-ins of `dcp_meta` (no torch import). None of the admitted constructors can allocate more than its arguments' size, so
  memory stays linear in the (bounded) file size. Dictionary keys are checked before they are hashed (a deeply
  nested tuple key would overflow the C stack);
- then checks the schema of what came out (types, ranks, non-negative sizes, safe file names) before anyone uses it.

Declared sizes are then checked against the bytes on disk before anything is allocated (`storage_problems`): each
chunk's bytes fit in its storage entry, the entries of a file do not overlap and lie inside it, and a tensor's
chunks cover it. So `read_tensors` allocates at most the bytes the files hold. Entries are DCP `torch.save` blobs,
opened one at a time by `dcp_entries` (a dry run of the inner pickle, then `weights_only=True`; its own module
because certify's one-pass scanner opens entries from its read buffers with exactly the same refusals).
`check_structure` (what `adopt` trusts a foreign folder on) dry-runs every entry: `dcp.load` itself opens
non-tensor entries with `weights_only=False`.
"""

from __future__ import annotations

import io
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

from scout_ckpt.errors import BadInput
from scout_ckpt.format.dcp_entries import _scan_entry, _Window, load_entry, tensor_layout  # noqa: F401 (re-exported)
from scout_ckpt.format.dcp_pickle import MAX_NDIM, BadMetadata, RefusedPickle, _MetadataUnpickler
from scout_ckpt.format.layout import DCP_METADATA
from scout_ckpt.format.safepaths import clip, inside, read_bounded, relpath_problem
from scout_ckpt.policy import FAIL, PASS, evidence

DISTCP_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
MAX_METADATA_ENV = "SCOUT_CKPT_MAX_METADATA_BYTES"
DEFAULT_MAX_METADATA_BYTES = 64 << 20


def max_metadata_bytes() -> int:
    """The size limit for `.metadata` files (SCOUT_CKPT_MAX_METADATA_BYTES, bytes; default 64 MiB)."""
    raw = os.environ.get(MAX_METADATA_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_MAX_METADATA_BYTES
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value <= 0:
        raise BadInput(f"{MAX_METADATA_ENV}={clip(raw, 40)}: not a positive number of bytes")
    return value


def load_metadata(path: str | os.PathLike):
    """DCP Metadata from a step dir (or a `.metadata` file), via the restricted unpickler, schema-checked.
    BadInput (BadMetadata) if refused, too large, unreadable or not DCP metadata."""
    path = Path(path)
    if path.is_dir():  # the .metadata of a step dir must be its own, not a symlink to a file elsewhere
        if inside(path, DCP_METADATA) is None:
            raise BadMetadata(f"{path / DCP_METADATA}: resolves outside the checkpoint directory")
        path = path / DCP_METADATA
    limit = max_metadata_bytes()
    try:
        data = read_bounded(path, limit, "DCP .metadata")
    except FileNotFoundError:
        raise BadMetadata(f"{path}: no DCP .metadata") from None
    except ValueError as e:
        hint = f" (raise {MAX_METADATA_ENV} if this checkpoint is genuine)" if "limit" in str(e) else ""
        raise BadMetadata(f"{path}: {e}{hint}") from None
    except OSError as e:
        raise BadMetadata(f"{path}: unreadable ({e.strerror})") from None
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except RefusedPickle as e:
        raise RefusedPickle(f"{path}: {e}") from None
    except BadInput:
        raise
    except RecursionError:
        raise BadMetadata(f"{path}: unreadable DCP metadata (nested too deeply)") from None
    except MemoryError:
        raise BadMetadata(f"{path}: unreadable DCP metadata (out of memory)") from None
    except Exception as e:  # truncated or garbage pickle, or a constructor rejecting its arguments
        raise BadMetadata(
            f"{path}: unreadable DCP metadata ({type(e).__name__}: "
            f"{clip(str(e).splitlines()[0] if str(e) else '', 160)})"
        ) from None
    finally:
        del data
    problem = _schema_problem(md)
    if problem:
        raise BadMetadata(f"{path}: not DCP metadata ({problem})")
    return md


# ---- schema -----------------------------------------------------------------------------------------------------

_MISSING = object()


def _field(obj, name: str):
    """A dataclass field as BUILD left it (class defaults included); _MISSING if never set."""
    d = getattr(obj, "__dict__", {})
    return d[name] if name in d else getattr(type(obj), name, _MISSING)


def _size_problem(size, what: str) -> str | None:
    from scout_ckpt.format.dcp_meta import Size

    if type(size) is not Size:
        return f"{what} is not a torch.Size"
    if len(size) > MAX_NDIM or any(x < 0 for x in size):
        return f"{what} has more than {MAX_NDIM} or negative dimensions"
    return None


def _schema_problem(md) -> str | None:
    """Why `md` is not well-formed DCP Metadata written by FileSystemWriter, or None."""
    from scout_ckpt.format.dcp_meta import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        DType,
        Metadata,
        MetadataIndex,
        SavePlan,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
        WriteItem,
        _StorageInfo,
    )

    if type(md) is not Metadata:
        return f"a {clip(type(md).__name__, 60)}"
    sdm = _field(md, "state_dict_metadata")
    if type(sdm) is not dict:
        return "state_dict_metadata is not a dict"
    for fqn, item in sdm.items():
        if type(fqn) is not str:
            return "a state dict key that is not a string"
        name = clip(fqn, 80)
        if type(item) is BytesStorageMetadata:
            continue
        if type(item) is not TensorStorageMetadata:
            return f"{name}: a {clip(type(item).__name__, 60)}"
        props = _field(item, "properties")
        if type(props) is not TensorProperties or type(_field(props, "dtype")) is not DType:
            return f"{name}: malformed tensor properties"
        size = _field(item, "size")
        chunks = _field(item, "chunks")
        problem = _size_problem(size, f"{name} size")
        if problem:
            return problem
        if type(chunks) is not list:
            return f"{name}: chunks is not a list"
        for c in chunks:
            if type(c) is not ChunkStorageMetadata:
                return f"{name}: a chunk that is not ChunkStorageMetadata"
            off, sz = _field(c, "offsets"), _field(c, "sizes")
            problem = _size_problem(off, f"{name} chunk offsets") or _size_problem(sz, f"{name} chunk sizes")
            if problem:
                return problem
            if len(off) != len(size) or len(sz) != len(size):
                return f"{name}: a chunk of another rank than its tensor"
            if any(o + s > d for o, s, d in zip(off, sz, size)):
                return f"{name}: a chunk outside its tensor"
    sd = _field(md, "storage_data")
    if type(sd) is not dict:
        return "no storage_data (not written by FileSystemWriter)"
    for idx, info in sd.items():
        if type(idx) is not MetadataIndex or type(info) is not _StorageInfo:
            return "a storage entry that is not MetadataIndex -> _StorageInfo"
        rel, off, length = _field(info, "relative_path"), _field(info, "offset"), _field(info, "length")
        problem = relpath_problem(rel)
        if problem:
            return f"storage entry of {clip(idx.fqn, 80)}: file name {clip(rel, 80)}: {problem}"
        if type(off) is not int or type(length) is not int or off < 0 or length < 0:
            return f"storage entry of {clip(idx.fqn, 80)}: bad offset or length"
        td = _field(info, "transform_descriptors")
        if td not in (None, _MISSING) and (type(td) not in (list, tuple) or not all(type(t) is str for t in td)):
            return f"storage entry of {clip(idx.fqn, 80)}: malformed transform descriptors"
    sm = _field(md, "storage_meta")
    if sm not in (None, _MISSING) and type(sm) is not StorageMeta:
        return "malformed storage_meta"
    if _field(md, "version") not in (None, _MISSING) and type(_field(md, "version")) is not str:
        return "malformed version"
    plans = _field(md, "all_local_plans")  # Megatron-Core's torch_dist writer (dcp_meta); read by nobody here
    if plans not in (None, _MISSING) and (
        type(plans) is not list
        or not all(
            type(p) is SavePlan
            and type(_field(p, "items")) is list
            and all(type(i) is WriteItem for i in _field(p, "items"))
            for p in plans
        )
    ):
        return "malformed all_local_plans"
    return None


# ---- declared sizes against the bytes on disk --------------------------------------------------------------------


def storage_problems(step_dir: str | os.PathLike, md) -> list[dict]:
    """Reasons the metadata's declared tensors cannot be read from the files as they are: a chunk without a storage
    entry, a chunk declaring more bytes than its entry holds, a tensor its chunks do not cover, entries that overlap
    or lie outside their file, files that are missing, not regular, or outside the step dir. Empty when a reader
    allocating the declared tensors allocates no more than the files hold."""
    from scout_ckpt.format.dcp_meta import MetadataIndex, TensorStorageMetadata

    step_dir = Path(step_dir)
    reasons: list[dict] = []

    def bad(detail: str) -> None:
        reasons.append({"code": "bad_metadata", "file": DCP_METADATA, "detail": detail})

    for fqn, item in md.state_dict_metadata.items():
        name = clip(fqn, 80)
        if type(item) is not TensorStorageMetadata:
            if MetadataIndex(fqn) not in md.storage_data:
                bad(f"{name} has no storage entry")
            continue
        itemsize = item.properties.dtype.itemsize
        covered, seen = 0, set()
        for chunk in item.chunks:
            key = tuple(chunk.offsets)
            if key in seen:
                bad(f"{name} lists its chunk at {list(key)} twice")
                continue
            seen.add(key)
            info = md.storage_data.get(MetadataIndex(fqn, chunk.offsets))
            if info is None:
                bad(f"{name} chunk at {list(key)} has no storage entry")
                continue
            volume = math.prod(chunk.sizes)
            covered += volume
            if volume * itemsize > info.length:
                bad(
                    f"{name} chunk at {list(key)} declares {volume * itemsize} bytes but its storage entry "
                    f"holds {info.length}"
                )
        total = math.prod(item.size)
        if total > covered:
            bad(f"{name} declares {total} elements ({total * itemsize} bytes) but its chunks hold {covered}")
    per_file: dict[str, list[tuple[int, int]]] = {}
    for info in md.storage_data.values():
        per_file.setdefault(info.relative_path, []).append((info.offset, info.length))
    for rel, ranges in sorted(per_file.items()):
        path = inside(step_dir, rel)
        if path is None:
            bad(f"storage file {clip(rel, 80)} lies outside the checkpoint")
            continue
        try:
            st = os.stat(path)
        except FileNotFoundError:
            reasons.append({"code": "missing_file", "file": rel})
            continue
        except OSError as e:
            reasons.append({"code": "missing_file", "file": rel, "detail": e.strerror})
            continue
        if not stat.S_ISREG(st.st_mode):
            reasons.append({"code": "unsafe_file", "file": rel, "detail": "not a regular file"})
            continue
        ranges.sort()
        end = max(o + n for o, n in ranges)
        if st.st_size < end:
            reasons.append({"code": "truncated_file", "file": rel, "size": st.st_size, "needed": end})
        prev = 0
        for o, n in ranges:
            if o < prev:
                bad(f"storage entries overlap in {clip(rel, 80)} at offset {o}")
                break
            prev = o + n
    return reasons


def ranks_of(step_dir: str | os.PathLike) -> list[int]:
    """The ranks that wrote `__R_I.distcp` files in a step dir."""
    return sorted({int(m.group(1)) for n in os.listdir(step_dir) if (m := DISTCP_RE.match(n))})


def check_structure(step_dir: str | os.PathLike) -> dict:
    """Evidence that the metadata is loadable and every declared tensor is backed by bytes inside existing files."""
    step_dir = Path(step_dir)
    try:
        md = load_metadata(step_dir)
    except BadInput as e:
        code = "bad_metadata" if (step_dir / DCP_METADATA).exists() else "missing_file"
        return evidence(FAIL, [{"code": code, "file": DCP_METADATA, "detail": str(e)}])
    reasons = storage_problems(step_dir, md)
    if not reasons:
        reasons = entry_problems(step_dir, md)
    files = {info.relative_path for info in md.storage_data.values()}
    return evidence(FAIL if reasons else PASS, reasons, files=len(files), entries=len(md.storage_data))


def entry_problems(step_dir: str | os.PathLike, md) -> list[dict]:
    """Every storage entry's inner pickle dry-run (see _EntryScan): `dcp.load` opens non-tensor entries with
    `torch.load(weights_only=False)`, so a foreign checkpoint whose entries hold anything but tensors and plain
    values would run code when a job resumes from it. Call after storage_problems found nothing."""
    step_dir = Path(step_dir)
    per_file: dict[str, list[tuple[int, int, str]]] = {}
    for idx, info in md.storage_data.items():
        per_file.setdefault(info.relative_path, []).append((info.offset, info.length, idx.fqn))
    reasons: list[dict] = []
    for rel, entries in sorted(per_file.items()):
        with open(step_dir / rel, "rb") as f:
            for off, length, fqn in sorted(entries):
                try:
                    _scan_entry(_Window(f, off, length), length)
                except BadInput as e:
                    reasons.append({"code": "bad_entry", "file": rel, "tensor": clip(fqn, 80), "detail": str(e)})
                    return reasons  # one is enough to refuse the checkpoint
    return reasons


def read_tensors(
    step_dir: str | os.PathLike, prefix: str | None = None, *, include_bytes: bool = False, metadata=None
) -> dict[str, Any]:
    """Full tensors {fqn: Tensor} (and, with include_bytes, plain values such as a saved `step` int) of a step
    dir, without a process group. Declared sizes are checked against the files before anything is allocated
    (BadMetadata otherwise). Call after the digests matched, for trust."""
    import torch

    from scout_ckpt.format.dcp_meta import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata, torch_dtype

    step_dir = Path(step_dir)
    md = metadata if metadata is not None else load_metadata(step_dir)
    problems = storage_problems(step_dir, md)
    if problems:
        p = problems[0]
        raise BadMetadata(f"{step_dir}: {p.get('detail') or p['code']} ({p['code']}, {clip(p.get('file'), 80)})")
    out: dict[str, Any] = {}
    reads: dict[str, list[tuple]] = {}  # file -> [(offset, length, fqn, chunk or None, storage info)]
    for fqn, item in md.state_dict_metadata.items():
        if prefix and not fqn.startswith(prefix):
            continue
        if isinstance(item, TensorStorageMetadata):
            out[fqn] = torch.empty(tuple(item.size), dtype=torch_dtype(item.properties.dtype))
            for chunk in item.chunks:
                info = md.storage_data[MetadataIndex(fqn, chunk.offsets)]
                reads.setdefault(info.relative_path, []).append((info.offset, info.length, fqn, chunk, info))
        elif isinstance(item, BytesStorageMetadata) and include_bytes:
            info = md.storage_data[MetadataIndex(fqn)]
            reads.setdefault(info.relative_path, []).append((info.offset, info.length, fqn, None, info))
    for rel, items in reads.items():
        path = inside(step_dir, rel)  # checked by storage_problems; re-checked where it is opened
        if path is None:
            raise BadMetadata(f"{step_dir}: storage file {clip(rel, 80)} lies outside the checkpoint")
        with open(path, "rb") as f:
            for off, length, fqn, chunk, info in sorted(items, key=lambda x: x[0]):
                if getattr(info, "transform_descriptors", None):
                    raise BadMetadata(f"{path}: {clip(fqn, 80)} is stored with transforms; not supported offline")
                try:
                    value = load_entry(f, off, length)  # one copy: page cache -> tensor
                except BadInput as e:
                    raise BadMetadata(f"{path}: entry {clip(fqn, 80)}: {e}") from None
                if chunk is None:
                    out[fqn] = value
                    continue
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(chunk.sizes):
                    raise BadMetadata(f"{path}: {clip(fqn, 80)} chunk does not match its metadata")
                dst = out[fqn]
                if tuple(dst.shape) == tuple(value.shape) and value.dtype == dst.dtype and value.is_contiguous():
                    out[fqn] = value  # the chunk is the whole tensor: keep it, skip a copy
                    continue
                for d, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes)):
                    dst = dst.narrow(d, o, n)
                dst.copy_(value)
    return out
