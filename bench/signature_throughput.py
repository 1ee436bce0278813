"""Signature throughput in GB/s on one thread: the additive signature with its former torch-op CPU kernel and with
the numpy kernel, the replica signature (xxh3-128 of the bytes) and raw xxh3_128, over one fp32 tensor.

Runs are interleaved round-robin so machine noise hits all contenders alike; medians are reported.

With `--device cuda`: the signatures of a tensor on the device, computed there without a host copy
(`replica_signatures` of a device tensor is its additive signature on the device; only the [1, 2] result comes back),
against the device's memory bandwidth measured in the same run: a plain device-to-device copy into a preallocated
tensor (`copy_`, two bytes moved per byte), and one read of the tensor (`sum`), each synchronised and interleaved
with the signature. The signature reads each byte once, so its GB/s over the copy's is the fraction of the memory
bandwidth it reaches: `signature_vs_copy_bandwidth`, the headline `ratio` (goal >= 0.5); `signature_vs_read` as
well. `--device cpu` runs the same path on the host (a smoke test of the path, no goal).

    python bench/signature_throughput.py [--json] [--mb 256] [--repeats 3] [--threads 1] [--device cuda]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, interleaved_times, load_note, log, parse_args, parser  # noqa: E402


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default=None, help="measure on this device (cuda, cuda:1, cpu) instead")
    args = parse_args(ap, {"mb": 4, "repeats": 1})

    import torch
    import xxhash

    from scout_ckpt.consensus import signatures as S

    if args.device is not None:
        return _on_device(args, torch, S)

    torch.set_num_threads(args.threads)
    S.THREADS = args.threads
    n = args.mb * 2**20 // 4
    t = torch.randn(n, generator=torch.Generator().manual_seed(0))
    nbytes = t.numel() * t.element_size()

    default_chunk = S.CHUNK["cpu"]

    def additive(kernel):
        def run():  # the torch-op kernel as it was: 64 Ki-element slices, its measured best
            S.CPU_KERNEL, S.CHUNK["cpu"] = kernel, (1 << 16 if kernel == "torch" else default_chunk)
            try:
                return S.tensor_signature(t)
            finally:
                S.CPU_KERNEL, S.CHUNK["cpu"] = "numpy", default_chunk

        return run

    fns = {
        "additive, torch-op kernel (before)": additive("torch"),
        "additive, numpy kernel (after)": additive("numpy"),
        "replica signature (xxh3-128)": lambda: S.replica_signatures([t]),
        "raw xxh3_128": lambda: xxhash.xxh3_128_intdigest(t.numpy()),
    }
    if not torch.equal(fns["additive, torch-op kernel (before)"](), fns["additive, numpy kernel (after)"]()):
        raise SystemExit("error: the two additive kernels disagree")
    log(f"hashing {nbytes / 2**20:.0f} MB fp32 on {args.threads} thread(s), {args.repeats} rounds ...")
    times = interleaved_times(fns, args.repeats, warmup=0)
    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: nbytes / 1e9 / v for k, v in med.items()}
    before, after = med["additive, torch-op kernel (before)"], med["additive, numpy kernel (after)"]
    replica = med["replica signature (xxh3-128)"]
    result = {
        "ratio": before / after,
        "ratios": {
            "additive_numpy_speedup": before / after,
            "replica_vs_additive_before": before / replica,
            "replica_vs_additive_after": after / replica,
        },
        "median_s": med,
        "gb_per_s": gbps,
        "samples_s": times,
        "bytes": nbytes,
        "threads": args.threads,
        "repeats": args.repeats,
        **load_note(),
    }
    rows = [(k, f"{med[k]:.4f}", f"{gbps[k]:.3f}") for k in fns]
    emit(
        result,
        args,
        rows,
        ["signature", "median s", "GB/s"],
        title=f"signature throughput: {nbytes / 2**20:.0f} MB fp32, {args.threads} thread(s), {args.repeats} rounds",
    )


def _on_device(args, torch, S) -> None:
    from bench._common import fail

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(f"--device {args.device}: no CUDA device on this machine")
    torch.set_num_threads(args.threads)
    n = args.mb * 2**20 // 4
    t = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    nbytes = t.numel() * t.element_size()

    def synced(fn):
        def run():
            out = fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return out

        return run

    dst = torch.empty_like(t)
    fns = {
        "replica signature on device": synced(lambda: S.replica_signatures([t])),
        "read (sum)": synced(lambda: t.sum()),
        "copy (device to device)": synced(lambda: dst.copy_(t)),
    }
    sig = fns["replica signature on device"]()
    if device.type != "cpu":  # on an accelerator: the additive signature, equal to the host's computation of it
        if torch.equal(sig, S.replica_signatures([t.cpu()])):
            fail("the device signature equals the host's xxh3: the device path was not taken")
        if not torch.equal(sig, S.batch_signatures([t.cpu()])):
            fail("the device signature differs from the same signature computed on the host")
    log(f"hashing {nbytes / 2**20:.0f} MB fp32 on {device}, {args.repeats} rounds ...")
    times = interleaved_times(fns, args.repeats, warmup=1)
    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: (2 if k.startswith("copy") else 1) * nbytes / 1e9 / v for k, v in med.items()}
    sig_gbps = gbps["replica signature on device"]
    bandwidth = gbps["copy (device to device)"]
    ratio = sig_gbps / bandwidth
    on_gpu = device.type == "cuda"
    result = {
        "ratio": ratio,
        "ratios": {"signature_vs_copy_bandwidth": ratio, "signature_vs_read": sig_gbps / gbps["read (sum)"]},
        "median_s": med,
        "gb_per_s": gbps,
        "bandwidth_gb_per_s": bandwidth,
        "signature_gb_per_s": sig_gbps,
        "samples_s": times,
        "bytes": nbytes,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if on_gpu else "host",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if on_gpu else None,
        "repeats": args.repeats,
        "target": ">= 0.5 of the memory bandwidth a device-to-device copy reaches in the same run",
        "target_met": ratio >= 0.5 if on_gpu else None,
        **load_note(),
    }
    rows = [(k, f"{med[k]:.4f}", f"{gbps[k]:.1f}") for k in fns]
    emit(
        result,
        args,
        rows,
        ["on device", "median s", "GB/s (bytes moved)"],
        title=f"signature throughput on {device}: {nbytes / 2**20:.0f} MB fp32, {args.repeats} rounds",
    )


if __name__ == "__main__":
    main()
