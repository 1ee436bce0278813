"""Signatures: exact, order-sensitive, additive over shards, every dtype; DTensor full signatures on real ranks."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from scout_ckpt.consensus import signatures as S
from scout_ckpt.consensus.signatures import (
    add_signatures, batch_signatures, bytes_signature, flatten_state, full_signatures, leaf_bytes, signature_hex,
    tensor_signature,
)

M64 = (1 << 64) - 1
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
          torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]


def random_tensor(dtype, shape=(13, 11), seed=0) -> torch.Tensor:
    """Random raw bits of any dtype (bools are 0/1)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def flipped(t: torch.Tensor, element: int, bit: int) -> torch.Tensor:
    out = t.clone()
    raw = out.view(-1).view(torch.uint8)
    raw[element * out.element_size() + bit // 8] ^= 1 << (bit % 8)
    return out


def both_lanes_differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a != b).all())


@pytest.fixture
def small_chunks(monkeypatch):
    """Slices of 7 elements: every slicing path runs on small tensors."""
    monkeypatch.setitem(S.CHUNK, "cpu", 7)


# ---- definition ------------------------------------------------------------------------------------------------


def _ref_mix(x: int, lane) -> int:
    _, _, m1, m2 = lane
    for mult in (m1, m2):
        x ^= x >> 32
        x = (x * (mult & M64)) & M64
    return x ^ (x >> 32)


def reference_signature(words: list[int]) -> tuple[int, int]:
    """The documented definition in plain Python integers: sum_i mix(b_i ^ (C*i + K)) mod 2^64 per lane."""
    out = []
    for lane in S._LANES:
        c, k = lane[0] & M64, lane[1] & M64
        out.append(sum(_ref_mix((w & M64) ^ ((c * i + k) & M64), lane) for i, w in enumerate(words)) & M64)
    return out[0], out[1]


def test_matches_the_documented_definition():
    f = torch.tensor([1.5, -0.0, float("nan"), 3e38], dtype=torch.float32)
    words = [struct.unpack("<i", struct.pack("<f", v))[0] for v in f.tolist()]  # sign-extended 32-bit words
    a, b = reference_signature(words)
    assert signature_hex(tensor_signature(f)) == f"{a:016x}{b:016x}"
    u8 = torch.tensor([0, 255, 7], dtype=torch.uint8)
    a, b = reference_signature([0, 255, 7])  # bytes are zero-extended
    assert signature_hex(tensor_signature(u8)) == f"{a:016x}{b:016x}"


def test_known_answer_is_stable():
    # Signatures are stored in manifests and compared across versions: the definition must not drift.
    assert signature_hex(tensor_signature(torch.arange(10, dtype=torch.int32))) == KNOWN_ARANGE10
    assert signature_hex(tensor_signature(torch.zeros(0))) == "0" * 32


KNOWN_ARANGE10 = "82a20fae38ecee752af83f98fd112b36"


def test_shape_and_device():
    sig = tensor_signature(torch.randn(4, 5))
    assert sig.shape == (2,) and sig.dtype == torch.int64 and sig.device.type == "cpu"
    h = signature_hex(sig)
    assert len(h) == 32 and int(h, 16) >= 0
    assert signature_hex([-1, 1]) == "f" * 16 + "0" * 15 + "1"


# ---- every dtype: exact and order-sensitive ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_exact_and_order_sensitive(dtype):
    t = random_tensor(dtype)
    sig = tensor_signature(t)
    assert torch.equal(sig, tensor_signature(t.clone()))
    n = t.numel()
    bits = 1 if dtype == torch.bool else t.element_size() * 8
    g = torch.Generator().manual_seed(1)
    for _ in range(20):  # single bit flips anywhere change both lanes
        e = int(torch.randint(0, n, (1,), generator=g))
        b = int(torch.randint(0, bits, (1,), generator=g))
        assert both_lanes_differ(tensor_signature(flipped(t, e, b)), sig), (e, b)
    flat = t.reshape(-1)
    perm = torch.randperm(n, generator=g)
    assert not torch.equal(tensor_signature(flat[perm].reshape(t.shape)), sig)
    raw = flat.view(torch.uint8).reshape(n, -1)
    j = next(k for k in range(1, n) if not torch.equal(raw[k], raw[0]))  # swap two elements of different bits
    swapped = flat.clone()
    swapped[0], swapped[j] = flat[j].clone(), flat[0].clone()
    assert both_lanes_differ(tensor_signature(swapped.reshape(t.shape)), sig)


