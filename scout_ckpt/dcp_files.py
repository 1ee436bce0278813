"""Reading DCP checkpoint folders offline, without a process group and without trusting them.

DCP's `.metadata` is a pickle, and `FileSystemReader.read_metadata` hands it to `pickle.load`: a crafted file runs
code, or allocates without bound (`bytearray(1 << 34)` is a 40-byte pickle). `load_metadata` therefore:

- refuses a file over `SCOUT_CKPT_MAX_METADATA_BYTES` (default 64 MiB) before reading it, and anything that is not
  a regular file (a FIFO would block, `/dev/zero` never ends);
- unpickles with the pure-Python unpickler (its memo is a dict: the C unpickler's memo is an array that a 10-byte
  `LONG_BINPUT 2**28` grows to gigabytes) restricted three ways: only the globals DCP 2.13 writes there (listed by
  recording `find_class` on real DDP, FSDP2, optimizer and bytes checkpoints); only the opcodes such a pickle uses
  (no sets, extensions, persistent ids, buffers, INST/OBJ); and each constructor only with the argument types DCP
  gives it (`torch.Size(tuple of ints)`, a path from strings, a dataclass by `__new__` with no arguments and a
  `BUILD` of its own fields). None of the admitted constructors can allocate more than its arguments' size, so
  memory stays linear in the (bounded) file size. Dictionary keys are checked before they are hashed (a deeply
  nested tuple key would overflow the C stack);
- then checks the schema of what came out (types, ranks, non-negative sizes, safe file names) before anyone uses it.

Declared sizes are then checked against the bytes on disk before anything is allocated (`storage_problems`): each
chunk's bytes fit in its storage entry, the entries of a file do not overlap and lie inside it, and a tensor's
chunks cover it. So `read_tensors` allocates at most the bytes the files hold. Entries are DCP `torch.save` blobs;
their inner pickle is dry-run first (torch's `weights_only` set admits `bytearray` and the legacy
`torch.FloatTensor(n)` constructors, which allocate by argument), then opened with `weights_only=True`.
`check_structure` (what `adopt` trusts a foreign folder on) dry-runs every entry: `dcp.load` itself opens
non-tensor entries with `weights_only=False`.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import pickletools
import re
import stat
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from scout_ckpt.errors import BadInput
from scout_ckpt.layout import DCP_METADATA
from scout_ckpt.policy import FAIL, PASS, evidence
from scout_ckpt.safepaths import clip, inside, read_bounded, relpath_problem

DISTCP_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
MAX_METADATA_ENV = "SCOUT_CKPT_MAX_METADATA_BYTES"
DEFAULT_MAX_METADATA_BYTES = 64 << 20
MAX_NDIM = 64


class BadMetadata(BadInput):
    """A DCP `.metadata` (or an entry it points at) that is malformed, inconsistent with the files, or hostile."""


class RefusedPickle(BadMetadata):
    """The `.metadata` pickle uses a class, opcode or argument outside what DCP writes there."""


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


# ---- the restricted unpickler ---------------------------------------------------------------------------------

_META = "torch.distributed.checkpoint.metadata"
_DATACLASS_NAMES = {(_META, n) for n in ("Metadata", "MetadataIndex", "TensorStorageMetadata",
                                         "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                         "StorageMeta")} | {("torch.distributed.checkpoint.filesystem",
                                                             "_StorageInfo")}
# pathlib classes: storage_meta.checkpoint_id. Python 3.13 moved them to pathlib._local (and pickles that name);
# 3.11 has no such module, so both names map to the pathlib class. A Windows path cannot be made on POSIX: its
# pure form carries the same parts.
_PATH_NAMES = {"PosixPath": "PosixPath", "PurePosixPath": "PurePosixPath", "PureWindowsPath": "PureWindowsPath",
               "WindowsPath": "PureWindowsPath", "PurePath": "PurePosixPath", "Path": "PosixPath"}

# Opcodes a DCP `.metadata` pickle (protocol 2 to 5) can use. Everything else is refused.
_SAFE_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
    "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT",
    "BINFLOAT", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "APPEND", "APPENDS", "LIST",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS",
    "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE",
    "GLOBAL", "STACK_GLOBAL", "REDUCE", "NEWOBJ", "BUILD",
}


@lru_cache(maxsize=1)
def _allowed() -> dict:
    """{(module, name): object} for the globals a `.metadata` may name, and the per-kind sets."""
    import pathlib

    import torch
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as meta

    out: dict[tuple[str, str], Any] = {}
    for mod, name in _DATACLASS_NAMES:
        out[(mod, name)] = getattr(fs if mod.endswith("filesystem") else meta, name)
    out[(_META, "_MEM_FORMAT_ENCODING")] = meta._MEM_FORMAT_ENCODING
    out[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    out[("torch", "Size")] = torch.Size
    for mod in ("pathlib", "pathlib._local"):
        for name, real in _PATH_NAMES.items():
            out[(mod, name)] = getattr(pathlib, real)
    return out


def _find_global(module: str, name: str, what: str):
    allowed = _allowed()
    obj = allowed.get((module, name))
    if obj is not None:
        return obj
    if module == "torch" and isinstance(name, str) and not name.startswith("_"):
        import torch

        obj = getattr(torch, name, None)
        if isinstance(obj, torch.dtype):
            return obj
    raise RefusedPickle(f"refusing to unpickle {clip(module, 80)}.{clip(name, 80)} from {what}: "
                        f"not a DCP metadata class")


def _is_int(x) -> bool:
    return type(x) is int


def _ints(xs) -> bool:
    return type(xs) in (tuple, list) and len(xs) <= MAX_NDIM and all(type(x) is int for x in xs)


@lru_cache(maxsize=1)
def _reduce_rules() -> dict:
    """callable -> predicate on its argument tuple: the only calls a `.metadata` may make."""
    import pathlib

    import torch
    import torch.distributed.checkpoint.metadata as meta

    def path_args(a):
        return len(a) <= 1024 and all(type(x) is str for x in a)

    rules = {
        torch.Size: lambda a: len(a) == 1 and _ints(a[0]),
        torch.serialization._get_layout: lambda a: len(a) == 1 and type(a[0]) is str and len(a[0]) < 64,
        meta._MEM_FORMAT_ENCODING: lambda a: len(a) == 1 and _is_int(a[0]),
    }
    for real in set(_PATH_NAMES.values()):
        rules[getattr(pathlib, real)] = path_args
    return rules


@lru_cache(maxsize=1)
def _dataclasses() -> dict:
    """dataclass -> the field names a BUILD may set."""
    import dataclasses

    return {cls: {f.name for f in dataclasses.fields(cls)}
            for cls in (_allowed()[k] for k in _DATACLASS_NAMES)}


def _check_key(key) -> None:
    """Dictionary keys are hashed by the unpickler itself: only flat, hashable-by-value types are admitted."""
    if type(key) in (str, int):
        return
    MetadataIndex = _build_types()[1]
    if type(key) is MetadataIndex and type(key.__dict__.get("fqn")) is str:
        return   # its offset and index were checked when it was built
    raise RefusedPickle(f"refusing a {type(key).__name__} dictionary key in .metadata")


def _refuse_opcode(name: str):
    def refuse(self):
        raise RefusedPickle(f"refusing pickle opcode {name} in .metadata: not used by DCP")
    return refuse


class _MetadataUnpickler(pickle._Unpickler):  # the pure-Python unpickler: see the module docstring
    dispatch = dict(pickle._Unpickler.dispatch)
    for _op in pickletools.opcodes:
        if _op.name not in _SAFE_OPCODES:
            dispatch[_op.code.encode("latin-1")[0]] = _refuse_opcode(_op.name)
    del _op

    def find_class(self, module, name):
        return _find_global(module, name, ".metadata")

    def persistent_load(self, pid):
        raise RefusedPickle("refusing a persistent id in .metadata")

    def load_reduce(self):
        stack = self.stack
        args = stack.pop()
        func = stack[-1]
        rule = _by_identity(_reduce_rules(), func)
        if rule is None or type(args) is not tuple or not rule(args):
            raise RefusedPickle(f"refusing a call of {_name(func)} in .metadata: not a call DCP makes")
        stack[-1] = func(*args)
    dispatch[pickle.REDUCE[0]] = load_reduce

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        if _by_identity(_dataclasses(), cls) is None or args != ():
            raise RefusedPickle(f"refusing to construct {_name(cls)} in .metadata")
        self.append(cls.__new__(cls))
    dispatch[pickle.NEWOBJ[0]] = load_newobj

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        _build(inst, state)
    dispatch[pickle.BUILD[0]] = load_build

    def load_setitem(self):
        stack = self.stack
        value = stack.pop()
        key = stack.pop()
        target = stack[-1]
        if type(target) is not dict:
            raise RefusedPickle("refusing SETITEM on a non-dict in .metadata")
        _check_key(key)
        target[key] = value
    dispatch[pickle.SETITEM[0]] = load_setitem

    def load_setitems(self):
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is not dict:
            raise RefusedPickle("refusing SETITEMS on a non-dict in .metadata")
        for i in range(0, len(items) - 1, 2):
            _check_key(items[i])
            target[items[i]] = items[i + 1]
    dispatch[pickle.SETITEMS[0]] = load_setitems

    def load_dict(self):
        items = self.pop_mark()
        for i in range(0, len(items) - 1, 2):
            _check_key(items[i])
        self.append({items[i]: items[i + 1] for i in range(0, len(items) - 1, 2)})
    dispatch[pickle.DICT[0]] = load_dict

    def load_append(self):
        value = self.stack.pop()
        if type(self.stack[-1]) is not list:
            raise RefusedPickle("refusing APPEND on a non-list in .metadata")
        self.stack[-1].append(value)
    dispatch[pickle.APPEND[0]] = load_append

    def load_appends(self):
        items = self.pop_mark()
        if type(self.stack[-1]) is not list:
            raise RefusedPickle("refusing APPENDS on a non-list in .metadata")
        self.stack[-1].extend(items)
    dispatch[pickle.APPENDS[0]] = load_appends


def _by_identity(table: dict, obj):
    """table[obj] looked up by identity: `obj` is untrusted and hashing a deeply nested tuple overflows the C
    stack."""
    return next((v for k, v in table.items() if k is obj), None)


def _name(obj) -> str:
    return clip(getattr(obj, "__qualname__", None) or type(obj).__name__, 80)


@lru_cache(maxsize=1)
def _build_types():
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties, _MEM_FORMAT_ENCODING

    return torch, MetadataIndex, TensorProperties, _MEM_FORMAT_ENCODING


def _build(inst, state) -> None:
    """BUILD: set the fields of an allowed dataclass instance (and nothing else)."""
    torch, MetadataIndex, TensorProperties, _MEM_FORMAT_ENCODING = _build_types()
    cls = type(inst)
    fields = _by_identity(_dataclasses(), cls)
    if fields is None:
        raise RefusedPickle(f"refusing to set the state of a {clip(cls.__name__, 60)} in .metadata")
    if cls is TensorProperties:  # pickled through its __getstate__: (dtype, layout, requires_grad, fmt, pin)
        ok = (type(state) is tuple and len(state) == 5 and isinstance(state[0], torch.dtype)
              and isinstance(state[1], torch.layout) and type(state[2]) is bool
              and type(state[3]) is _MEM_FORMAT_ENCODING and type(state[4]) is bool)
        if not ok:
            raise RefusedPickle("refusing malformed TensorProperties state in .metadata")
        inst.__setstate__(state)
        return
    if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
        raise RefusedPickle(f"refusing malformed {cls.__name__} state in .metadata")
    if cls is MetadataIndex:   # a dictionary key: hashed over (fqn, offset), so both must be flat now
        if type(state.get("fqn")) is not str or type(state.get("offset")) not in (torch.Size, type(None)) \
                or type(state.get("index")) not in (int, type(None)):
            raise RefusedPickle("refusing malformed MetadataIndex state in .metadata")
    inst.__dict__.update(state)


def load_metadata(path: str | os.PathLike):
    """DCP Metadata from a step dir (or a `.metadata` file), via the restricted unpickler, schema-checked.
    BadInput (BadMetadata) if refused, too large, unreadable or not DCP metadata."""
    path = Path(path)
    if path.is_dir():   # the .metadata of a step dir must be its own, not a symlink to a file elsewhere
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
        raise BadMetadata(f"{path}: unreadable DCP metadata ({type(e).__name__}: "
                          f"{clip(str(e).splitlines()[0] if str(e) else '', 160)})") from None
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
    import torch

    if type(size) is not torch.Size:
        return f"{what} is not a torch.Size"
    if len(size) > MAX_NDIM or any(x < 0 for x in size):
        return f"{what} has more than {MAX_NDIM} or negative dimensions"
    return None


def _schema_problem(md) -> str | None:
    """Why `md` is not well-formed DCP Metadata written by FileSystemWriter, or None."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

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
        if type(props) is not TensorProperties or not isinstance(_field(props, "dtype"), torch.dtype):
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
    return None


