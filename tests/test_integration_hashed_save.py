"""integrations/hashed_save.py: the digest DeepSpeed's drop-in records while torch.save writes a file is the digest
of the file on disk (computed here with xxhash over the file's bytes, read back), in both of torch's
serializations; a byte changed after the write no longer matches it."""

from __future__ import annotations

import pytest
import torch
import xxhash

from scout_ckpt.integrations import hashed_save


def _on_disk(path) -> tuple[int, str]:
    data = path.read_bytes()
    return len(data), "xxh3_128:" + xxhash.xxh3_128_hexdigest(data)


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "module": {"w": torch.randn(300, 257, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)},
        "step": 12,
        "view": torch.arange(40, dtype=torch.float64)[5:20],  # a view: torch.save writes its whole storage
    }


@pytest.mark.parametrize("zipfile", [True, False])
def test_the_digest_taken_while_writing_is_the_files_digest(tmp_path, zipfile):
    path = tmp_path / "f.pt"
    size, digest = hashed_save.save(_state(), path, _use_new_zipfile_serialization=zipfile)
    assert (size, digest) == _on_disk(path)
    loaded = torch.load(path, weights_only=False)
    assert torch.equal(loaded["module"]["w"], _state()["module"]["w"])
    assert torch.equal(loaded["view"], _state()["view"])


def test_a_byte_changed_after_the_write_no_longer_matches_the_recorded_digest(tmp_path):
    path = tmp_path / "f.pt"
    size, digest = hashed_save.save(_state(), path)
    data = bytearray(path.read_bytes())
    data[size // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert _on_disk(path)[1] != digest
