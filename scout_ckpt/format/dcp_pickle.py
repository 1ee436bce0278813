"""The restricted unpicklers behind `dcp_files`: one for DCP `.metadata`, one dry run for the entries.

Both are the pure-Python `pickle._Unpickler` (its memo is a dict; the C unpickler's memo is an array that a
10-byte `LONG_BINPUT 2**28` grows to gigabytes, and its dictionary keys are hashed with C recursion, so a key
nested 200,000 tuples deep segfaults it), with the opcode table cut down to what DCP writes and REDUCE, NEWOBJ,
BUILD, SETITEM(S) and APPEND(S) replaced by checked versions. Each admitted constructor is admitted only with the
argument types DCP gives it, so none can allocate more than its arguments' size: memory stays linear in the
(bounded) input. The allowed globals were listed by recording `find_class` on real DDP, FSDP2 (DTensor),
optimizer and bytes-object checkpoints written by DCP 2.13. DCP's classes, `torch.Size`, dtypes and layouts are
mapped to the light stand-ins of `dcp_meta` (same fields), so reading `.metadata` imports neither torch nor DCP
(about 4.5 s of imports that `certify` and `adopt` paid per command). The entry dry run still imports torch (it
checks a storage class name against torch's).
"""

from __future__ import annotations

import math
import pickle
import pickletools
from functools import lru_cache
from typing import Any

from scout_ckpt.errors import BadInput
from scout_ckpt.format.safepaths import clip

MAX_NDIM = 64


class BadMetadata(BadInput):
    """A DCP `.metadata` (or an entry it points at) that is malformed, inconsistent with the files, or hostile."""


class RefusedPickle(BadMetadata):
    """The `.metadata` pickle uses a class, opcode or argument outside what DCP writes there."""


# ---- the restricted unpickler ---------------------------------------------------------------------------------

_META = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"  # in Megatron-Core's torch_dist metadata only (dcp_meta)
_DATACLASS_NAMES = (
    {
        (_META, n)
        for n in (
            "Metadata",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
        )
    }
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
    | {(_PLANNER, n) for n in ("SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData")}
)
# pathlib classes: storage_meta.checkpoint_id. Python 3.13 moved them to pathlib._local (and pickles that name);
# 3.11 has no such module, so both names map to the pathlib class. A Windows path cannot be made on POSIX: its
# pure form carries the same parts.
_PATH_NAMES = {
    "PosixPath": "PosixPath",
    "PurePosixPath": "PurePosixPath",
    "PureWindowsPath": "PureWindowsPath",
    "WindowsPath": "PureWindowsPath",
    "PurePath": "PurePosixPath",
    "Path": "PosixPath",
}

# Opcodes a DCP `.metadata` pickle (protocol 2 to 5) can use. Everything else is refused.
_SAFE_OPCODES = {
    "PROTO",
    "FRAME",
    "STOP",
    "MARK",
    "POP",
    "POP_MARK",
    "DUP",
    "NONE",
    "NEWTRUE",
    "NEWFALSE",
    "INT",
    "BININT",
    "BININT1",
    "BININT2",
    "LONG",
    "LONG1",
    "LONG4",
    "FLOAT",
    "BINFLOAT",
    "UNICODE",
    "BINUNICODE",
    "SHORT_BINUNICODE",
    "BINUNICODE8",
    "BINBYTES",
    "SHORT_BINBYTES",
    "EMPTY_TUPLE",
    "TUPLE",
    "TUPLE1",
    "TUPLE2",
    "TUPLE3",
    "EMPTY_LIST",
    "APPEND",
    "APPENDS",
    "LIST",
    "EMPTY_DICT",
    "DICT",
    "SETITEM",
    "SETITEMS",
    "GET",
    "BINGET",
    "LONG_BINGET",
    "PUT",
    "BINPUT",
    "LONG_BINPUT",
    "MEMOIZE",
    "GLOBAL",
    "STACK_GLOBAL",
    "REDUCE",
    "NEWOBJ",
    "BUILD",
}


