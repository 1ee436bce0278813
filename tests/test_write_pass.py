"""What the writer computes from the bytes as they pass through (scout_ckpt/save/write_pass.py): one process, real DCP
files; every expected value is computed here from the tensors or the files on disk, not by the code under test."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

from scout_ckpt.consensus.in_flight import InFlightDigests, written_key
from scout_ckpt.save.storage import ScoutWriter
from scout_ckpt.save.write_pass import PIECE, WritePass


def _row_major(t: torch.Tensor) -> int:
    t = t.contiguous()
    return (
        xxhash.xxh3_128_intdigest(t.view(torch.uint8).numpy().tobytes())
        if t.dtype == torch.bfloat16
        else xxhash.xxh3_128_intdigest(t.numpy().tobytes())
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_file_digests_and_signatures_taken_in_one_pass(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(900, 700, generator=g)
    tied = torch.randn(300, 300, generator=g)
    state = {
        "big": torch.randn(1000, 700, generator=g),  # 2.7 MiB: three pieces
        "bf16": torch.randn(600, 700, generator=g).to(torch.bfloat16),
        "cols": torch.randn(500, 400, generator=g).t(),  # written in storage order
        "view": base[100:800],  # shares a larger storage: DCP clones it
        "tied_a": tied,
        "tied_b": tied,
        "small": torch.randn(10, generator=g),
        "step": 7,
    }
    wanted = [state[k] for k in ("big", "bf16", "cols", "view", "tied_a", "tied_b", "small")]
    in_flight = InFlightDigests()
    in_flight.want(wanted)
    writer = ScoutWriter(tmp_path, step=1)
    writer.in_flight = in_flight
    # Every file the writer writes is fsynced (the writer does it, not DCP), each after its last byte; the data
    # file says first that its flush begins (consensus hashes the rest in the flush's shadow).
    fsynced, real_fsync = [], os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        fsynced.append((os.path.basename(path), os.fstat(fd).st_size, in_flight.flushing.is_set()))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    try:
        dcp.save(state, storage_writer=writer)
    finally:
        in_flight.release()
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert in_flight.started.is_set() and in_flight.done.is_set()
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    data = [(n, size, flushing) for n, size, flushing in fsynced if n.endswith(".distcp")]
    assert data == [(n, sizes[n], True) for n in sorted(sizes) if n.endswith(".distcp")], (fsynced, sizes)
    assert any(n.startswith(".metadata") for n, _, _ in fsynced), fsynced  # DCP's metadata, before its rename
    # The file digests are those of the files on disk, read back here.
    digests = writer.file_digests()
    assert digests
    for name, (size, digest) in digests.items():
        data = (tmp_path / name).read_bytes()
        assert size == len(data) and digest == f"xxh3_128:{xxhash.xxh3_128_hexdigest(data)}"
    # Signed while written: the contiguous large tensors (tied ones share one memory), each the xxh3 of its
    # row-major bytes; never the transposed one (its storage order is not its row-major order), the cloned view,
    # or a small tensor (consensus hashes those itself).
    for k in ("big", "bf16", "tied_a", "tied_b"):
        assert in_flight.expects(state[k]) and in_flight.take(state[k]) == _row_major(state[k]), k
    for k in ("cols", "view", "small"):
        assert not in_flight.expects(state[k]) and in_flight.take(state[k]) is None, k
    assert state["big"].nbytes > 2 * PIECE
    assert writer.nonfinite == []


def test_a_registered_tensor_that_never_passed_through_is_reported_unseen():
    t = torch.randn(512, 512)
    key = written_key(t)
    work = WritePass(None, {key: [("w", t)]})
    assert [fqn for fqn, _ in work.unseen()] == ["w"]  # the writer then checks it itself


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("first", ["bf16", "f32"])
def test_aliases_of_one_storage_are_each_checked_in_their_own_dtype(tmp_path, first):
    """A bfloat16 tensor holding a NaN and a float32 `.view()` of the same storage: DCP writes the storage once
    per key, as one buffer each time. The NaN is the low half of a float32 element, so it reads as a finite
    float32: the writer checks the bytes as every dtype that views them and names exactly the bfloat16 key,
    once, whichever alias comes first."""
    a = torch.ones(1 << 17, dtype=torch.bfloat16)
    a[0] = float("nan")
    b = a.view(torch.float32)
    assert bool(torch.isfinite(b).all()) and b.nbytes == a.nbytes and written_key(a) == written_key(b)
    state = {"bad": a, "view": b} if first == "bf16" else {"view": b, "bad": a}
    writer = ScoutWriter(tmp_path, step=1)
    dcp.save(state, storage_writer=writer)
    assert writer.nonfinite == ["bad"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_large_complex_and_fp8_tensors_are_checked_as_they_are_written(tmp_path):
    """Non-floating to `is_floating_point` (complex) or without an isfinite kernel (float8_e4m3fn): the pieces of
    a large one are still checked, in an interior piece."""
    n = 3 * PIECE // 8
    c = torch.ones(n, dtype=torch.complex64)
    torch.view_as_real(c)[n // 2 + 1, 1] = float("-inf")  # an imaginary part, in the second piece
    f8 = torch.ones(3 * PIECE, dtype=torch.float32).to(torch.float8_e4m3fn)
    f8.view(torch.uint8)[PIECE + 5] = 0xFF  # e4m3fn's negative NaN
    ok = torch.ones(3 * PIECE, dtype=torch.float32).to(torch.float8_e4m3fn)
    ok.view(torch.uint8)[PIECE + 5] = 0x7E  # 448, the largest finite e4m3fn
    writer = ScoutWriter(tmp_path, step=1)
    dcp.save({"c": c, "f8": f8, "ok": ok}, storage_writer=writer)
    assert sorted(writer.nonfinite) == ["c", "f8"]


def test_the_file_digest_covers_writes_of_every_size_and_format(tmp_path):
    """Small writes gathered in the buffer, typed buffers, writes past the buffer and past PIECE without a tensor
    to sign: the running digest and size are those of the file on disk, read back here."""
    import numpy as np

    from scout_ckpt.save.write_pass import DigestingFileSystem

    fs = DigestingFileSystem(None, sync=False)
    g = np.random.default_rng(3)
    chunks = [
        b"PK\x03\x04",
        bytes(range(256)) * 3,
        np.arange(10_000, dtype=np.int32),
        g.integers(0, 255, 70_000, dtype=np.uint8),
        b"",
        memoryview(np.ones((40, 30), dtype=np.float64)),
        g.integers(0, 255, PIECE * 2 + 17, dtype=np.uint8),
        b"tail",
    ]
    path = tmp_path / "__0_0.distcp"
    with fs.create_stream(path, "wb") as f:
        for c in chunks:
            f.write(c)
    data = path.read_bytes()
    assert data == b"".join(memoryview(c).cast("B").tobytes() for c in chunks)
    assert fs.digests["__0_0.distcp"] == (len(data), f"xxh3_128:{xxhash.xxh3_128_hexdigest(data)}")


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 200])
def test_a_file_digest_is_that_of_every_byte_whatever_the_size_against_the_chunk(tmp_path, monkeypatch, size):
    """The read buffer is sized to the file (the coordinator reads .metadata back at every save): files smaller
    than, as large as and larger than a chunk (64 bytes here) hash to xxh3-128 of their bytes."""
    from scout_ckpt.format import digests

    monkeypatch.setattr(digests, "CHUNK", 64)
    data = os.urandom(size)
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    assert digests.file_digest(p) == (size, f"xxh3_128:{xxhash.xxh3_128_hexdigest(data)}")
