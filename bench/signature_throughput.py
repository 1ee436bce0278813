"""Signature throughput in GB/s on one thread: the additive signature with its former torch-op CPU kernel and with
the numpy kernel, the replica signature (xxh3-128 of the bytes) and raw xxh3_128, over one fp32 tensor.

Runs are interleaved round-robin so machine noise hits all contenders alike; medians are reported.

    python bench/signature_throughput.py [--json] [--mb 256] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, interleaved_times, load_note, log, parser  # noqa: E402


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch
    import xxhash

    from scout_ckpt.consensus import signatures as S

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
        "ratios": {"additive_numpy_speedup": before / after, "replica_vs_additive_before": before / replica,
                   "replica_vs_additive_after": after / replica},
        "median_s": med, "gb_per_s": gbps, "samples_s": times, "bytes": nbytes, "threads": args.threads,
        "repeats": args.repeats, **load_note(),
    }
    rows = [(k, f"{med[k]:.4f}", f"{gbps[k]:.3f}") for k in fns]
    emit(result, args, rows, ["signature", "median s", "GB/s"],
         title=f"signature throughput: {nbytes / 2**20:.0f} MB fp32, {args.threads} thread(s), {args.repeats} rounds")


if __name__ == "__main__":
    main()