@lru_cache(maxsize=1)
def _allowed() -> dict:
    """{(module, name): object} for the globals a `.metadata` may name: DCP's classes map to their light
    stand-ins (`dcp_meta`), so reading metadata imports neither torch nor DCP."""
    import pathlib

    from scout_ckpt.format import dcp_meta

    out: dict[tuple[str, str], Any] = {}
    for mod, name in _DATACLASS_NAMES:
        out[(mod, name)] = getattr(dcp_meta, name)
    out[(_META, "_MEM_FORMAT_ENCODING")] = dcp_meta._MEM_FORMAT_ENCODING
    out[(_PLANNER, "WriteItemType")] = dcp_meta.WriteItemType
    out[("torch.serialization", "_get_layout")] = dcp_meta._get_layout
    out[("torch", "Size")] = dcp_meta.Size
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
        from scout_ckpt.format.dcp_meta import dtype

        obj = dtype(name)
        if obj is not None:
            return obj
    raise RefusedPickle(
        f"refusing to unpickle {clip(module, 80)}.{clip(name, 80)} from {what}: not a DCP metadata class"
    )


def _is_int(x) -> bool:
    return type(x) is int


def _ints(xs) -> bool:
    return type(xs) in (tuple, list) and len(xs) <= MAX_NDIM and all(type(x) is int for x in xs)


@lru_cache(maxsize=1)
def _reduce_rules() -> dict:
    """callable -> predicate on its argument tuple: the only calls a `.metadata` may make."""
    import pathlib

    from scout_ckpt.format import dcp_meta

    def path_args(a):
        return len(a) <= 1024 and all(type(x) is str for x in a)

    rules = {
        dcp_meta.Size: lambda a: len(a) == 1 and _ints(a[0]),
        dcp_meta._get_layout: lambda a: len(a) == 1 and type(a[0]) is str and len(a[0]) < 64,
        dcp_meta._MEM_FORMAT_ENCODING: lambda a: len(a) == 1 and _is_int(a[0]),
        dcp_meta.WriteItemType: lambda a: len(a) == 1 and _is_int(a[0]),
    }
    for real in set(_PATH_NAMES.values()):
        rules[getattr(pathlib, real)] = path_args
    return rules


@lru_cache(maxsize=1)
def _dataclasses() -> dict:
    """dataclass -> the field names a BUILD may set."""
    import dataclasses

    return {cls: {f.name for f in dataclasses.fields(cls)} for cls in (_allowed()[k] for k in _DATACLASS_NAMES)}


def _check_key(key) -> None:
    """Dictionary keys are hashed by the unpickler itself: only flat, hashable-by-value types are admitted."""
    if type(key) in (str, int):
        return
    from scout_ckpt.format.dcp_meta import MetadataIndex

    if type(key) is MetadataIndex and type(key.__dict__.get("fqn")) is str:
        return  # its offset and index were checked when it was built
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


def _build(inst, state) -> None:
    """BUILD: set the fields of an allowed dataclass instance (and nothing else)."""
    from scout_ckpt.format.dcp_meta import _MEM_FORMAT_ENCODING, DType, Layout, MetadataIndex, Size, TensorProperties

    cls = type(inst)
    fields = _by_identity(_dataclasses(), cls)
    if fields is None:
        raise RefusedPickle(f"refusing to set the state of a {clip(cls.__name__, 60)} in .metadata")
    if cls is TensorProperties:  # pickled through its __getstate__: (dtype, layout, requires_grad, fmt, pin)
        ok = (
            type(state) is tuple
            and len(state) == 5
            and type(state[0]) is DType
            and type(state[1]) is Layout
            and type(state[2]) is bool
            and type(state[3]) is _MEM_FORMAT_ENCODING
            and type(state[4]) is bool
        )
        if not ok:
            raise RefusedPickle("refusing malformed TensorProperties state in .metadata")
        inst.__setstate__(state)
        return
    if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
        raise RefusedPickle(f"refusing malformed {cls.__name__} state in .metadata")
    if cls is MetadataIndex:  # a dictionary key: hashed over (fqn, offset), so both must be flat now
        if (
            type(state.get("fqn")) is not str
            or type(state.get("offset")) not in (Size, type(None))
            or type(state.get("index")) not in (int, type(None))
        ):
            raise RefusedPickle("refusing malformed MetadataIndex state in .metadata")
    inst.__dict__.update(state)


_BLOB_CALLS = {
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"),
    ("collections", "OrderedDict"),
    ("_codecs", "encode"),
    ("torch", "device"),
}
# a set (torch.save pickles it as set([...]); torch.load's weights_only admits it) of scalars only: hashing a
# deeply nested tuple element in the torch.load that follows would overflow the C stack
_SETS = {("__builtin__", "set"), ("builtins", "set")}
_SCALARS = (str, int, float, bool, bytes, type(None))


class _Stand:
    """A stand-in for a global or a built object during the dry run of an entry's pickle (n: a storage's
    element count, bytes for an untyped one; a dtype's item size; name: a storage class's name)."""

    __slots__ = ("n", "name", "what")

    def __init__(self, what: str, n: int = 0, name: str = ""):
        self.what, self.n, self.name = what, n, name


