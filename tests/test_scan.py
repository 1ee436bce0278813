"""certify's one streaming pass (scan.py): the same verdicts as hashing then reading every tensor back."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from scout_ckpt.certify import offline_invariants
from scout_ckpt.digests import digest_files, relpaths
from scout_ckpt.scan import StepScan
from scout_ckpt.verify import verify_files

SPECS = ["finite", "frobenius_sphere:radius=1.0:params=model.unit"]
INTERIOR = (3, 5)  # an element inside the tensor, not element 0


def _write(d: Path, poison: bool = False) -> tuple[list[dict], torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    g = torch.Generator().manual_seed(0)
    unit = torch.randn(20, 30, generator=g, dtype=torch.float64)
    unit /= torch.linalg.vector_norm(unit)
    w = torch.randn(16, 9, generator=g)
    if poison:
        w[INTERIOR] = float("nan")
    state = {"model": {"unit": unit, "w": w, "ids": torch.arange(7)}, "step": 4}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(str(d), thread_count=2), no_dist=True)
    rows = [{"path": p, "size": s, "digest": dg}
            for p, (s, dg) in ((p, digest_files([d / p])[str(d / p)]) for p in relpaths(d))]
    return rows, w


def test_clean_step_passes_and_matches_the_read_back(tmp_path):
    d = tmp_path / "step-1"
    rows, _ = _write(d)
    scan = StepScan(d, SPECS)
    assert verify_files(d, rows, hasher=scan.hasher)["status"] == "pass"
    assert scan.invariants() == offline_invariants(d, SPECS)
    assert scan.invariants()["checked"] == {"finite(*)": 2, "frobenius_sphere(model.unit)": 1}
    assert scan.direct == 3   # every tensor read straight from the file into its tensor


def test_a_byte_changed_inside_a_tensor_fails_the_digest(tmp_path):
    d = tmp_path / "step-1"
    rows, w = _write(d)
    target = w[INTERIOR].reshape(1).numpy().tobytes() + w.view(-1)[INTERIOR[0] * 9 + INTERIOR[1] + 1:][:3].numpy().tobytes()
    for p in d.glob("*.distcp"):
        data = bytearray(p.read_bytes())
        at = data.find(target)
        if at > 0:
            data[at + 1] ^= 0x10   # one bit of element (3, 5) of w
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
    assert verify_files(d, rows, hasher=scan.hasher)["status"] == "pass"   # the bytes are what was written
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
    verify_files(d, rows, hasher=scan.hasher)
    assert scan.invariants() is None
