"""Helpers every bench script shares: repeated timing, the readable table, and the `--json` contract.

What every bench promises (docs/benchmarks.md): each `bench/*.py` runs standalone from the repo root, prints a table, and with `--json`
prints exactly one JSON object on stdout (headline in "ratio" or "ratios", raw medians and parameters beside it).
So in --json mode nothing else may reach stdout: progress goes to stderr through `log`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"  # gitignored


def results_dir() -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout and nothing else")
    return p


def parse_args(
    p: argparse.ArgumentParser, smoke: dict[str, Any], argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Parse a bench's options, adding `--smoke`: the bench at a tiny size (`smoke`, option destinations to
    values), so that `make bench-smoke` runs every bench in seconds to prove it runs and prints its JSON. Options
    given on the command line still win. A smoke run's figures mean nothing: its JSON says `"smoke": true`."""
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny size that runs in seconds (make bench-smoke); its figures mean nothing",
    )
    known, _ = p.parse_known_args(argv)
    if known.smoke:
        p.set_defaults(**smoke)
    return p.parse_args(argv)


def log(*parts: Any) -> None:
    """Progress for a person; stderr, so --json output stays one clean object."""
    print(*parts, file=sys.stderr, flush=True)


def fail(message: str, code: int = 2) -> None:
    """End a bench with one clear line on stderr (no traceback)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def sample_times(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of `repeats` calls after `warmup` untimed ones (page cache, .pyc files)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def interleaved_times(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Like sample_times for several functions, taken round-robin: a burst of load from other processes then
    slows every contender of that round alike, instead of whichever block happened to run during it."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t0)
    return out


def load_note() -> dict:
    """The 1-minute load average against the core count: timings taken on a busy machine say so."""
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    return {"loadavg_1m": round(load, 2), "cores": cores, "busy": load > cores}


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    return statistics.median(sample_times(fn, repeats, warmup))


def run_checked(
    cmd: Sequence[str], what: str, timeout: float = 300, env: dict | None = None, cwd: str | os.PathLike | None = None
) -> subprocess.CompletedProcess:
    """Run a process; on failure end the bench naming `what` and the stderr tail instead of a traceback."""
    try:
        res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        fail(f"{what}: timed out after {timeout:.0f} s: {' '.join(cmd)}")
    except OSError as e:
        fail(f"{what}: cannot run {cmd[0]}: {e.strerror}")
    if res.returncode != 0:
        tail = "\n  ".join((res.stderr or res.stdout).strip().splitlines()[-30:])  # past torchrun's summary
        fail(f"{what} exited {res.returncode}: {' '.join(cmd)}\n  {tail}")
    return res


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_table(rows: Sequence[Sequence[Any]], headers: Sequence[str], file=None) -> None:
    """A plain fixed-width table (readable in a terminal, a log, or a CI artifact)."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line, file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)), file=file)


def emit(
    result: dict,
    args: argparse.Namespace,
    rows: Sequence[Sequence[Any]],
    headers: Sequence[str],
    title: str | None = None,
) -> None:
    """--json: the one object; otherwise the title, the table and the headline ratio(s)."""
    if getattr(args, "smoke", False):
        result = {**result, "smoke": True}
    if args.json:
        print(json.dumps(result, sort_keys=True, default=str))
        return
    if title:
        print(title)
    print_table(rows, headers)
    if "ratio" in result:
        print(f"\nratio: {fmt(result['ratio'])}")
    for k, v in (result.get("ratios") or {}).items():
        print(f"ratio {k}: {fmt(v)}")
    if "target" in result:
        met = result.get("target_met")
        print(f"target: {result['target']}" + ("" if met is None else f"  ({'met' if met else 'NOT met'})"))
