"""How much does offline certification cost against just reading and hashing the same files?

Writes a ~1 GB DCP checkpoint (4 fp32 tensors, dcp.save in one process, 4 writer threads -> 4 data files), then,
3 repetitions each, median:
  (a) certify:       what `certify` does per step: verify.verify_files with scan.StepScan's hasher (one
                     streaming pass per file, files in parallel threads: digests, entry structure, and the
                     invariants ["finite", frobenius_sphere on one tensor] checked on each 4 MiB piece right
                     after it was hashed, nothing of a tensor kept)
  (a0) read-back:    the previous way (digest_files, then check_structure + read_tensors + run_offline), kept as
                     a reference point
  (b) xxh3 read:     read + xxh3_128 each file, one thread, 8 MiB chunks (a plain integrity scan)
  (c) serial sha256: read + hashlib.sha256 each file, one thread
The page cache is warm for all three (the files were just written): this measures CPU cost, not the disk.
Then certify once more in a fresh process, for its peak memory (`certify_peak_rss_mb`: the process's maximum
resident set, against `baseline_rss_mb`, its resident set after the imports, before the certify call).

    python bench/certify_throughput.py [--size-mb 1024] [--reps 3] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import xxhash  # noqa: E402

from scout_ckpt.format import digests  # noqa: E402
from scout_ckpt.format.dcp_files import check_structure, read_tensors  # noqa: E402
from scout_ckpt.format.scan import StepScan  # noqa: E402
from scout_ckpt.format.verify import verify_files  # noqa: E402
from scout_ckpt.invariants import parse_specs, run_offline  # noqa: E402

CHUNK = 8 << 20


def write_checkpoint(path: Path, size_mb: int) -> list[Path]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    n = size_mb * (1 << 20) // 4 // 4  # elements per tensor
    cols = 1024
    g = torch.Generator().manual_seed(0)
    state = {"model": {}}
    for i in range(4):
        t = torch.randn(n // cols, cols, generator=g)
        if i == 0:  # float64 norm: a float32 t.norm() of 64M elements is 0.5% off on CPU
            t /= float(torch.linalg.vector_norm(t, dtype=torch.float64))
        state["model"][f"layers.{i}.weight"] = t
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=FileSystemWriter(str(path), thread_count=4), no_dist=True)
    return sorted(p for p in path.iterdir() if p.is_file())


def certify(path: Path, rows: list[dict], specs) -> str:
    scan = StepScan(path, specs)
    assert verify_files(path, rows, hasher=scan.hasher)["status"] == "pass"
    ev = scan.invariants()
    assert ev is not None and ev["status"] == "pass", ev
    return ev["status"]


def read_back(path: Path, files: list[Path], checks) -> str:
    digests.digest_files(files)
    assert check_structure(path)["status"] == "pass"
    ev = run_offline(checks, read_tensors(path))
    assert ev["status"] == "pass", ev
    return ev["status"]


_PEAK = """
import json, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import torch
import torch.distributed.checkpoint.filesystem  # what the scan imports, so that it counts in the baseline
from scout_ckpt.format.scan import StepScan
from scout_ckpt.format.verify import verify_files
def status(key):  # kB; VmHWM is this process's own peak (ru_maxrss would keep the forked parent's across exec)
    return int(next(l for l in open("/proc/self/status") if l.startswith(key + ":")).split()[1])
path, rows, specs = Path(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
base = status("VmRSS")
scan = StepScan(path, specs)
assert verify_files(path, rows, hasher=scan.hasher)["status"] == "pass" and scan.invariants()["status"] == "pass"
print(json.dumps([base, status("VmHWM")]))
"""


def peak_rss(path: Path, rows: list[dict], specs) -> dict:
    """Peak resident memory of one certify in a fresh process (MB), and the process's before the call."""
    import subprocess

    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _PEAK,
            str(Path(__file__).resolve().parents[1]),
            str(path),
            json.dumps(rows),
            json.dumps(specs),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    base, peak = json.loads(out.stdout.strip().splitlines()[-1])
    return {"certify_peak_rss_mb": peak / 1024, "baseline_rss_mb": base / 1024}


def hash_files(files: list[Path], make) -> None:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    for p in files:
        h = make()
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
        h.hexdigest()


def timed(fns: dict, reps: int) -> dict:
    """Median seconds of each function, taken round-robin (a burst of load from other processes hits all)."""
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny size that runs in seconds (make bench-smoke); its figures mean nothing",
    )
    args = ap.parse_args()
    if args.smoke:
        args.size_mb, args.reps = min(args.size_mb, 4), 1
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    base = Path(tempfile.mkdtemp(prefix="scout-bench-", dir=args.dir))
    try:
        path = base / "step-00000001"
        t0 = time.perf_counter()
        files = write_checkpoint(path, args.size_mb)
        write_s = time.perf_counter() - t0
        nbytes = sum(p.stat().st_size for p in files)
        specs = ["finite", "frobenius_sphere:radius=1.0:params=layers.0.weight"]
        checks = parse_specs(specs)
        rows = [{"path": p.name, "size": s, "digest": d} for p, (s, d) in ((p, digests.file_digest(p)) for p in files)]
        med = timed(
            {
                "certify": lambda: certify(path, rows, specs),
                "xxh3": lambda: hash_files(files, xxhash.xxh3_128),
                "sha256": lambda: hash_files(files, hashlib.sha256),
                "read_back": lambda: read_back(path, files, checks),
            },
            args.reps,
        )
        a, b, c, a0 = med["certify"], med["xxh3"], med["sha256"], med["read_back"]
        peak = peak_rss(path, rows, specs)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result = {
        "ratios": {"vs_xxh3_read": a / b, "vs_serial_sha256": a / c},
        "certify_s_median": a,
        "read_back_s_median": a0,
        "read_back_vs_xxh3_read": a0 / b,
        "xxh3_read_s_median": b,
        "sha256_serial_s_median": c,
        "certify_gb_s": nbytes / a / 1e9,
        "xxh3_read_gb_s": nbytes / b / 1e9,
        "sha256_gb_s": nbytes / c / 1e9,
        "bytes": nbytes,
        "files": len(files),
        "reps": args.reps,
        "write_s": write_s,
        "checks": [ch.spec for ch in checks],
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "loadavg_1m": os.getloadavg()[0],
        **peak,
    }
    if args.smoke:
        result["smoke"] = True
    if args.json:
        print(json.dumps(result))
        return
    print(f"checkpoint: {nbytes / 1e9:.2f} GB in {len(files)} files, written in {write_s:.2f} s; median of {args.reps}")
    print(f"{'path':<46}{'seconds':>10}{'GB/s':>8}{'ratio':>8}")
    for name, s in [
        ("(a) certify: one pass, files in parallel", a),
        ("(a0) read-back (previous way)", a0),
        ("(b) read + xxh3_128, 1 thread", b),
        ("(c) read + sha256, 1 thread", c),
    ]:
        print(f"{name:<46}{s:>10.3f}{nbytes / s / 1e9:>8.2f}{a / s:>8.2f}")
    print(f"certify / xxh3 read = {a / b:.2f}   certify / serial sha256 = {a / c:.2f}")
    print(
        f"certify peak RSS {result['certify_peak_rss_mb']:.0f} MB (process before the call: "
        f"{result['baseline_rss_mb']:.0f} MB; largest tensor {nbytes / 4 / 2**20:.0f} MB)"
    )


if __name__ == "__main__":
    main()