# ---- declared sizes against the bytes on disk --------------------------------------------------------------------

def storage_problems(step_dir: str | os.PathLike, md) -> list[dict]:
    """Reasons the metadata's declared tensors cannot be read from the files as they are: a chunk without a storage
    entry, a chunk declaring more bytes than its entry holds, a tensor its chunks do not cover, entries that overlap
    or lie outside their file, files that are missing, not regular, or outside the step dir. Empty when a reader
    allocating the declared tensors allocates no more than the files hold."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

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
                bad(f"{name} chunk at {list(key)} declares {volume * itemsize} bytes but its storage entry "
                    f"holds {info.length}")
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
                    return reasons   # one is enough to refuse the checkpoint
    return reasons


# ---- entries ----------------------------------------------------------------------------------------------------

class _Window(io.RawIOBase):
    """A read-only view of bytes [offset, offset + length) of an open file: what torch.load and zipfile read
    an entry through (torch's own view cannot seek from the end)."""

    def __init__(self, f, offset: int, length: int):
        super().__init__()
        self._f, self._off, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._len}[whence]
        self._pos = min(max(base + pos, 0), self._len)
        return self._pos

    def readinto(self, b) -> int:
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._off + self._pos)
        got = self._f.readinto(memoryview(b)[:n])
        self._pos += got or 0
        return got or 0