def test_every_bit_of_a_small_tensor():
    t = torch.randn(3, dtype=torch.float64)
    sig = tensor_signature(t)
    sigs = {signature_hex(sig)}
    for e in range(3):
        for b in range(64):
            s = tensor_signature(flipped(t, e, b))
            assert both_lanes_differ(s, sig)
            sigs.add(signature_hex(s))
    assert len(sigs) == 1 + 3 * 64  # all distinct


def test_same_bits_in_another_layout_or_slicing(small_chunks):
    t = torch.randn(9, 10)
    sig = tensor_signature(t)
    assert torch.equal(tensor_signature(t.t().contiguous().t()), sig)      # non-contiguous view
    assert torch.equal(tensor_signature(t.reshape(90)), sig)               # bits and order only, not shape
    assert not torch.equal(tensor_signature(t.t()), sig)                   # transposed values: other order
    big = torch.randn(50, 3).t()
    assert torch.equal(tensor_signature(big), tensor_signature(big.contiguous()))


def test_zero_dim_and_empty():
    assert tensor_signature(torch.tensor(2.5)).shape == (2,)
    assert not torch.equal(tensor_signature(torch.tensor(2.5)), tensor_signature(torch.tensor(2.0)))
    assert torch.equal(tensor_signature(torch.zeros(3, 0)), torch.zeros(2, dtype=torch.int64))


def test_rejects_what_has_no_bits():
    with pytest.raises(TypeError):
        tensor_signature(torch.empty(3, device="meta"))
    with pytest.raises(TypeError):
        tensor_signature(torch.eye(3).to_sparse())


# ---- additivity -----------------------------------------------------------------------------------------------


def _boxes(shape, cuts):
    """All boxes of a 2-D grid cut at the given row and column positions."""
    rows = [0, *cuts[0], shape[0]]
    cols = [0, *cuts[1], shape[1]]
    for r0, r1 in zip(rows, rows[1:]):
        for c0, c1 in zip(cols, cols[1:]):
            yield (r0, r1), (c0, c1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64], ids=str)
@pytest.mark.parametrize("cuts", [((5,), ()), ((2, 9), ()), ((1, 4, 11), ()), ((), (3,)), ((), (1, 2, 8)),
                                  ((6,), (4,)), ((3, 7), (2, 5, 9))])
def test_partials_sum_to_the_whole(dtype, cuts, small_chunks):
    t = random_tensor(dtype, (13, 11))
    whole = tensor_signature(t)
    parts = [tensor_signature(t[r0:r1, c0:c1], global_shape=t.shape, global_offset=(r0, c0))
             for (r0, r1), (c0, c1) in _boxes(t.shape, cuts)]
    assert len(parts) >= 2
    assert torch.equal(add_signatures(*parts), whole)
    assert not torch.equal(add_signatures(*parts[1:]), whole)


def test_partials_of_a_3d_tensor():
    t = torch.randn(4, 6, 5)
    whole = tensor_signature(t)
    parts = [tensor_signature(t[:, a:b, c:d], global_shape=t.shape, global_offset=(0, a, c))
             for a, b in [(0, 1), (1, 4), (4, 6)] for c, d in [(0, 5)]]
    parts2 = [tensor_signature(t[a:b, :, c:d], global_shape=t.shape, global_offset=(a, 0, c))
              for a, b in [(0, 3), (3, 4)] for c, d in [(0, 2), (2, 5)]]
    assert torch.equal(add_signatures(*parts), whole) and torch.equal(add_signatures(*parts2), whole)


def test_partial_rejects_a_box_outside_the_tensor():
    with pytest.raises(ValueError):
        tensor_signature(torch.zeros(3, 3), global_shape=(4, 4), global_offset=(2, 0))


def test_chunk_size_does_not_matter(monkeypatch):
    t = torch.randn(1000, 37)
    ref = tensor_signature(t)
    for chunk in (1, 5, 64, 1 << 12):
        monkeypatch.setitem(S.CHUNK, "cpu", chunk)
        assert torch.equal(tensor_signature(t), ref)
        assert torch.equal(tensor_signature(t[:, 3:20], global_shape=t.shape, global_offset=(0, 3)),
                           add_signatures(*[tensor_signature(t[:, c:c + 1], global_shape=t.shape,
                                                             global_offset=(0, c)) for c in range(3, 20)]))


