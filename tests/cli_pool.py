"""Independent command-line cases run side by side, each on its own copy of a checkpoint root.

Most of the CLI tests' time is subprocesses starting (Python, typer, torch for the commands that read tensors);
cases that do not depend on each other need not wait for each other. Each case gets its own copy of the tree, so
"nothing was modified" is still checked per case, and a case's commands still run in order.
"""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")
WORKERS = 4  # subprocesses at once: on 2 cores their imports overlap with each other's file I/O and waits


def run_cases(cases: dict[str, Callable[[], T]]) -> dict[str, T]:
    """{name: case()} with the cases run concurrently; the first failure is raised with its case's name."""
    with ThreadPoolExecutor(max(1, min(WORKERS, len(cases))), thread_name_prefix="cli-case") as pool:
        futures = {name: pool.submit(fn) for name, fn in cases.items()}
        out = {}
        for name, f in futures.items():
            try:
                out[name] = f.result()
            except AssertionError as e:
                raise AssertionError(f"case {name}: {e}") from e
        return out


def copy_root(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint root (the ledger, its side files, the step dirs; sparse files stay sparse)."""
    if shutil.which("cp"):
        subprocess.run(["cp", "-a", "--sparse=always", str(src), str(dst)], check=True)
    else:
        shutil.copytree(src, dst, symlinks=True)
    return dst