_BLOB_CALLS = {("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict"), ("_codecs", "encode"),
               ("torch", "device")}


class _Stand:
    """A stand-in for a global or a built object during the dry run of an entry's pickle (n: a storage's
    element count)."""
    __slots__ = ("what", "n")

    def __init__(self, what: str, n: int = 0):
        self.what, self.n = what, n


class _EntryScan(pickle._Unpickler):
    """A dry run of a DCP entry's `data.pkl` (a `torch.save` pickle) that builds stand-ins instead of tensors:
    it admits only the calls `torch.save` writes for tensors and plain values, so the real `torch.load` that
    follows cannot reach `bytearray(n)`, `torch.FloatStorage(n)` or the legacy tensor constructors, which its
    `weights_only` set allows."""

    dispatch = dict(pickle._Unpickler.dispatch)
    for _op in pickletools.opcodes:
        if _op.name not in _SAFE_OPCODES | {"BINPERSID", "BINSTRING", "SHORT_BINSTRING"} or _op.name in (
                "NEWOBJ", "BUILD", "STACK_GLOBAL"):
            dispatch[_op.code.encode("latin-1")[0]] = _refuse_opcode(_op.name)
    del _op

    def find_class(self, module, name):
        import torch

        if (module, name) in _BLOB_CALLS:
            return _Stand(f"{module}.{name}")
        if module == "torch" and isinstance(name, str) and name.endswith("Storage") \
                and isinstance(getattr(torch, name, None), type):
            return _Stand("storage_type")
        raise RefusedPickle(f"refusing {clip(module, 80)}.{clip(name, 80)} in a DCP entry: not a tensor or "
                            f"plain value")

    def persistent_load(self, pid):
        if type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" and type(pid[1]) is _Stand \
                and pid[1].what == "storage_type" and type(pid[2]) is str and type(pid[3]) is str \
                and type(pid[4]) is int:
            return _Stand("storage", pid[4])
        raise RefusedPickle("refusing a persistent id in a DCP entry: not a storage")

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        what = func.what if type(func) is _Stand else None
        ok = type(args) is tuple and (
            # a view of its storage, no larger than it: a stride-0 view of a tiny storage can declare 2**40
            # elements, which the checks downstream would then compute over
            (what == "torch._utils._rebuild_tensor_v2" and len(args) in (6, 7) and type(args[0]) is _Stand
             and args[0].what == "storage" and type(args[1]) is int and _ints(args[2]) and _ints(args[3])
             and all(x >= 0 for x in args[2]) and math.prod(args[2]) <= max(args[0].n, 0))
            or (what == "collections.OrderedDict" and args == ())
            or (what in ("_codecs.encode", "torch.device") and all(type(a) is str for a in args) and len(args) <= 2))
        if not ok:
            raise RefusedPickle(f"refusing a call of {clip(what or type(func).__name__, 80)} in a DCP entry")
        self.stack[-1] = {} if what == "collections.OrderedDict" else _Stand("value")
    dispatch[pickle.REDUCE[0]] = load_reduce

    def load_setitem(self):
        value, key = self.stack.pop(), self.stack.pop()
        if type(self.stack[-1]) is not dict or type(key) not in (str, int, float, bool, bytes, type(None)):
            raise RefusedPickle("refusing a dictionary item in a DCP entry")
        self.stack[-1][key] = value
    dispatch[pickle.SETITEM[0]] = load_setitem

    def load_setitems(self):
        items = self.pop_mark()
        if type(self.stack[-1]) is not dict or not all(
                type(k) in (str, int, float, bool, bytes, type(None)) for k in items[::2]):
            raise RefusedPickle("refusing dictionary items in a DCP entry")
        for i in range(0, len(items) - 1, 2):
            self.stack[-1][items[i]] = items[i + 1]
    dispatch[pickle.SETITEMS[0]] = load_setitems

    def load_dict(self):
        raise RefusedPickle("refusing pickle opcode DICT in a DCP entry")
    dispatch[pickle.DICT[0]] = load_dict

    def load_append(self):
        value = self.stack.pop()
        if type(self.stack[-1]) is not list:
            raise RefusedPickle("refusing APPEND on a non-list in a DCP entry")
        self.stack[-1].append(value)
    dispatch[pickle.APPEND[0]] = load_append

    def load_appends(self):
        items = self.pop_mark()
        if type(self.stack[-1]) is not list:
            raise RefusedPickle("refusing APPENDS on a non-list in a DCP entry")
        self.stack[-1].extend(items)
    dispatch[pickle.APPENDS[0]] = load_appends


