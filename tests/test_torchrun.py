"""A user's own DDP script (examples/train_ddp.py) under real `torchrun --max-restarts`: a rank SIGKILLed mid-run,
and on restart the newest certified checkpoint loads values that differ from what was saved (a bit flipped after
dcp.load); and (scenarios) a rank SIGKILLed inside a save, sync and async, the restart resuming exactly the state
the job saved before. Judged by the digests the job printed itself (sha256 of its model and optimizer state)."""

import json
import os
import subprocess
import sys

import pytest

from scout_ckpt.ledger import Ledger
from tests.conftest import REPO


def torchrun_ddp(root, *args) -> list[dict]:
    """examples/train_ddp.py on 3 ranks under torchrun (2 restarts allowed); its SCOUT-EXAMPLE records."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "--max-restarts", "2", "--monitor-interval", "0.5", str(REPO / "examples" / "train_ddp.py"), str(root),
           *map(str, args), "--record"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines() if line.startswith("SCOUT-EXAMPLE ")]


def test_torchrun_restart_walks_back_past_a_load_mismatch_and_resumes_exact_saved_state(tmp_path):
    root = tmp_path / "run"
    # The job's own record of what it saved and loaded: sha256 of its model AND optimizer state, computed by the
    # script itself (examples/train_ddp.py report()), not by scout-ckpt's verifier.
    events = torchrun_ddp(root, "--steps", 16, "--save-every", 5, "--crash-rank", 1, "--crash-step", 12,
                          "--corrupt-load", 10)
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


MID_SAVE = [("sync", 1, "during_write", []), ("async", 0, "before_rename", ["--async"])]


@pytest.mark.scenario
@pytest.mark.scenario_ci
@pytest.mark.parametrize("mode,victim,point,extra", MID_SAVE, ids=[m[0] for m in MID_SAVE])
def test_sigkill_inside_a_save_under_torchrun_resumes_exactly_the_last_saved_state(tmp_path, mode, victim, point,
                                                                                    extra):
    """Rank `victim` SIGKILLs itself inside the save of step 10 (sync: rank 1 in the middle of writing its
    file; async: the coordinator in its commit thread, every file written, before the rename that would publish
    step 10), in torchrun's first attempt. torchrun restarts the job; the interrupted save is recorded as such,
    never resumed from; the restart resumes from step 5 with exactly the model and optimizer state the job
    printed when it saved step 5, saves 10 and 15 again, and finishes."""
    root = tmp_path / "run"
    events = torchrun_ddp(root, "--steps", 16, "--save-every", 5, "--crash-rank", victim, "--crash-step", 10,
                          "--crash-point", point, *extra)
    crashes = [e for e in events if e["event"] == "crash"]
    assert crashes == [{"event": "crash", "attempt": 0, "step": 10, "point": point, "rank": victim}], events
    saved = {(e["attempt"], e["step"]): e["digest"] for e in events if e["event"] == "saved"}
    loaded = {e["attempt"]: (e["step"], e["digest"]) for e in events if e["event"] == "loaded"}
    if mode == "sync":
        assert (0, 10) not in saved   # the save of 10 never returned
    assert loaded[1] == (5, saved[(0, 5)])   # exactly the state saved at step 5, by the job's own digest
    assert 2 not in loaded and {s for a, s in saved if a == 1} == {10, 15}
    with Ledger.open(root, readonly=True) as led:
        assert {r["step"]: r["state"] for r in led.checkpoints()} == {5: "certified", 10: "certified",
                                                                      15: "certified"}
        history = [h for h in led.certifications(10) if h["state"] != "writing"]
        assert history[0]["state"] == "rejected" and history[0]["reasons"][0]["code"] == "save_interrupted", history
        assert [run["resumed_from"] for run in led.runs()] == [None, 5]
    assert not list(root.glob(".step-*"))   # the interrupted attempt's temp dir was cleaned up
