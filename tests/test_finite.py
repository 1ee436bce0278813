"""One finite check, the same online (the DCP writer) and offline (`certify`'s scan, the invariants), correct for
every dtype DCP saves (scout_ckpt/invariants/finite.py).

The oracle here is computed from bit patterns with numpy integer arithmetic, from each format's definition
(exponent and mantissa fields), never with the code under test or torch's own isfinite."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.conftest import run_cli

# (exponent bits, mantissa bits, how NaN/Inf are encoded) of each floating format
FORMATS = {
    "float16": (5, 10, "ieee"),
    "bfloat16": (8, 7, "ieee"),
    "float32": (8, 23, "ieee"),
    "float64": (11, 52, "ieee"),
    "float8_e5m2": (5, 2, "ieee"),  # Inf: exponent all ones, mantissa 0; NaN: exponent all ones, mantissa != 0
    "float8_e4m3fn": (4, 3, "fn"),  # no Inf; NaN: exponent and mantissa all ones (0x7F, 0xFF)
    "float8_e4m3fnuz": (4, 3, "fnuz"),  # no Inf, no -0; NaN: sign set, all else zero (0x80)
    "float8_e5m2fnuz": (5, 2, "fnuz"),
    "float8_e8m0fnu": (8, 0, "e8m0"),  # unsigned exponent only; NaN: 0xFF
}
NEVER = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float4_e2m1fn_x2"]
COMPLEX = {"complex32": "float16", "complex64": "float32", "complex128": "float64"}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _oracle(name: str, bits: np.ndarray) -> np.ndarray:
    """Non-finite mask of unsigned bit patterns of a floating format, from its definition."""
    e, m, kind = FORMATS[name]
    width = bits.dtype.itemsize * 8
    bits = bits.astype(np.uint64)
    exp = (bits >> np.uint64(m)) & np.uint64((1 << e) - 1)
    man = bits & np.uint64((1 << m) - 1)
    if kind == "ieee":
        return exp == (1 << e) - 1
    if kind == "fn":
        return (exp == (1 << e) - 1) & (man == (1 << m) - 1)
    if kind == "fnuz":
        return bits == np.uint64(1 << (width - 1))
    return bits == np.uint64(0xFF)  # e8m0


def _patterns(name: str, rng) -> np.ndarray:
    """Every bit pattern of a 1- or 2-byte format; for wider ones the special patterns (every exponent-all-ones
    pattern with edge mantissas, zeros, the largest finite, the smallest subnormal, each with both signs) and
    random ones."""
    size = getattr(torch, name).itemsize
    u = UINT[size]
    if size <= 2:
        return np.arange(1 << (8 * size), dtype=np.uint64).astype(u)
    e, m, _ = FORMATS[name]
    top = ((1 << e) - 1) << m
    special = [0, 1, (1 << m) - 1, top, top | 1, top | (1 << (m - 1)), top | ((1 << m) - 1), top - 1]
    special += [s | (1 << (8 * size - 1)) for s in special]
    random = rng.integers(0, 1 << 63, size=4096, dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, 4096, np.uint64)
    return np.concatenate([np.array(special, dtype=np.uint64), random]).astype(u)


def _tensor(bits: np.ndarray, dtype) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.uint8).copy()).view(dtype)


def _cases():
    """[(dtype name, tensor, expected non-finite mask)] of every dtype DCP can save."""
    rng = np.random.default_rng(0)
    out = []
    for name in FORMATS:
        bits = _patterns(name, rng)
        out.append((name, _tensor(bits, getattr(torch, name)), _oracle(name, bits)))
    for name, part in COMPLEX.items():
        bits = _patterns(part, rng)
        re, im = rng.permutation(bits), rng.permutation(bits)
        pairs = np.stack([re, im], axis=1).reshape(-1)
        mask = _oracle(part, re) | _oracle(part, im)
        out.append((name, _tensor(pairs, getattr(torch, name)), mask))
    for name in NEVER:
        dtype = getattr(torch, name)
        n = 64
        raw = rng.integers(0, 2 if name == "bool" else 256, size=n * dtype.itemsize, dtype=np.uint8)
        out.append((name, torch.from_numpy(raw).view(dtype), np.zeros(n, dtype=bool)))
    return out


CASES = _cases()


def _first(mask: np.ndarray):
    idx = np.flatnonzero(mask)
    return int(idx[0]) if idx.size else None


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name,t,mask", CASES, ids=[c[0] for c in CASES])
def test_every_path_agrees_with_the_bit_oracle(name, t, mask):
    """The writer's check, the invariants' `finite` (live and offline) and certify's streamed check each give
    the oracle's answer for every bit pattern: count and first index of the non-finite elements."""
    from scout_ckpt.invariants import parse_specs, run_offline
    from scout_ckpt.invariants.finite import nonfinite, nonfinite_mask
    from scout_ckpt.invariants.stream import Scratch, TensorStream
    from scout_ckpt.save import storage

    bad, first = int(mask.sum()), _first(mask)
    assert bad == 0 or name not in NEVER
    assert storage.is_finite(t) == (bad == 0), name  # the writer's check
    assert np.array_equal(nonfinite_mask(t).numpy(), mask)
    assert nonfinite(t) == (bad, first)
    # the invariants' check (a float32 beside it, so that the check matches a tensor whatever t's dtype)
    ev = run_offline(parse_specs(["finite"]), {"t": t, "ref": torch.zeros(3)})
    got = [r for r in ev["reasons"] if r["code"] == "invariant_failed"]
    if bad:
        assert ev["status"] == "fail" and got[0]["value"] == bad and got[0]["index"] == first, ev
    else:
        assert ev["status"] == "pass" and not got, ev
    checks = parse_specs(["finite"])  # certify's streamed check
    st = TensorStream(checks, "t", t.dtype, tuple(t.shape))
    half = t.numel() // 2
    st.update(t[:half], Scratch(), 0)
    st.update(t[half:], Scratch(), half)
    assert st.done
    reasons = [r for r in st.evidence()["reasons"] if r["code"] == "invariant_failed"]
    assert [(r["value"], r["index"]) for r in reasons] == ([(bad, first)] if bad else [])


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name", [n for n in FORMATS] + list(COMPLEX))
def test_each_nonfinite_pattern_alone_in_a_large_tensor_is_found(name):
    """The fast paths (a sum, a masked reduction over the bytes) see every non-finite pattern on its own among
    finite elements; an all-finite tensor whose sum overflows is finite."""
    from scout_ckpt.save import storage

    dtype = getattr(torch, name)
    part = COMPLEX.get(name, name)
    rng = np.random.default_rng(1)
    bits = _patterns(part, rng)
    bad = _oracle(part, bits)
    finite = bits[~bad]
    fill = np.resize(finite, 1 << 16)
    if name in COMPLEX:
        fill = np.resize(finite, 2 << 16)
    assert storage.is_finite(_tensor(fill, dtype))  # the largest finite values included: sums overflow
    for p in bits[bad][:300]:
        arr = fill.copy()
        arr[len(arr) // 2 + 1] = p  # in a complex tensor: the imaginary part
        assert not storage.is_finite(_tensor(arr, dtype)), (name, hex(int(p)))


def test_every_dtype_dcp_can_save_has_a_rule():
    """Every dtype the DCP metadata reader knows (format/dcp_meta.py) is decided without raising."""
    from scout_ckpt.format.dcp_meta import DTYPE_ITEMSIZE
    from scout_ckpt.invariants.finite import is_finite

    for name in DTYPE_ITEMSIZE:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            continue
        try:
            t = (
                torch.zeros(8, dtype=torch.uint8).view(dtype)
                if dtype.itemsize == 1
                else torch.zeros(8 * dtype.itemsize, dtype=torch.uint8).view(dtype)
            )
        except (RuntimeError, TypeError):
            continue  # bits / sub-byte placeholders no tensor can be viewed as
        assert is_finite(t) is True, name


# ---- real saves: the writer's verdict and certify's ----------------------------------------------------------

CASES_SAVED = [
    "complex64-real",
    "complex128-imag",
    "alias-bf16-first",
    "alias-f32-first",
    "fp8-e4m3fn-7f",
    "fp8-e4m3fn-ff",
    "fp8-e5m2-7c",
    "fp8-e5m2-7f",
]


def test_the_writer_rejects_what_certify_rejects_for_every_dtype(tmp_path):
    """One real gloo rank saves through the Checkpointer, one step per case (the non-finite bytes in a small
    tensor, checked before the write, and in a large one, checked piece by piece as it is written), and last a
    healthy step holding every one of these dtypes. Each bad step is rejected by the writer with the finite
    reason naming exactly the bad keys; `scout-ckpt certify` agrees on every step, and the offline scan (what
    certify runs) finds the same keys in the files."""
    from scout_ckpt.format.layout import list_step_dirs
    from scout_ckpt.format.scan import StepScan
    from scout_ckpt.testing.launch import run_ranks
    from tests import workers_finite as W

    root = tmp_path / "run"
    out = run_ranks(W.save_cases, 1, str(root), CASES_SAVED, timeout=240)[0].result
    for step, case in enumerate(CASES_SAVED, start=1):
        v = out[case]
        assert v.get("state") == "rejected", (case, v)
        finite = [r for r in v["reasons"] if r["code"] == "invariant_failed" and r["check"] == "finite"]
        assert len(finite) == 1 and finite[0]["ranks"] == [0], (case, v)
        assert sorted(finite[0]["tensors"]) == sorted(f"x.{k}" for k in W.bad_keys(case)), (case, v)
    assert out["healthy"]["state"] == "certified", out["healthy"]
    # certify: the rejected steps stay rejected with the same reasons, the healthy one (fp8 and complex entries
    # read back by the offline readers) is re-verified and stays certified
    rc, stdout, stderr = run_cli("certify", root, "--json")
    assert rc == 1, (rc, stdout, stderr)
    results = {r["step"]: r for r in json.loads(stdout)["results"]}
    for step, case in enumerate(CASES_SAVED, start=1):
        assert results[step]["state"] == "rejected", (case, results[step])
    healthy = results[len(CASES_SAVED) + 1]
    assert healthy["state"] == "certified" and "skipped" not in healthy, healthy
    # the offline scan of the same files, whatever the ledger says: the same keys are not finite
    dirs = list_step_dirs(root)
    for step, case in enumerate(CASES_SAVED, start=1):
        scan = StepScan(dirs[step], ["finite"])
        scan.hasher(sorted(os.path.realpath(p) for p in dirs[step].iterdir() if p.name.endswith(".distcp")))
        inv = scan.invariants()
        assert inv is not None and inv["status"] == "fail", (case, inv)
        named = sorted(r["tensor"] for r in inv["reasons"] if r["code"] == "invariant_failed")
        assert named == sorted(f"x.{k}" for k in W.bad_keys(case)), (case, inv)


def _saved(t: torch.Tensor) -> dict:
    """{member name: bytes} of torch.save(t)."""
    import io
    import zipfile

    buf = io.BytesIO()
    torch.save(t, buf)
    z = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    return {n: z.read(n) for n in z.namelist()}


def _archive(members: dict) -> bytes:
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for n, b in members.items():
            z.writestr(n, b)
    return buf.getvalue()


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "uint16", "complex32"])
def test_the_offline_reader_opens_entries_of_dtypes_without_a_typed_storage(name):
    """torch.save writes these with `_rebuild_tensor_v3` over an untyped storage; the restricted entry reader
    (what certify, adopt and the read-back open entries with) admits exactly that, and still refuses a view that
    declares more bytes than its storage holds."""
    from scout_ckpt.format.dcp_entries import load_entry
    from scout_ckpt.format.dcp_pickle import RefusedPickle
    from scout_ckpt.format.scan_reader import Memory

    dtype = getattr(torch, name)
    t = torch.arange(4, dtype=torch.uint8).repeat_interleave(dtype.itemsize).view(dtype)
    members = _saved(t)
    blob = _archive(members)
    got = load_entry(Memory(np.frombuffer(blob, np.uint8)), 0, len(blob))
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    pkl_name = next(n for n in members if n.endswith("data.pkl"))
    assert b"K\x04\x85" in members[pkl_name]  # the size tuple (4,), as BININT1 4, TUPLE1
    members[pkl_name] = members[pkl_name].replace(b"K\x04\x85", b"K\x40\x85")  # (64,): more than stored
    blob = _archive(members)
    with pytest.raises(RefusedPickle):
        load_entry(Memory(np.frombuffer(blob, np.uint8)), 0, len(blob))