def _scan_entry(window: _Window, length: int) -> None:
    """Refuse an entry whose zip or inner pickle is not what `torch.save` writes for a tensor or plain value."""
    try:
        z = zipfile.ZipFile(window)
        infos = z.infolist()
        pkls = [i for i in infos if i.filename == "data.pkl" or i.filename.endswith("/data.pkl")]
        if len(pkls) != 1 or len({i.filename for i in infos}) != len(infos):
            raise RefusedPickle("not a torch.save archive (no single data.pkl, or duplicate names)")
        info = pkls[0]
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > length:
            raise RefusedPickle("compressed or oversized data.pkl")
        data = z.read(info)
    except BadInput:
        raise
    except Exception as e:
        raise RefusedPickle(f"not a torch.save archive ({type(e).__name__})") from None
    finally:
        window.seek(0)
    try:
        _EntryScan(io.BytesIO(data)).load()
    except BadInput:
        raise
    except Exception as e:
        raise RefusedPickle(f"malformed entry pickle ({type(e).__name__})") from None


def _load_entry(f, offset: int, length: int):
    import torch

    window = _Window(f, offset, length)
    _scan_entry(window, length)
    try:
        return torch.load(window, map_location="cpu", weights_only=True)
    except Exception as e:
        raise BadMetadata(f"unreadable DCP entry ({type(e).__name__}: "
                          f"{clip(str(e).splitlines()[0] if str(e) else '', 200)})") from None


