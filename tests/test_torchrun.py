"""A user's own DDP script under real `torchrun --max-restarts`, with a rank SIGKILLed mid-run."""

import json
import os
import subprocess
import sys

import torch

from scout_ckpt.ledger import Ledger
from tests.conftest import REPO


def test_torchrun_restart_resumes_exact_saved_state(tmp_path):
    root = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "--max-restarts", "2", "--monitor-interval", "0.5", str(REPO / "examples" / "train_ddp.py"), str(root),
           "--steps", "16", "--save-every", "5", "--crash-rank", "1", "--crash-step", "12", "--record"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    first = json.loads((root / "resumed-attempt0.json").read_text())
    second = json.loads((root / "resumed-attempt1.json").read_text())
    assert first["resumed_from"] == 0
    assert second["resumed_from"] == 10  # the newest certified step before the crash at 12
    saved = torch.load(root / "saved-10.pt")
    loaded = torch.load(root / "loaded-10.pt")
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    with Ledger.open(root, readonly=True) as led:
        assert {r["step"]: r["state"] for r in led.checkpoints()} == {5: "certified", 10: "certified",
                                                                      15: "certified"}
        assert led.runs()[-1]["resumed_from"] == 10