def _dtype_itemsize(name: str) -> int | None:
    """The item size of a torch dtype named by a pickle's `torch.<name>` global, or None if it is no dtype."""
    from scout_ckpt.format.dcp_meta import dtype

    d = dtype(name) if isinstance(name, str) else None
    return d.itemsize if d is not None else None


def _tensor_v2(args) -> bool:
    """torch.save's `_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])` over a
    typed storage: a view no larger than its storage (a stride-0 view of a tiny storage can declare 2**40
    elements, which the checks downstream would then compute over)."""
    return (
        len(args) in (6, 7)
        and type(args[0]) is _Stand
        and args[0].what == "storage"
        and type(args[1]) is int
        and _ints(args[2])
        and _ints(args[3])
        and all(x >= 0 for x in args[2])
        and math.prod(args[2]) <= max(args[0].n, 0)
    )


def _tensor_v3(args) -> bool:
    """torch.save's `_rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype[, metadata])`,
    what it writes for the dtypes that have no typed storage class (float8, uint16/32/64, complex32, float4, ...):
    an untyped storage (its size in bytes) and a dtype; the view's bytes no more than the storage's."""
    return (
        len(args) in (7, 8)
        and type(args[0]) is _Stand
        and args[0].what == "storage"
        and args[0].name == "UntypedStorage"
        and type(args[1]) is int
        and args[1] >= 0
        and _ints(args[2])
        and _ints(args[3])
        and all(x >= 0 for x in args[2])
        and type(args[6]) is _Stand
        and args[6].what == "dtype"
        and math.prod(args[2]) * args[6].n <= max(args[0].n, 0)
    )


class _EntryScan(pickle._Unpickler):
    """A dry run of a DCP entry's `data.pkl` (a `torch.save` pickle) that builds stand-ins instead of tensors:
    it admits only the calls `torch.save` writes for tensors and plain values, so the real `torch.load` that
    follows cannot reach `bytearray(n)`, `torch.FloatStorage(n)` or the legacy tensor constructors, which its
    `weights_only` set allows."""

    dispatch = dict(pickle._Unpickler.dispatch)
    for _op in pickletools.opcodes:
        if _op.name not in _SAFE_OPCODES | {"BINPERSID", "BINSTRING", "SHORT_BINSTRING"} or _op.name in (
            "NEWOBJ",
            "BUILD",
            "STACK_GLOBAL",
        ):
            dispatch[_op.code.encode("latin-1")[0]] = _refuse_opcode(_op.name)
    del _op

    def find_class(self, module, name):
        import torch

        if (module, name) in _BLOB_CALLS:
            return _Stand(f"{module}.{name}")
        if (module, name) in _SETS:
            return _Stand("builtins.set")
        if (
            module == "torch"
            and isinstance(name, str)
            and name.endswith("Storage")
            and isinstance(getattr(torch, name, None), type)
        ):
            return _Stand("storage_type", name=name)
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return _Stand("storage_type", name=name)
        if module == "torch" and _dtype_itemsize(name) is not None:
            return _Stand("dtype", _dtype_itemsize(name))
        raise RefusedPickle(f"refusing {clip(module, 80)}.{clip(name, 80)} in a DCP entry: not a tensor or plain value")

    def persistent_load(self, pid):
        if (
            type(pid) is tuple
            and len(pid) == 5
            and pid[0] == "storage"
            and type(pid[1]) is _Stand
            and pid[1].what == "storage_type"
            and type(pid[2]) is str
            and type(pid[3]) is str
            and type(pid[4]) is int
        ):
            return _Stand("storage", pid[4], pid[1].name)
        raise RefusedPickle("refusing a persistent id in a DCP entry: not a storage")

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        what = func.what if type(func) is _Stand else None
        ok = type(args) is tuple and (
            (what == "torch._utils._rebuild_tensor_v2" and _tensor_v2(args))
            or (what == "torch._utils._rebuild_tensor_v3" and _tensor_v3(args))
            or (what == "collections.OrderedDict" and args == ())
            or (
                what == "builtins.set"
                and (
                    args == ()
                    or (len(args) == 1 and type(args[0]) is list and all(type(x) in _SCALARS for x in args[0]))
                )
            )
            or (what in ("_codecs.encode", "torch.device") and all(type(a) is str for a in args) and len(args) <= 2)
        )
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
            type(k) in (str, int, float, bool, bytes, type(None)) for k in items[::2]
        ):
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