def read_tensors(step_dir: str | os.PathLike, prefix: str | None = None, *, include_bytes: bool = False,
                 metadata=None) -> dict[str, Any]:
    """Full tensors {fqn: Tensor} (and, with include_bytes, plain values such as a saved `step` int) of a step
    dir, without a process group. Declared sizes are checked against the files before anything is allocated
    (BadMetadata otherwise). Call after the digests matched, for trust."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    step_dir = Path(step_dir)
    md = metadata if metadata is not None else load_metadata(step_dir)
    problems = storage_problems(step_dir, md)
    if problems:
        p = problems[0]
        raise BadMetadata(f"{step_dir}: {p.get('detail') or p['code']} ({p['code']}, {clip(p.get('file'), 80)})")
    out: dict[str, Any] = {}
    reads: dict[str, list[tuple]] = {}   # file -> [(offset, length, fqn, chunk or None, storage info)]
    for fqn, item in md.state_dict_metadata.items():
        if prefix and not fqn.startswith(prefix):
            continue
        if isinstance(item, TensorStorageMetadata):
            out[fqn] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
            for chunk in item.chunks:
                info = md.storage_data[MetadataIndex(fqn, chunk.offsets)]
                reads.setdefault(info.relative_path, []).append((info.offset, info.length, fqn, chunk, info))
        elif isinstance(item, BytesStorageMetadata) and include_bytes:
            info = md.storage_data[MetadataIndex(fqn)]
            reads.setdefault(info.relative_path, []).append((info.offset, info.length, fqn, None, info))
    for rel, items in reads.items():
        path = inside(step_dir, rel)   # checked by storage_problems; re-checked where it is opened
        if path is None:
            raise BadMetadata(f"{step_dir}: storage file {clip(rel, 80)} lies outside the checkpoint")
        with open(path, "rb") as f:
            for off, length, fqn, chunk, info in sorted(items, key=lambda x: x[0]):
                if getattr(info, "transform_descriptors", None):
                    raise BadMetadata(f"{path}: {clip(fqn, 80)} is stored with transforms; not supported offline")
                try:
                    value = _load_entry(f, off, length)   # one copy: page cache -> tensor
                except BadInput as e:
                    raise BadMetadata(f"{path}: entry {clip(fqn, 80)}: {e}") from None
                if chunk is None:
                    out[fqn] = value
                    continue
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(chunk.sizes):
                    raise BadMetadata(f"{path}: {clip(fqn, 80)} chunk does not match its metadata")
                dst = out[fqn]
                if tuple(dst.shape) == tuple(value.shape) and value.dtype == dst.dtype and value.is_contiguous():
                    out[fqn] = value      # the chunk is the whole tensor: keep it, skip a copy
                    continue
                for d, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes)):
                    dst = dst.narrow(d, o, n)
                dst.copy_(value)
    return out
