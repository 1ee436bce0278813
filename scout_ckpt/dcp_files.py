"""Reading DCP checkpoint folders offline, without a process group and without trusting them.

DCP's `.metadata` is a pickle, and `FileSystemReader.read_metadata` hands it to `pickle.load`: a crafted file
runs code. `load_metadata` uses an unpickler that admits only the classes DCP 2.13 actually pickles there
(listed by recording `find_class` on real checkpoints) and refuses everything else before it is constructed.
Tensor and bytes entries are DCP `torch.save` blobs; `read_tensors` opens them with `weights_only=True`, so no
step of an offline certify runs torch's unrestricted unpickler.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

from scout_ckpt.errors import BadInput
from scout_ckpt.layout import DCP_METADATA
from scout_ckpt.policy import FAIL, PASS, evidence

_META = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, set[str]] = {
    _META: {"Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
            "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},   # maps a layout's name ("torch.strided") to the layout object
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},   # storage_meta.checkpoint_id
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "int", "float", "complex", "str", "bytes",
                 "bytearray", "bool", "slice"},
}
DISTCP_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


class RefusedPickle(BadInput):
    """The `.metadata` pickle names a class outside the DCP metadata set."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch":
            import torch

            obj = getattr(torch, name, None)
            if name == "Size" or isinstance(obj, torch.dtype):
                return obj
        elif name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise RefusedPickle(f"refusing to unpickle {module}.{name} from .metadata: not a DCP metadata class")


def load_metadata(path: str | os.PathLike):
    """DCP Metadata from a step dir (or a `.metadata` file), via the restricted unpickler. BadInput if refused,
    unreadable or not DCP Metadata."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    if path.is_dir():
        path = path / DCP_METADATA
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except RefusedPickle:
        raise
    except FileNotFoundError:
        raise BadInput(f"{path}: no DCP .metadata") from None
    except Exception as e:  # truncated or garbage pickle, or a constructor rejecting its arguments
        raise BadInput(f"{path}: unreadable DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise BadInput(f"{path}: not DCP metadata (a {type(md).__name__})")
    if not isinstance(md.storage_data, dict):
        raise BadInput(f"{path}: DCP metadata without storage_data (not written by FileSystemWriter)")
    return md


def ranks_of(step_dir: str | os.PathLike) -> list[int]:
    """The ranks that wrote `__R_I.distcp` files in a step dir."""
    return sorted({int(m.group(1)) for n in os.listdir(step_dir) if (m := DISTCP_RE.match(n))})


def check_structure(step_dir: str | os.PathLike) -> dict:
    """Evidence that the metadata is loadable and every storage entry lies inside an existing file."""
    step_dir = Path(step_dir)
    try:
        md = load_metadata(step_dir)
    except BadInput as e:
        code = "bad_metadata" if (step_dir / DCP_METADATA).exists() else "missing_file"
        return evidence(FAIL, [{"code": code, "file": DCP_METADATA, "detail": str(e)}])
    reasons: list[dict] = []
    need: dict[str, int] = {}
    for idx, info in md.storage_data.items():
        rel = getattr(info, "relative_path", None)
        off, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(rel, str) or not isinstance(off, int) or not isinstance(length, int) or off < 0 \
                or length < 0 or Path(rel).is_absolute() or ".." in Path(rel).parts:
            reasons.append({"code": "bad_metadata", "file": DCP_METADATA, "detail": f"bad storage entry {idx}"})
            continue
        need[rel] = max(need.get(rel, 0), off + length)
    from torch.distributed.checkpoint.metadata import MetadataIndex

    for fqn, item in md.state_dict_metadata.items():
        for chunk in getattr(item, "chunks", []):
            if MetadataIndex(fqn, chunk.offsets) not in md.storage_data:
                reasons.append({"code": "bad_metadata", "file": DCP_METADATA,
                                "detail": f"{fqn} chunk at {list(chunk.offsets)} has no storage entry"})
    for rel, end in sorted(need.items()):
        try:
            size = os.stat(step_dir / rel).st_size
        except FileNotFoundError:
            reasons.append({"code": "missing_file", "file": rel})
            continue
        if size < end:
            reasons.append({"code": "truncated_file", "file": rel, "size": size, "needed": end})
    return evidence(FAIL if reasons else PASS, reasons, files=len(need), entries=len(md.storage_data))


def _load_blob(stream):
    import torch

    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as e:
        raise BadInput(f"unreadable DCP entry ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


def read_tensors(step_dir: str | os.PathLike, prefix: str | None = None, *, include_bytes: bool = False,
                 metadata=None) -> dict[str, Any]:
    """Full tensors {fqn: Tensor} (and, with include_bytes, plain values such as a saved `step` int) of a step
    dir, without a process group. Call after check_structure (and, for trust, after the digests matched)."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
    from torch.distributed.checkpoint.utils import _create_file_view   # what FileSystemReader reads through

    step_dir = Path(step_dir)
    md = metadata if metadata is not None else load_metadata(step_dir)
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
        with open(step_dir / rel, "rb") as f:
            for off, length, fqn, chunk, info in sorted(items, key=lambda x: x[0]):
                if getattr(info, "transform_descriptors", None):
                    raise BadInput(f"{step_dir / rel}: {fqn} is stored with transforms "
                                   f"{list(info.transform_descriptors)}; not supported offline")
                value = _load_blob(_create_file_view(f, off, length))   # one copy: page cache -> tensor
                if chunk is None:
                    out[fqn] = value
                    continue
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(chunk.sizes):
                    raise BadInput(f"{step_dir / rel}: {fqn} chunk does not match its metadata")
                dst = out[fqn]
                if tuple(dst.shape) == tuple(value.shape) and value.dtype == dst.dtype and value.is_contiguous():
                    out[fqn] = value      # the chunk is the whole tensor: keep it, skip a copy
                    continue
                for d, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes)):
                    dst = dst.narrow(d, o, n)
                dst.copy_(value)
    return out
