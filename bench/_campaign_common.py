"""The bookkeeping every torchrun campaign module shares (bench/campaign_torchrun.py, bench/campaign_users.py): one
job under real `torchrun --standalone`, what its ROOT's ledger says afterwards, and how an incident's events are
scored against the time the fault struck.

Why one copy: each module used to carry its own launcher, resume check and event scoring, and a fix to one (the
window an event must fall in, what makes a resume bad) silently missed the other.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EARLY_S = 0.05  # an event this much before the fault's own timestamp still counts (the two clocks' write order)


def torchrun(
    script: Path, root: Path, nproc: int, args: list[str], restarts: int = 0, timeout: float = 900.0
) -> tuple[int, float, str]:
    """(exit code, wall seconds, the last 2000 characters of stderr) of one job; 124 when it ran past `timeout`."""
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
        str(root),
        *args,
    ]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
        rc, err = p.returncode, p.stderr[-2000:]
    except subprocess.TimeoutExpired:
        rc, err = 124, "timed out"
    return rc, time.monotonic() - t0, err


def ledger(root: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """(events, checkpoints with their replay evidence, runs) of ROOT's ledger; empty where there is none."""
    from scout_ckpt.ledger import Ledger

    if not (root / "scout-ledger.db").exists():
        return [], [], []
    with Ledger.open(root, readonly=True) as led:
        cks = [{**c, "replay": led.evidence(c["step"]).get("replay") or {}} for c in led.checkpoints()]
        return led.events(), cks, led.runs()


def resume(root: Path) -> tuple[int | None, list[str]]:
    """latest_clean(root) and whether it verifies (a bad resume otherwise)."""
    from scout_ckpt import policy
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.ops.recovery import NoCleanCheckpoint, latest_clean, verify_checkpoint

    if not (root / "scout-ledger.db").exists():
        return None, []
    try:
        step = latest_clean(root)["step"]
    except NoCleanCheckpoint:
        return None, []
    with Ledger.open(root, readonly=True) as led:
        ok = verify_checkpoint(root, led, step)["status"] == policy.PASS
    return step, [] if ok else [f"latest_clean returned step {step}, which does not verify"]


def alarm_counts(events: list[dict], kinds) -> dict[str, int]:
    """{kind: how many} of the events of `kinds` (a healthy control's false alarms)."""
    counts: dict[str, int] = {}
    for e in events:
        if e["kind"] in kinds:
            counts[e["kind"]] = counts.get(e["kind"], 0) + 1
    return counts


def score(events: list[dict], detector, fault: dict | None) -> tuple[list[dict], list[int], float | None]:
    """An incident's detection: (the events of the detector's kinds at or after the fault struck, oldest first;
    the ranks the first one names; its latency from the fault, seconds). Nothing counts when the fault never
    fired (`fault` None)."""
    if fault is None:
        return [], [], None
    hits = sorted(
        (e for e in events if e["kind"] in detector and (e["time"] or 0) >= fault["time"] - EARLY_S),
        key=lambda e: e["time"] or 0,
    )
    blamed = sorted({r for e in hits[:1] for r in e["ranks"] or []})
    return hits, blamed, (hits[0]["time"] - fault["time"]) if hits else None
