"""Light stand-ins for the classes DCP pickles into `.metadata`, so that reading it needs no torch.

`FileSystemWriter` pickles `torch.distributed.checkpoint.metadata.Metadata` and friends, `torch.Size`, dtypes and
layouts into `.metadata`. Importing those classes costs about 2 s on top of `import torch` (DCP pulls in DTensor
ops, sympy, ...), which made `scout-ckpt certify` on a tiny checkpoint a 7 s command. Every reader of the metadata
here (`dcp_files`, certify's one-pass scanner, `export`, `adopt`) only looks at the fields, and none hands the
metadata back to DCP, so the restricted unpickler (`dcp_pickle`) builds these instead: dataclasses with the fields
DCP 2.13 writes (same names, same defaults, `MetadataIndex` hashed and compared over `(fqn, offset)` as DCP's
is), `Size` (a tuple), `DType` and `Layout` (a name, an element size). `torch_dtype` turns a `DType` into the
torch dtype for the readers that build tensors (they import torch anyway). The tables were taken from torch 2.13
(`tests/test_hostile_input.py` checks them against the installed torch).

Megatron-Core's torch_dist writer (megatron-core 0.16.1, `strategies/state_dict_saver.py`) also pickles the
ranks' local save plans into the metadata it writes (`global_metadata.all_local_plans`, a list of DCP
`SavePlan`s of `WriteItem`s), to reuse them at the next save: `Metadata.all_local_plans` and the planner
stand-ins below hold them; no reader here uses them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

# canonical dtype name (what `torch.dtype.__reduce__` pickles) -> element size in bytes
DTYPE_ITEMSIZE = {
    "bfloat16": 2,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    "bits8": 1,
    "bool": 1,
    "complex128": 16,
    "complex32": 4,
    "complex64": 8,
    "float16": 2,
    "float32": 4,
    "float4_e2m1fn_x2": 1,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int1": 1,
    "int16": 2,
    "int2": 1,
    "int3": 1,
    "int32": 4,
    "int4": 1,
    "int5": 1,
    "int6": 1,
    "int64": 8,
    "int7": 1,
    "int8": 1,
    "qint32": 4,
    "qint8": 1,
    "quint2x4": 1,
    "quint4x2": 1,
    "quint8": 1,
    "uint1": 1,
    "uint16": 2,
    "uint2": 1,
    "uint3": 1,
    "uint32": 4,
    "uint4": 1,
    "uint5": 1,
    "uint6": 1,
    "uint64": 8,
    "uint7": 1,
    "uint8": 1,
}
# torch's public aliases of those (a pickle may name `torch.float`; the unpickler admitted every public dtype)
DTYPE_ALIASES = {
    "bit": "uint1",
    "cdouble": "complex128",
    "cfloat": "complex64",
    "chalf": "complex32",
    "double": "float64",
    "float": "float32",
    "half": "float16",
    "int": "int32",
    "long": "int64",
    "short": "int16",
}
# str(layout) for every torch.layout (what torch.serialization._get_layout is called with)
LAYOUTS = (
    "torch._mkldnn",
    "torch.jagged",
    "torch.sparse_bsc",
    "torch.sparse_bsr",
    "torch.sparse_coo",
    "torch.sparse_csc",
    "torch.sparse_csr",
    "torch.strided",
)


class Size(tuple):
    """torch.Size as the metadata uses it: a tuple of ints."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Size({list(self)!r})"


class DType:
    """A torch dtype by name: what the metadata's TensorProperties.dtype holds here."""

    __slots__ = ("name", "itemsize")

    def __init__(self, name: str, itemsize: int):
        self.name, self.itemsize = name, itemsize

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    def __reduce__(self):
        return (dtype, (self.name,))


class Layout:
    """A torch layout by name ("torch.strided")."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


_DTYPES = {n: DType(n, s) for n, s in DTYPE_ITEMSIZE.items()}
_LAYOUTS = {n: Layout(n) for n in LAYOUTS}
STRIDED = _LAYOUTS["torch.strided"]


def dtype(name: str) -> DType | None:
    """The DType a pickle's `torch.<name>` global names (aliases included), or None if it is not a dtype."""
    return _DTYPES.get(DTYPE_ALIASES.get(name, name))


def _get_layout(name: str) -> Layout:
    """torch.serialization._get_layout's stand-in: KeyError for a name that is no layout, as torch's."""
    return _LAYOUTS[name]


def torch_dtype(d: DType):
    """The torch dtype of a DType (imports torch: for the readers that build tensors)."""
    import torch

    out = getattr(torch, d.name)
    assert isinstance(out, torch.dtype)
    return out


class _MEM_FORMAT_ENCODING(enum.Enum):
    """DCP's encoding of a tensor's memory format (TensorProperties pickles it instead of the format)."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


@dataclass
class ChunkStorageMetadata:
    offsets: Size
    sizes: Size


@dataclass
class TensorProperties:
    dtype: DType = field(default_factory=lambda: _DTYPES["float32"])
    layout: Layout = STRIDED
    requires_grad: bool = False
    memory_format: Any = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT  # the encoding, not a torch format
    pin_memory: bool = False

    def __setstate__(self, state) -> None:
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: Size
    chunks: list


@dataclass
class BytesStorageMetadata:
    pass


@dataclass
class StorageMeta:
    checkpoint_id: Any = None
    save_id: Any = None
    load_id: Any = None
    modules: list = field(default_factory=list)


@dataclass
class Metadata:
    state_dict_metadata: dict
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: Any = None
    all_local_plans: Any = None  # Megatron-Core's torch_dist writer only (see the module docstring)


@dataclass(frozen=True)
class MetadataIndex:
    """The key of `Metadata.storage_data`: hashed and compared over (fqn, offset), as DCP's."""

    fqn: str
    offset: Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)

    def __init__(self, fqn: str, offset=None, index: int | None = None):
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "index", index)
        if offset is not None:
            object.__setattr__(self, "offset", Size(offset))


@dataclass
class _StorageInfo:
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


# ---- DCP's planner classes, as Megatron-Core's all_local_plans holds them ------------------------------------


class WriteItemType(enum.Enum):
    """torch.distributed.checkpoint.planner.WriteItemType (enum.auto values)."""

    TENSOR = 1
    SHARD = 2
    BYTE_IO = 3


@dataclass(frozen=True)
class BytesIOWriteData:
    nbytes: int


@dataclass(frozen=True)
class TensorWriteData:
    chunk: ChunkStorageMetadata
    properties: TensorProperties
    size: Size


@dataclass(frozen=True)
class WriteItem:
    index: MetadataIndex
    type: WriteItemType
    bytes_io_data: BytesIOWriteData | None = None
    tensor_data: TensorWriteData | None = None


@dataclass(frozen=True)
class SavePlan:
    items: list
    storage_data: Any = None
    planner_data: Any = None
    usable: bool = True
