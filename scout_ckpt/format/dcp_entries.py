"""Opening one DCP storage entry (a `torch.save` archive inside a `.distcp` file) without trusting it.

Split from `dcp_files` (the `.metadata` loader and the folder-level structure checks) because two readers need
exactly this and nothing else: `dcp_files.read_tensors` (the read-back) and certify's one-pass scanner
(`scan.py`), which reads each entry from its own buffer and must refuse exactly what the read-back refuses.

An entry's inner pickle is dry-run first (`dcp_pickle._EntryScan`: torch's `weights_only` set still admits
`bytearray` and the legacy `torch.FloatTensor(n)` constructors, which allocate by argument), then opened with
`torch.load(weights_only=True)` (`load_entry`). `tensor_layout` makes the same dry run and says where a plain
tensor's one storage lies in the entry, so the scanner can hash and check those bytes where it reads them
instead of going through `torch.load`.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import struct
import zipfile

from scout_ckpt.errors import BadInput
from scout_ckpt.format.dcp_pickle import BadMetadata, RefusedPickle, _EntryScan
from scout_ckpt.format.safepaths import clip


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


def _stored(window: _Window, info) -> bytes:
    """A stored member's bytes, read after its local header. Not zipfile's read, which also checks the CRC32: a
    scout-ckpt writer leaves it zero (storage._without_zip_crc; torch.load never checks it, the file digests
    cover every byte)."""
    window.seek(info.header_offset)
    head = window.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile("bad local header")
    n_name, n_extra = struct.unpack("<HH", head[26:30])
    window.seek(info.header_offset + 30 + n_name + n_extra)
    data = window.read(info.file_size)
    if len(data) != info.file_size:
        raise zipfile.BadZipFile("truncated member")
    return data


def _archive(window: _Window, length: int):
    """(zip, its members by name, the data.pkl member, data.pkl's bytes) of an entry; RefusedPickle if the zip is
    not what `torch.save` writes (one data.pkl, stored, no duplicate names)."""
    try:
        z = zipfile.ZipFile(window)
        infos = z.infolist()
        pkls = [i for i in infos if i.filename == "data.pkl" or i.filename.endswith("/data.pkl")]
        if len(pkls) != 1 or len({i.filename for i in infos}) != len(infos):
            raise RefusedPickle("not a torch.save archive (no single data.pkl, or duplicate names)")
        info = pkls[0]
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > length:
            raise RefusedPickle("compressed or oversized data.pkl")
        return z, {i.filename: i for i in infos}, info, _stored(window, info)
    except BadInput:
        raise
    except Exception as e:
        raise RefusedPickle(f"not a torch.save archive ({type(e).__name__})") from None
    finally:
        window.seek(0)


def _dry_run(scanner) -> object:
    try:
        return scanner.load()
    except BadInput:
        raise
    except Exception as e:
        raise RefusedPickle(f"malformed entry pickle ({type(e).__name__})") from None


def _scan_entry(window: _Window, length: int) -> None:
    """Refuse an entry whose zip or inner pickle is not what `torch.save` writes for a tensor or plain value."""
    _dry_run(_EntryScan(io.BytesIO(_archive(window, length)[3])))


def load_entry(f, offset: int, length: int):
    """The tensor or plain value stored as bytes [offset, offset + length) of `f` (any seekable binary file with
    readinto), dry-run first (`_scan_entry`), then opened with `weights_only=True`. BadInput (BadMetadata or
    RefusedPickle) if refused."""
    import torch

    window = _Window(f, offset, length)
    _scan_entry(window, length)
    try:
        return torch.load(window, map_location="cpu", weights_only=True)
    except Exception as e:
        raise BadMetadata(
            f"unreadable DCP entry ({type(e).__name__}: {clip(str(e).splitlines()[0] if str(e) else '', 200)})"
        ) from None


# ---- where a tensor entry's bytes lie (certify's one pass reads them straight into the tensor) --------------------


class _LayoutScan(_EntryScan):
    """The entry dry run (`_EntryScan`, every refusal kept) recording the storage and the view it builds."""

    dispatch = dict(_EntryScan.dispatch)

    def __init__(self, f):
        super().__init__(f)
        self.types: list[str] = []
        self.storages: list[tuple] = []
        self.rebuilds: list[tuple] = []
        self.built = None

    def find_class(self, module, name):
        out = super().find_class(module, name)
        if getattr(out, "what", None) == "storage_type":
            self.types.append(name)
        return out

    def persistent_load(self, pid):
        out = super().persistent_load(pid)
        self.storages.append((pid[2], pid[4]))
        return out

    def load_reduce(self):
        args, func = self.stack[-1], self.stack[-2]
        _EntryScan.load_reduce(self)
        if getattr(func, "what", None) == "torch._utils._rebuild_tensor_v2":
            self.rebuilds.append((args[1], tuple(args[2]), tuple(args[3])))
            self.built = self.stack[-1]

    dispatch[pickle.REDUCE[0]] = load_reduce


def tensor_layout(f, offset: int, length: int) -> dict | None:
    """Where the one storage of a tensor entry lies, for a reader that fills a tensor straight from the file
    instead of going through `torch.load`: {"start" (bytes from the entry's start), "nbytes", "storage_type"
    (e.g. "FloatStorage"), "storage_offset", "size", "stride"}; None when the entry is anything else (a plain
    value, several storages, a big-endian archive, a compressed member), so the caller uses `load_entry`.
    BadInput if the entry is refused (the same dry run as `load_entry`)."""
    window = _Window(f, offset, length)
    z, infos, pkl_info, data = _archive(window, length)
    found = _pickle_layout(data)  # the dry run (refusals raise), once per distinct data.pkl
    try:
        if found is None:
            return None
        prefix = pkl_info.filename[: -len("data.pkl")]
        order = infos.get(prefix + "byteorder")
        if order is not None and _stored(window, order) != b"little":
            return None
        storage_type, key, (storage_offset, size, stride) = found
        info = infos.get(f"{prefix}data/{key}")
        if info is None or info.compress_type != zipfile.ZIP_STORED:
            return None
        window.seek(info.header_offset)
        head = window.read(30)
        if len(head) != 30 or head[:4] != b"PK\x03\x04":
            return None
        n_name, n_extra = struct.unpack("<HH", head[26:30])
        start = info.header_offset + 30 + n_name + n_extra
        if start + info.file_size > length:
            return None
        return {
            "start": start,
            "nbytes": info.file_size,
            "storage_type": storage_type,
            "storage_offset": storage_offset,
            "size": size,
            "stride": stride,
        }
    except BadInput:
        raise
    except Exception:  # anything unexpected: the caller takes the torch.load path, which reports it
        return None
    finally:
        window.seek(0)


@functools.lru_cache(maxsize=1024)
def _pickle_layout(data: bytes):
    """(storage type name, storage key, (storage offset, size, stride)) of a data.pkl that rebuilds one tensor
    over one storage, None for any other admitted pickle; RefusedPickle as `_scan_entry`. A pure function of the
    bytes, so cached: DCP writes the same data.pkl for every tensor of one dtype and shape, and a checkpoint of
    many small tensors would otherwise spend most of its time in the pure-Python dry run (refusals raise and are
    not cached)."""
    scan = _LayoutScan(io.BytesIO(data))
    result = _dry_run(scan)
    if result is not scan.built or len(scan.storages) != 1 or len(scan.rebuilds) != 1 or len(scan.types) != 1:
        return None
    return scan.types[0], scan.storages[0][0], scan.rebuilds[0]
