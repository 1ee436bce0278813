"""`torch.save` into a file whose digest is taken from the bytes as they are written, for drop-ins whose framework
writes its checkpoint files with `torch.save` (DeepSpeed's TorchCheckpointEngine).

Why: digesting a file after writing it reads every byte back (a second pass over the bytes, from the page cache)
on the saving thread. Here every buffer `torch.save` hands to `write` is hashed (xxh3-128, streaming, the function
of format/digests.file_digest, whose chunking does not change the result) and then written, in order, to the file
opened for it: the digest is that of the file's bytes. What the disk does with them afterwards is load
verification's business, as for every file digest recorded at save: it re-hashes what is on disk.

Checked, not assumed: the file's size on disk after the write must equal the bytes hashed; a writer that seeks
(the stream is then not the file) is refused by this file object. Either way `save` falls back to writing the
file again and digesting it from disk (format/digests.digest_files), so the recorded digest is never of bytes
that are not the file's.
"""

from __future__ import annotations

import io
import os
from typing import IO, cast

import torch
import xxhash

from scout_ckpt.format.digests import ALGO, digest_files

__all__ = ["save"]


class _Digesting(io.RawIOBase):
    """A write-only, append-only file object over an open binary file: each buffer hashed, then written whole."""

    def __init__(self, raw) -> None:
        super().__init__()
        self._raw = raw
        self._hash = xxhash.xxh3_128()
        self.size = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.size

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        self._hash.update(view)
        self._raw.write(view)
        self.size += view.nbytes
        return view.nbytes

    def digest(self) -> str:
        return f"{ALGO}:{self._hash.hexdigest()}"


def save(obj, path: str | os.PathLike, **torch_save_kwargs) -> tuple[int, str]:
    """`torch.save(obj, path, **torch_save_kwargs)`; returns (size, "xxh3_128:hex") of the file written, as
    format/digests.file_digest would read it back (see the module docstring for the fallback)."""
    try:
        with open(path, "wb") as raw:
            f = _Digesting(raw)
            torch.save(obj, cast(IO[bytes], f), **torch_save_kwargs)
            raw.flush()
            on_disk = os.fstat(raw.fileno()).st_size
        if on_disk == f.size:
            return f.size, f.digest()
    except io.UnsupportedOperation:
        pass
    torch.save(obj, path, **torch_save_kwargs)  # the plain write, then its digest from disk
    return digest_files([path])[str(path)]
