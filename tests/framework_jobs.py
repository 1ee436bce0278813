"""What the framework integrations' tests (DeepSpeed, Megatron-Core) share: a job script of 2 ranks under real
torchrun that writes one JSON line per event to a file, read back as the oracle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from scout_ckpt.ledger import Ledger
from tests.conftest import REPO


def torchrun(script: Path, save_dir: Path, events: Path, *extra, restarts: int = 0, ok: bool = True, nproc: int = 2):
    """`script SAVE_DIR --events EVENTS ...` on `nproc` ranks under torchrun; asserts it ended as `ok` says."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.5",
        str(script),
        str(save_dir),
        "--events",
        str(events),
        *map(str, extra),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=save_dir.parent)
    assert (p.returncode == 0) == ok, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def events(path: Path, event: str | None = None, attempt: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if (event is None or r["event"] == event) and (attempt is None or r["attempt"] == attempt)]


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def states(save_dir: Path) -> dict:
    with Ledger.open(save_dir, readonly=True) as led:
        return {r["step"]: r["state"] for r in led.checkpoints()}
