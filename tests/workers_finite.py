"""Rank functions for the finite-check tests (module level: run_ranks forks into them)."""

from __future__ import annotations

import torch

from scout_ckpt.checkpointer import Checkpointer

BIG = 1 << 17  # elements: large enough (>= FUSE_MIN bytes) to be checked piece by piece as it is written


def _bits(dtype, n: int, bad_index: int, bad_bits: int) -> torch.Tensor:
    """n ones of a one-byte `dtype`, element `bad_index` set to the raw bit pattern `bad_bits`."""
    t = torch.ones(n, dtype=torch.float32).to(dtype)
    t.view(torch.uint8)[bad_index] = bad_bits
    return t


def case_state(case: str) -> dict:
    """The tensors of one case, {key: tensor}: `bad_keys(case)` hold non-finite elements, the others do not.

    complex64-real / complex128-imag: a NaN real part, an infinite imaginary part (small and large tensors).
    alias-*: a bfloat16 tensor holding a NaN and a float32 `.view()` of the same storage, in either order; the
    NaN is the low half of a float32 element, which reads as a finite float32.
    fp8-<format>-<hex>: that bit pattern in a small and a large tensor (e4m3fn: 0x7F and 0xFF are NaN; e5m2:
    0x7C is +Inf, 0x7F a NaN)."""
    if case.startswith("complex"):
        name, part = case.split("-")
        dtype = getattr(torch, name)
        out = {}
        for size, key in ((16, "bad_small"), (BIG, "bad_large")):
            t = torch.ones(size, dtype=dtype)
            torch.view_as_real(t)[size // 2, 0 if part == "real" else 1] = (
                float("nan") if part == "real" else float("inf")
            )
            out[key] = t
        return out
    if case.startswith("alias"):
        a = torch.ones(BIG, dtype=torch.bfloat16)
        a[0] = float("nan")
        b = a.view(torch.float32)
        assert bool(torch.isfinite(b).all())  # the float32 alias is finite
        return {"bad": a, "view": b} if case == "alias-bf16-first" else {"view": b, "bad": a}
    if case.startswith("fp8"):
        _, fmt, bits = case.split("-")
        dtype = getattr(torch, f"float8_{fmt}")
        return {"bad_small": _bits(dtype, 16, 5, int(bits, 16)), "bad_large": _bits(dtype, BIG, BIG - 3, int(bits, 16))}
    raise ValueError(case)


def bad_keys(case: str) -> list[str]:
    return ["bad"] if case.startswith("alias") else ["bad_small", "bad_large"]


def healthy_state() -> dict:
    """Finite values of every floating dtype the cases use, and more (fnuz, e8m0, complex32 are not written by
    the cases), each small and large; a bf16 tensor and its float32 alias."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "complex64",
        "complex128",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "uint16",
    ):
        dtype = getattr(torch, name)
        for size, key in ((16, "small"), (BIG, "large")):
            if dtype.is_complex:
                t = torch.randn(size, dtype=dtype, generator=g)
            elif name == "uint16":
                t = torch.arange(size, dtype=torch.int32).to(torch.uint16)
            else:
                t = torch.randn(size, generator=g).clamp(-8, 8).to(dtype)
            out[f"{name}_{key}"] = t
    a = torch.randn(BIG, generator=g).to(torch.bfloat16)
    out["alias_bf16"], out["alias_f32"] = a, a.view(torch.float32)
    return out


def save_cases(rank, world, root, cases):
    """One save per case, step i for cases[i - 1], then a healthy step; returns {case: verdict, "healthy": ...}.
    Consensus is off (one rank has no replica), so a healthy save is certified. Each case has a Checkpointer of
    its own, as a restarted job would: a save that finds non-finite values ends its generation (LiveStateCorrupt,
    whose verdict is recorded) and would taint the saves after it."""
    from scout_ckpt.errors import LiveStateCorrupt

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    out = {}
    for step, case in enumerate(list(cases) + ["healthy"], start=1):
        x = healthy_state() if case == "healthy" else case_state(case)
        ckpt = Checkpointer(root, model=model, consensus=False)
        try:
            out[case] = ckpt.save(step, {"model": model.state_dict(), "x": x})
        except LiveStateCorrupt as e:
            out[case] = e.verdict
        except BaseException as e:  # recorded for the test (DCP raises CheckpointException, a BaseException)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            out[case] = {"raised": f"{type(e).__name__}: {str(e)[-300:]}"}
        finally:
            ckpt.close()
    return out