def test_thread_count_does_not_matter():
    t = torch.randn(1 << 18)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tensor_signature(t)
        torch.set_num_threads(max(2, before))
        assert torch.equal(tensor_signature(t), one)
    finally:
        torch.set_num_threads(before)


# ---- batches and state dicts -------------------------------------------------------------------------------------


def test_batch_equals_one_by_one(small_chunks):
    items = [random_tensor(d, (5, 3), seed=i) for i, d in enumerate(DTYPES)]
    items += [b"step=3", torch.zeros(0), torch.tensor(1.0), torch.randn(40, 30), torch.randn(6, 4).t()]
    batch = batch_signatures(items)
    assert batch.shape == (len(items), 2) and batch.device.type == "cpu"
    for i, item in enumerate(items):
        ref = bytes_signature(item) if isinstance(item, bytes) else tensor_signature(item)
        assert torch.equal(batch[i], ref), i


def test_batch_packs_many_small_tensors():
    items = [torch.randn(int(n)) for n in torch.randint(0, 300, (500,))]
    batch = batch_signatures(items)
    for i in (0, 17, 250, 499):
        assert torch.equal(batch[i], tensor_signature(items[i]))
    assert batch_signatures([]).shape == (0, 2)


class _Holder:
    def __init__(self):
        self.w = torch.ones(2)

    def state_dict(self):
        return {"w": self.w, "n": 3}

    def load_state_dict(self, sd):
        self.w = sd["w"]


def test_flatten_state():
    import numpy as np

    model = torch.nn.Linear(2, 3)
    state = {"model": model, "holder": _Holder(), "step": 7, "lr": 0.1, "sched": {"milestones": [1, 2], "name": "x"},
             "np": np.arange(3), "none": None, "obj": object()}
    flat = flatten_state(state)
    assert set(flat) == {"model.weight", "model.bias", "holder.w", "holder.n", "step", "lr", "sched.milestones.0",
                         "sched.milestones.1", "sched.name", "np", "none", "obj"}
    assert isinstance(flat["model.weight"], torch.Tensor) and isinstance(flat["step"], bytes)
    assert flat["lr"] == leaf_bytes(0.1) != leaf_bytes(math.nextafter(0.1, 1.0))  # floats compare exactly
    assert leaf_bytes(1) != leaf_bytes(1.0) != leaf_bytes(True)
    assert b"0x" not in flat["obj"]  # no object addresses: equal on every rank
    with pytest.raises(ValueError):
        flatten_state({"a.b": 1, "a": {"b": 2}})


def test_full_signatures_without_a_process_group():
    t = torch.randn(4, 4)
    sigs = full_signatures({"t": t, "step": 3})
    assert sigs["t"] == signature_hex(tensor_signature(t))
    assert sigs["step"] == signature_hex(bytes_signature(leaf_bytes(3)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64):
        t = random_tensor(dtype, (1000, 333))
        g = t.cuda()
        s = tensor_signature(g)
        assert s.device.type == "cuda"
        assert torch.equal(s.cpu(), tensor_signature(t))
        assert torch.equal(batch_signatures([g, t[:5].cuda()]), batch_signatures([t, t[:5]]))


# ---- DTensors on real ranks ------------------------------------------------------------------------------------


def test_dtensor_full_signature_equals_the_plain_tensor():
    from scout_ckpt.launch import run_ranks
    from tests import workers_consensus as W

    out = run_ranks(W.dtensor_full_signatures, 4, timeout=120)
    plain = out[0].result["plain"]
    for o in out:
        assert o.result["plain"] == plain
        for label, sigs in o.result.items():
            if label not in ("plain", "local_partial", "partial"):
                assert sigs == plain, (o.rank, label)
    # the per-rank partials really are partial (different on each rank)
    assert len({o.result["local_partial"]["f32"] for o in out}) == 4
    assert all(o.result["partial"] == "rejected" for o in out)


def test_saved_on_four_ranks_equals_loaded_without_them(tmp_path):
    import torch.distributed.checkpoint as dcp

    from scout_ckpt.launch import run_ranks
    from tests import workers_consensus as W

    path = str(tmp_path / "ckpt")
    out = run_ranks(W.dcp_save_sharded, 4, path, timeout=120)
    saved = out[0].result
    assert all(o.result == saved for o in out)
    state = {"model": {"w": torch.empty(6, 10), "b": torch.empty(10)}}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    assert full_signatures(state) == saved
    state["model"]["w"][5, 9] += 1
    assert full_signatures(state)["model.w"] != saved["model.w"]
