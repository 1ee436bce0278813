"""certify's one streaming pass (scan.py): the same verdicts as hashing then reading every tensor back."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from scout_ckpt.format.digests import digest_files, relpaths
from scout_ckpt.format.scan import StepScan
from scout_ckpt.format.verify import verify_files
from scout_ckpt.ops.certify import offline_invariants

SPECS = ["finite", "frobenius_sphere:radius=1.0:params=model.unit"]
INTERIOR = (3, 5)  # an element inside the tensor, not element 0


def _write(d: Path, poison: bool = False, crc: bool = True) -> tuple[list[dict], torch.Tensor]:
    """crc=False writes as scout-ckpt's writer does: torch.save's per-record zip CRC32 left zero."""
    import contextlib

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from scout_ckpt.save.storage import _without_zip_crc

    g = torch.Generator().manual_seed(0)
    unit = torch.randn(20, 30, generator=g, dtype=torch.float64)
    unit /= torch.linalg.vector_norm(unit)
    w = torch.randn(16, 9, generator=g)
    if poison:
        w[INTERIOR] = float("nan")
    state = {"model": {"unit": unit, "w": w, "ids": torch.arange(7)}, "step": 4}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.nullcontext() if crc else _without_zip_crc():
            # the CRC option is per thread: without it, write in this thread as ScoutWriter does (thread_count=1)
            dcp.save(state, storage_writer=FileSystemWriter(str(d), thread_count=2 if crc else 1), no_dist=True)
    rows = [
        {"path": p, "size": s, "digest": dg}
        for p, (s, dg) in ((p, digest_files([d / p])[str(d / p)]) for p in relpaths(d))
    ]
    return rows, w


def _zip_crcs(d: Path) -> set[int]:
    """The CRC32 fields of every zip record in the step's data files (DCP appends one torch.save archive per
    tensor; the central directories are found by their signature, read without checking any CRC)."""
    import struct

    crcs = set()
    for p in d.glob("*.distcp"):
        data = p.read_bytes()
        at = data.find(b"PK\x01\x02")
        while at >= 0:
            crcs.add(struct.unpack("<I", data[at + 16 : at + 20])[0])
            at = data.find(b"PK\x01\x02", at + 4)
    return crcs


@pytest.mark.parametrize("crc", [True, False], ids=["zip_crc", "no_zip_crc"])
def test_clean_step_passes_and_matches_the_read_back(tmp_path, crc):
    d = tmp_path / "step-1"
    rows, _ = _write(d, crc=crc)
    assert (_zip_crcs(d) == {0}) is not crc  # what the writer wrote, read independently of the scanner
    scan = StepScan(d, SPECS)
    assert verify_files(d, rows, hasher=scan.hasher)["status"] == "pass"
    assert scan.invariants() == offline_invariants(d, SPECS)
    assert scan.invariants()["checked"] == {"finite(*)": 2, "frobenius_sphere(model.unit)": 1}
    assert scan.direct == 3  # every tensor read straight from the file into its tensor


@pytest.mark.parametrize("crc", [True, False], ids=["zip_crc", "no_zip_crc"])
def test_a_byte_changed_inside_a_tensor_fails_the_digest(tmp_path, crc):
    d = tmp_path / "step-1"
    rows, w = _write(d, crc=crc)
    target = (
        w[INTERIOR].reshape(1).numpy().tobytes() + w.view(-1)[INTERIOR[0] * 9 + INTERIOR[1] + 1 :][:3].numpy().tobytes()
    )
    for p in d.glob("*.distcp"):
        data = bytearray(p.read_bytes())
        at = data.find(target)
        if at > 0:
            data[at + 1] ^= 0x10  # one bit of element (3, 5) of w
            p.write_bytes(bytes(data))
            break
    else:
        pytest.fail("tensor bytes not found")
    scan = StepScan(d, SPECS)
    ev = verify_files(d, rows, hasher=scan.hasher)
    assert ev["status"] == "fail"
    assert [r["code"] for r in ev["reasons"]] == ["digest_mismatch"]


def test_a_non_finite_interior_element_fails_the_invariants_from_the_same_read(tmp_path):
    d = tmp_path / "step-1"
    rows, _ = _write(d, poison=True)
    scan = StepScan(d, SPECS)
    assert verify_files(d, rows, hasher=scan.hasher)["status"] == "pass"  # the bytes are what was written
    inv = scan.invariants()
    assert inv["status"] == "fail"
    bad = [r for r in inv["reasons"] if r["check"] == "finite"]
    assert [r["tensor"] for r in bad] == ["model.w"] and bad[0]["index"] == INTERIOR[0] * 9 + INTERIOR[1]
    assert inv == offline_invariants(d, SPECS)


def test_bad_metadata_leaves_the_read_back_path_to_report(tmp_path):
    d = tmp_path / "step-1"
    rows, _ = _write(d)
    (d / ".metadata").write_bytes(b"not a pickle")
    scan = StepScan(d, SPECS)
    ev = verify_files(d, rows, hasher=scan.hasher)
    # the bytes verdict is the scan's own: .metadata is not what was written (12 bytes for the recorded size),
    # the same verdict as hashing alone
    assert ev["status"] == "fail" and [(r["code"], r["file"]) for r in ev["reasons"]] == [
        ("truncated_file", ".metadata")
    ], ev
    assert ev == verify_files(d, rows)
    assert scan.invariants() is None


# ---- the fast path: tensors larger than a read piece are checked piece by piece, never held whole -------------


def _save(d: Path, state: dict) -> list[dict]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(str(d), thread_count=1), no_dist=True)
    return [
        {"path": p, "size": s, "digest": dg}
        for p, (s, dg) in ((p, digest_files([d / p])[str(d / p)]) for p in relpaths(d))
    ]


def _last_in_its_file(d: Path) -> str:
    from scout_ckpt.format.dcp_files import load_metadata

    md = load_metadata(d)
    return max(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset))[0].fqn


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_a_non_finite_last_element_of_the_last_tensor_of_a_large_file_is_caught(tmp_path, bad):
    from scout_ckpt.format import scan as scan_mod

    per_piece = scan_mod.PIECE // 4
    n = 2 * per_piece + 12345  # three pieces, the last one partial
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(n // 1024, 1024, generator=g), torch.randn(n, generator=g)
    b[-1] = bad  # the oracle: this tensor, this element
    d = tmp_path / "step-1"
    rows = _save(d, {"a": a, "b": b})
    assert _last_in_its_file(d) == "b"  # DCP writes in state-dict order: b is the file's last bytes
    scan = StepScan(d, ["finite"])
    assert verify_files(d, rows, hasher=scan.hasher)["status"] == "pass"
    assert scan.streamed == 2  # both went through the piece-by-piece path
    inv = scan.invariants()
    assert inv["status"] == "fail"
    [r] = inv["reasons"]
    assert r["tensor"] == "b" and r["index"] == b.numel() - 1 and r["value"] == 1.0


def test_invariant_violations_at_interior_piece_boundaries_are_caught(tmp_path):
    from scout_ckpt.format import scan as scan_mod

    per_piece = scan_mod.PIECE // 4
    g = torch.Generator().manual_seed(2)
    unit = torch.randn(2 * per_piece, generator=g, dtype=torch.float32)
    unit /= float(torch.linalg.vector_norm(unit, dtype=torch.float64))
    unit[per_piece] = 0.5  # first element of the second piece: the norm leaves the sphere
    w = torch.randn(per_piece + 99, generator=g)
    w[per_piece - 1] = float("nan")  # last element of the first piece
    w[per_piece] = float("inf")  # first element of the second (partial) one
    d = tmp_path / "step-1"
    rows = _save(d, {"unit": unit, "w": w})
    specs = ["finite", "frobenius_sphere:radius=1.0:params=unit"]
    scan = StepScan(d, specs)
    assert verify_files(d, rows, hasher=scan.hasher)["status"] == "pass"
    assert scan.streamed == 2
    inv = scan.invariants()
    assert inv["status"] == "fail"
    by = {(r["check"], r["tensor"]): r for r in inv["reasons"]}
    assert set(by) == {("finite", "w"), ("frobenius_sphere", "unit")}
    assert by[("finite", "w")]["index"] == per_piece - 1 and by[("finite", "w")]["value"] == 2.0
    norm = float(torch.linalg.vector_norm(unit, dtype=torch.float64))  # the constructed tensor's norm
    assert norm > 1.001 and by[("frobenius_sphere", "unit")]["value"] == pytest.approx(norm, rel=1e-6)
    # the read-back path agrees on everything but the Frobenius value's last digits
    back = offline_invariants(d, specs)
    assert [(r["check"], r["tensor"], r.get("index")) for r in back["reasons"]] == [
        (r["check"], r["tensor"], r.get("index")) for r in inv["reasons"]
    ]


def _stream_vs_offline(specs, name, full, chunks, piece):
    """Feed `full` to a TensorStream chunk by chunk (reverse order), `piece` elements at a time."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from scout_ckpt.invariants import parse_specs, run_offline
    from scout_ckpt.invariants.stream import Scratch, TensorStream

    checks = parse_specs(specs)
    st = TensorStream(checks, name, full.dtype, tuple(full.shape))
    scratch = Scratch()
    for offsets, sizes in reversed(chunks):
        part = full
        for dim, (o, s) in enumerate(zip(offsets, sizes)):
            part = part.narrow(dim, o, s)
        flat = part.contiguous().reshape(-1)
        meta = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        for start in range(0, flat.numel(), piece):
            st.update(flat[start : start + piece], scratch, start, meta)
    assert st.done
    return st.evidence(), run_offline(checks, {name: full})


