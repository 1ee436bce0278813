"""A user's own DDP script under real `torchrun --max-restarts`: a rank SIGKILLed mid-run, and on restart the
newest certified checkpoint loads values that differ from what was saved (a bit flipped after dcp.load)."""

import json
import os
import subprocess
import sys

from scout_ckpt.ledger import Ledger
from tests.conftest import REPO


def test_torchrun_restart_walks_back_past_a_load_mismatch_and_resumes_exact_saved_state(tmp_path):
    root = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "--max-restarts", "2", "--monitor-interval", "0.5", str(REPO / "examples" / "train_ddp.py"), str(root),
           "--steps", "16", "--save-every", "5", "--crash-rank", "1", "--crash-step", "12", "--corrupt-load", "10",
           "--record"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    # The job's own record of what it saved and loaded: sha256 of its model AND optimizer state, computed by the
    # script itself (examples/train_ddp.py report()), not by scout-ckpt's verifier.
    events = [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines()
              if line.startswith("SCOUT-EXAMPLE ")]
    saved = {(e["attempt"], e["step"]): e["digest"] for e in events if e["event"] == "saved"}
    loaded = {e["attempt"]: (e["step"], e["digest"]) for e in events if e["event"] == "loaded"}
    assert loaded[0][0] == 0
    # Checkpoint 10 loaded wrongly in the restart: rejected, and the same call resumed from 5, exactly as saved.
    assert loaded[1] == (5, saved[(0, 5)])
    assert 2 not in loaded  # no crash loop: the restarted attempt ran to the end
    assert {s for a, s in saved if a == 1} == {10, 15}
    with Ledger.open(root, readonly=True) as led:
        # 10 was saved again by the restarted job: a new attempt whose history keeps the rejection.
        assert {r["step"]: r["state"] for r in led.checkpoints()} == {5: "certified", 10: "certified",
                                                                      15: "certified"}
        history = led.certifications(10)
        assert any(h["state"] == "rejected" and h["reasons"][0]["code"] == "load_mismatch" for h in history)
        assert led.runs()[-1]["resumed_from"] == 5
