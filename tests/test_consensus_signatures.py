"""Signatures: exact, order-sensitive, additive over shards, every dtype; DTensor full signatures on real ranks."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from scout_ckpt.consensus import kernels as K
from scout_ckpt.consensus import signatures as S
from scout_ckpt.consensus.full import assign_replicated, full_signatures
from scout_ckpt.consensus.signatures import (
    add_signatures,
    batch_signatures,
    bytes_signature,
    flatten_state,
    leaf_bytes,
    signature_hex,
    tensor_signature,
)

M64 = (1 << 64) - 1
DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
# Signed as well (the signature goes by element size): the other float8 and float4 formats, complex32.
MORE_DTYPES = [
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
    torch.complex32,
]


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
    for lane in K.LANES:
        c, k = lane[0] & M64, lane[1] & M64
        out.append(sum(_ref_mix((w & M64) ^ ((c * i + k) & M64), lane) for i, w in enumerate(words)) & M64)
    return out[0], out[1]


# The lane constants of the definition, copied here (not read from the library): (C, K, M1, M2) per lane.
DEFINITION_LANES = (
    (0x9E3779B97F4A7C15, 0x632BE59BD9B4E019, 0xD6E8FEB86659FD93, 0xD6E8FEB86659FD93),
    (0xBF58476D1CE4E5B9, 0x8CB92BA72F3D8DD7, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53),
)


def np_reference_hex(t: torch.Tensor) -> str:
    """The documented definition evaluated with numpy over the tensor's raw bytes in row-major order, none of the
    library's code involved: words of the element size (a complex element is two words of half its size, real
    then imaginary: view_as_real's index 2*i + c), 1-byte words zero-extended, 2- and 4-byte ones sign-extended,
    8-byte ones as is; per lane sum_i mix(b_i ^ (C*i + K)) mod 2^64, mix(x) = xs(xs(xs(x) * M1) * M2)."""
    import numpy as np

    # reinterpreted as integer words of the same width first (allowed on any layout; some dtypes cannot be
    # copied), then made row-major; the numpy reference reads only the bytes
    t = torch.view_as_real(t.detach()) if t.dtype.is_complex else t.detach()
    word = t.element_size()
    raw = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[word]).contiguous().numpy().tobytes()
    b = np.frombuffer(raw, dtype={1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[word])
    b = b.astype(np.int64).view(np.uint64) if word > 1 else b.astype(np.uint64)  # sign- / zero-extension
    i = np.arange(b.size, dtype=np.uint64)
    out = []
    with np.errstate(over="ignore"):
        for c, k, m1, m2 in DEFINITION_LANES:
            x = b ^ (i * np.uint64(c) + np.uint64(k))
            for m in (m1, m2):
                x = x ^ (x >> np.uint64(32))
                x = x * np.uint64(m)
            x = x ^ (x >> np.uint64(32))
            out.append(int(x.sum(dtype=np.uint64)))
    return f"{out[0]:016x}{out[1]:016x}"


def test_numpy_reference_is_the_python_reference():
    t = random_tensor(torch.int32, (5, 3))
    a, b = reference_signature(t.reshape(-1).tolist())
    assert np_reference_hex(t) == f"{a:016x}{b:016x}"
    assert np_reference_hex(torch.arange(10, dtype=torch.int32)) == KNOWN_ARANGE10
    c = torch.tensor([1 + 2j, -3.5 - 0.25j], dtype=torch.complex64)  # complex: real, imag words at 2*i + c
    words = [struct.unpack("<i", struct.pack("<f", v))[0] for v in (1.0, 2.0, -3.5, -0.25)]
    a, b = reference_signature(words)
    assert np_reference_hex(c) == f"{a:016x}{b:016x}"


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
    assert torch.equal(tensor_signature(t.t().contiguous().t()), sig)  # non-contiguous view
    assert torch.equal(tensor_signature(t.reshape(90)), sig)  # bits and order only, not shape
    assert not torch.equal(tensor_signature(t.t()), sig)  # transposed values: other order
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
@pytest.mark.parametrize(
    "cuts", [((5,), ()), ((2, 9), ()), ((1, 4, 11), ()), ((), (3,)), ((), (1, 2, 8)), ((6,), (4,)), ((3, 7), (2, 5, 9))]
)
def test_partials_sum_to_the_whole(dtype, cuts, small_chunks):
    t = random_tensor(dtype, (13, 11))
    whole = tensor_signature(t)
    parts = [
        tensor_signature(t[r0:r1, c0:c1], global_shape=t.shape, global_offset=(r0, c0))
        for (r0, r1), (c0, c1) in _boxes(t.shape, cuts)
    ]
    assert len(parts) >= 2
    assert torch.equal(add_signatures(*parts), whole)
    assert not torch.equal(add_signatures(*parts[1:]), whole)


def test_partials_of_a_3d_tensor():
    t = torch.randn(4, 6, 5)
    whole = tensor_signature(t)
    parts = [
        tensor_signature(t[:, a:b, c:d], global_shape=t.shape, global_offset=(0, a, c))
        for a, b in [(0, 1), (1, 4), (4, 6)]
        for c, d in [(0, 5)]
    ]
    parts2 = [
        tensor_signature(t[a:b, :, c:d], global_shape=t.shape, global_offset=(a, 0, c))
        for a, b in [(0, 3), (3, 4)]
        for c, d in [(0, 2), (2, 5)]
    ]
    assert torch.equal(add_signatures(*parts), whole) and torch.equal(add_signatures(*parts2), whole)


def test_partial_rejects_a_box_outside_the_tensor():
    with pytest.raises(ValueError):
        tensor_signature(torch.zeros(3, 3), global_shape=(4, 4), global_offset=(2, 0))


def test_chunk_size_does_not_matter(monkeypatch):
    t = torch.randn(1000, 37)
    ref = tensor_signature(t)
    for chunk in (5, 64, 1 << 12):  # 5: chunks that split rows and end mid-row (1 took 10 s of the suite)
        monkeypatch.setitem(S.CHUNK, "cpu", chunk)
        assert torch.equal(tensor_signature(t), ref)
        assert torch.equal(
            tensor_signature(t[:, 3:20], global_shape=t.shape, global_offset=(0, 3)),
            add_signatures(
                *[tensor_signature(t[:, c : c + 1], global_shape=t.shape, global_offset=(0, c)) for c in range(3, 20)]
            ),
        )


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

    from scout_ckpt.consensus.canonical import NotComparable

    model = torch.nn.Linear(2, 3)
    state = {
        "model": model,
        "holder": _Holder(),
        "step": 7,
        "lr": 0.1,
        "sched": {"milestones": [1, 2], "name": "x"},
        "np": np.arange(3),
        "none": None,
        "obj": object(),
    }
    flat = flatten_state(state)
    assert set(flat) == {
        "model.weight",
        "model.bias",
        "holder.w",
        "holder.n",
        "step",
        "lr",
        "sched.milestones.0",
        "sched.milestones.1",
        "sched.name",
        "np",
        "none",
        "obj",
    }
    assert isinstance(flat["model.weight"], torch.Tensor) and isinstance(flat["step"], bytes)
    assert flat["lr"] == leaf_bytes(0.1) != leaf_bytes(math.nextafter(0.1, 1.0))  # floats compare exactly
    assert leaf_bytes(1) != leaf_bytes(1.0) != leaf_bytes(True)
    # no canonical encoding (consensus/canonical.py): left out of consensus, never compared by its repr
    assert isinstance(flat["obj"], NotComparable) and "object has no canonical encoding" in flat["obj"].why
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
    from scout_ckpt.testing.launch import run_ranks
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

    from scout_ckpt.testing.launch import run_ranks
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


# ---- the numpy CPU kernel: the same definition as the torch-op kernel --------------------------------------------


@pytest.fixture
def torch_kernel(monkeypatch):
    """Run a callable with the torch-op kernel on CPU (what CUDA runs), for cross-checks."""

    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(S, "CPU_KERNEL", "torch")
            return fn(*args, **kwargs)

    return run


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_numpy_kernel_equals_torch_kernel(dtype, torch_kernel, small_chunks):
    t = random_tensor(dtype, (13, 11), seed=3)
    assert torch.equal(tensor_signature(t), torch_kernel(tensor_signature, t))
    assert torch.equal(tensor_signature(t.t()), torch_kernel(tensor_signature, t.t()))  # non-contiguous
    box = dict(global_shape=(20, 15), global_offset=(4, 2))  # a non-contiguous global index map
    assert torch.equal(tensor_signature(t, **box), torch_kernel(tensor_signature, t, **box))
    items = [t, t[:2], t[0, :3], torch.zeros(0, dtype=dtype), t[5, 5]]
    assert torch.equal(batch_signatures(items), torch_kernel(batch_signatures, items))


def test_numpy_kernel_large_and_threaded(monkeypatch, torch_kernel):
    t = torch.randn(3 * S.CHUNK["cpu"] + 123)
    ref = torch_kernel(tensor_signature, t)
    assert torch.equal(tensor_signature(t), ref)
    monkeypatch.setattr(S, "THREADS", 4)
    monkeypatch.setitem(S.CHUNK, "cpu", 1000)  # many slices: split over 4 threads
    assert torch.equal(tensor_signature(t), ref)
    half = t.numel() // 2
    parts = [
        tensor_signature(t[:half], global_shape=t.shape, global_offset=(0,)),
        tensor_signature(t[half:], global_shape=t.shape, global_offset=(half,)),
    ]
    assert torch.equal(add_signatures(*parts), ref)


def test_requires_grad_and_views():
    p = torch.nn.Parameter(torch.randn(7, 5))
    assert torch.equal(tensor_signature(p), tensor_signature(p.detach().clone()))
    assert torch.equal(batch_signatures([p])[0], tensor_signature(p.detach().clone()))
    base = torch.randn(100)
    assert torch.equal(tensor_signature(base[10:40]), tensor_signature(base[10:40].clone()))  # storage offset


# ---- replica signatures (save-time consensus): xxh3-128 of a CPU tensor's bytes ----------------------------------


def test_replica_signature_is_xxh3_of_the_bytes():
    import xxhash

    t = torch.randn(6, 7)
    d = xxhash.xxh3_128_intdigest(t.numpy().tobytes())
    assert signature_hex(S.replica_signatures([t])[0]) == f"{d:032x}"
    assert torch.equal(S.replica_signatures([b"step=3"])[0], bytes_signature(b"step=3"))
    assert S.replica_signatures([]).shape == (0, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_replica_signatures_exact_and_order_sensitive(dtype):
    t = random_tensor(dtype, (13, 11), seed=5)
    sig = S.replica_signatures([t])[0]
    assert torch.equal(S.replica_signatures([t.clone()])[0], sig)  # equal tensors agree
    assert torch.equal(S.replica_signatures([t.t().contiguous().t()])[0], sig)  # same bits, other layout
    n = t.numel()
    bits = 1 if dtype == torch.bool else t.element_size() * 8
    g = torch.Generator().manual_seed(2)
    seen = {signature_hex(sig)}
    for _ in range(20):
        e = int(torch.randint(0, n, (1,), generator=g))
        b = int(torch.randint(0, bits, (1,), generator=g))
        s = S.replica_signatures([flipped(t, e, b)])[0]
        assert both_lanes_differ(s, sig), (e, b)
        seen.add(signature_hex(s))
    flat = t.reshape(-1)
    raw = flat.view(torch.uint8).reshape(n, -1)
    j = next(k for k in range(1, n) if not torch.equal(raw[k], raw[0]))
    swapped = flat.clone()
    swapped[0], swapped[j] = flat[j].clone(), flat[0].clone()
    assert not torch.equal(S.replica_signatures([swapped.reshape(t.shape)])[0], sig)
    perm = torch.randperm(n, generator=g)
    assert not torch.equal(S.replica_signatures([flat[perm].reshape(t.shape)])[0], sig)
    assert not torch.equal(S.replica_signatures([t.t()])[0], sig)  # transposed: the bytes in another order


def test_replica_signatures_pool_and_batch(monkeypatch):
    monkeypatch.setattr(S, "POOL_MIN_BYTES", 64)
    monkeypatch.setattr(S, "THREADS", 4)
    items = [
        torch.randn(50, 40),
        b"lr=0.1",
        torch.randn(3),
        torch.randn(30, 20).t(),
        torch.zeros(0),
        torch.nn.Parameter(torch.randn(100)),
        torch.randn(4, dtype=torch.complex64),
        torch.randn(200),
    ]
    pooled = S.replica_signatures(items)
    monkeypatch.setattr(S, "THREADS", 1)
    assert torch.equal(S.replica_signatures(items), pooled)
    for i, item in enumerate(items):  # batch order does not leak into a row
        assert torch.equal(S.replica_signatures([item])[0], pooled[i]), i
    c = torch.randn(5, dtype=torch.complex64)
    assert torch.equal(S.replica_signatures([c.conj()])[0], S.replica_signatures([c.conj().resolve_conj()])[0])
    with pytest.raises(TypeError):
        S.replica_signatures([3])
    with pytest.raises(TypeError):
        S.replica_signatures([torch.empty(3, device="meta")])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replica_signatures_of_cuda_tensors_stay_additive_on_device():
    t = torch.randn(1000, 33)
    assert torch.equal(
        S.replica_signatures([t.cuda(), b"x"]), torch.stack([tensor_signature(t), bytes_signature(b"x")])
    )


# ---- full signatures: replicated tensors signed round-robin ------------------------------------------------------


def test_assign_replicated_is_balanced_and_deterministic():
    costs = [100, 1, 50, 50, 30, 20, 0, 100, 7]
    owners = assign_replicated(costs, 4)
    assert owners == assign_replicated(list(costs), 4) and set(owners) <= {0, 1, 2, 3}
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(4)]
    assert max(loads) <= 100 and min(loads) >= 70 and sum(loads) == sum(costs)
    assert assign_replicated(costs, 1) == [0] * len(costs)
    assert assign_replicated([], 3) == []
    sizes = [1 << 20] * 8 + [10] * 40  # DDP-like: a few big matrices, many small vectors
    per_rank = [sum(c for c, o in zip(sizes, assign_replicated(sizes, 4)) if o == r) for r in range(4)]
    assert max(per_rank) - min(per_rank) <= 10 * 40


def every_dtype_state():
    """DDP-style replicated state: the demo-sized model + Adam, scalars, six float matrices, and every dtype the
    library signs twice: small (packed with others into shared slices) and large and transposed (signed alone, in
    bounded row-major blocks of a non-contiguous tensor)."""
    from tests import workers_consensus as W

    state = W.replicated_state()
    torch.manual_seed(1)
    state["big"] = {f"w{i}": torch.randn(64, 48 + i) for i in range(6)}
    every = DTYPES + MORE_DTYPES
    state["dtypes"] = {str(d).removeprefix("torch."): random_tensor(d, seed=i) for i, d in enumerate(every)}
    state["dtypes_large"] = {
        str(d).removeprefix("torch."): random_tensor(d, (180, 200), seed=100 + i).t() for i, d in enumerate(every)
    }
    return state


def reference_full_signatures(state) -> dict[str, str]:
    """{dotted key: hex} computed here from the definitions in signatures.py's docstring: a tensor by
    np_reference_hex, a non-tensor leaf by xxh3-128 of its stable bytes (the type's name, then its JSON); Stateful
    objects by their state_dict(), containers by key or position."""
    import json

    import xxhash

    out = {}

    def walk(obj, key):
        if isinstance(obj, torch.Tensor):
            out[key] = np_reference_hex(obj)
        elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            walk(obj.state_dict(), key)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{key}.{i}" if key else str(i))
        else:
            assert obj is None or isinstance(obj, (bool, int, float, str)), (key, obj)
            out[key] = xxhash.xxh3_128_hexdigest(
                f"{type(obj).__module__}.{type(obj).__qualname__}:".encode() + json.dumps(obj).encode()
            )

    walk(state, "")
    return out


def ddp_full_signatures(rank, world, odd_shape_rank=None):
    """Rank worker: full_signatures of DDP-style replicated state (plain tensors of every dtype, scalars) over a
    gloo group, and how many tensors this rank signed."""
    import torch.distributed as dist

    state = every_dtype_state()
    if rank == odd_shape_rank:
        state["big"]["w0"] = torch.zeros(3)
    from scout_ckpt.consensus import full as F

    signed = []
    real = F.batch_signatures  # looked up in full.py, where full_signatures lives

    def counting(items):
        signed.extend(len(x) if isinstance(x, (bytes, bytearray)) else x.numel() for x in items)
        return real(items)

    F.batch_signatures = counting
    try:
        pg = dist.new_group(backend="gloo")
        sigs = full_signatures(state, group=pg)
    finally:
        F.batch_signatures = real
    return {"sigs": sigs, "signed": len(signed), "elements": sum(signed)}


def test_full_signatures_round_robin_on_four_ranks():
    from scout_ckpt.testing.launch import run_ranks

    out = run_ranks(ddp_full_signatures, 4, timeout=120)
    state = every_dtype_state()
    expected = reference_full_signatures(state)  # the test's own oracle, not the library's code
    assert {k.split(".")[0] for k in expected} == {"app", "step", "lr", "extra", "big", "dtypes", "dtypes_large"}
    assert len([k for k in expected if k.startswith("dtypes")]) == 2 * len(DTYPES + MORE_DTYPES)
    for o in out:
        assert o.result["sigs"].keys() == expected.keys()
        wrong = sorted(k for k in expected if o.result["sigs"][k] != expected[k])
        assert not wrong, (o.rank, wrong)
    assert full_signatures(state) == expected  # no process group: everything signed here, the same values
    # the work is spread: every rank signs something and nobody signs more than about half of the elements
    total = sum(o.result["elements"] for o in out)
    assert all(o.result["signed"] > 0 for o in out)
    assert max(o.result["elements"] for o in out) < 0.5 * total
    assert sum(o.result["signed"] for o in out) == len(flatten_state(state))  # each leaf signed exactly once


def test_full_signatures_fall_back_to_rank_zero_when_layouts_differ():
    from scout_ckpt.testing.launch import run_ranks

    out = run_ranks(ddp_full_signatures, 4, odd_shape_rank=2, timeout=120)
    first = out[0].result["sigs"]
    assert all(o.result["sigs"] == first for o in out)  # no hang, one answer: rank 0's values
    assert out[0].result["signed"] > 0 and all(o.result["signed"] == 0 for o in out[1:])