def test_stream_matches_run_offline_on_sharded_chunks_and_extreme_values():
    specs = ["finite", "frobenius_sphere:radius=1.0:params=m"]
    g = torch.Generator().manual_seed(3)
    full = torch.randn(6, 10, generator=g)
    full /= float(torch.linalg.vector_norm(full, dtype=torch.float64))
    chunks = [((0, 0), (3, 5)), ((0, 5), (3, 5)), ((3, 0), (3, 10))]
    ev, off = _stream_vs_offline(specs, "m", full, chunks, piece=7)
    assert ev["status"] == off["status"] == "pass"
    full[1, 7] = float("nan")
    full[4, 2] = float("inf")
    ev, off = _stream_vs_offline(specs, "m", full, chunks, piece=4)
    assert ev["status"] == off["status"] == "fail"

    def strip(e):
        return [{k: v for k, v in r.items() if k != "value" or r["check"] == "finite"} for r in e["reasons"]]

    assert strip(ev) == strip(off) and ev["reasons"][0]["index"] == 17 and ev["checked"] == off["checked"]
    # float32 squares overflow (1e20 ** 2): the piece is redone in float64 and passes like the read-back
    big = torch.full((64,), 1e20)
    specs = ["finite", f"frobenius_sphere:radius={8e20!r}:params=m"]
    ev, off = _stream_vs_offline(specs, "m", big, [((0,), (64,))], piece=16)
    assert ev["status"] == off["status"] == "pass"
    # finite values whose sum overflows float32 are still finite
    huge = torch.full((64,), 3e38)
    ev, off = _stream_vs_offline(["finite"], "m", huge, [((0,), (64,))], piece=16)
    assert ev["status"] == off["status"] == "pass"
    # bf16: squares are taken in float32 (a bf16 square keeps 8 bits), so the norm is the read-back's
    half = (torch.randn(1000, generator=g) / 1000**0.5).to(torch.bfloat16)
    r = float(torch.linalg.vector_norm(half, dtype=torch.float64))
    ev, off = _stream_vs_offline(
        [f"frobenius_sphere:radius={r!r}:rtol=1e-6:params=m"], "m", half, [((0,), (1000,))], piece=100
    )
    assert ev["status"] == off["status"] == "pass"


def test_the_scan_leaves_the_callers_torch_threads_as_they_were(tmp_path):
    d = tmp_path / "step-1"
    rows, _ = _write(d)
    before = torch.get_num_threads()
    scan = StepScan(d, SPECS)
    assert verify_files(d, rows, hasher=scan.hasher)["status"] == "pass"
    import threading

    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert torch.get_num_threads() == before and seen == [before]
