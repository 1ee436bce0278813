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
from tests.placement import place
from tests.torchrun_errors import why_failed

WORLD, STEPS, SAVE_EVERY = 3, 16, 5
SAVES = range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)  # 5, 10, 15


def saves_before(step: int) -> list[int]:
    """The saves the job completed before a crash at `step` (after its optimizer step, or inside its save)."""
    return [s for s in SAVES if s < step]


def torchrun_ddp(root, *args) -> list[dict]:
    """examples/train_ddp.py on 3 ranks under torchrun (2 restarts allowed); its SCOUT-EXAMPLE records."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(WORLD),
        "--max-restarts",
        "2",
        "--monitor-interval",
        "0.5",
        str(REPO / "examples" / "train_ddp.py"),
        str(root),
        *map(str, args),
        "--record",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, why_failed(p.stderr)
    return [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines() if line.startswith("SCOUT-EXAMPLE ")]


@pytest.mark.scenario
@pytest.mark.scenario_ci  # 15-30 s on 2 cores: CI runs it in its scenario tier, keeping make test within 15 min
def test_torchrun_restart_walks_back_past_a_load_mismatch_and_resumes_exact_saved_state(tmp_path, request):
    # Any rank SIGKILLed after the optimizer step of a step past the second save (so the restart has a checkpoint
    # to walk back past, and one before it), placed by the session's seed.
    pl = place(request, ranks=range(WORLD), steps=range(SAVES[1] + 1, STEPS))
    done = saves_before(pl.step)
    newest, before = done[-1], done[-2]  # the newest save before the crash loads wrongly; the one before it is good
    root = tmp_path / "run"
    # The job's own record of what it saved and loaded: sha256 of its model AND optimizer state, computed by the
    # script itself (examples/train_ddp.py report()), not by scout-ckpt's verifier.
    events = torchrun_ddp(
        root,
        "--steps",
        STEPS,
        "--save-every",
        SAVE_EVERY,
        "--crash-rank",
        pl.rank,
        "--crash-step",
        pl.step,
        "--corrupt-load",
        newest,
    )
    assert [e for e in events if e["event"] == "crash"] == [
        {"event": "crash", "attempt": 0, "step": pl.step, "point": "after_optimizer_step", "rank": pl.rank}
    ], (pl, events)
    saved = {(e["attempt"], e["step"]): e["digest"] for e in events if e["event"] == "saved"}
    loaded = {e["attempt"]: (e["step"], e["digest"]) for e in events if e["event"] == "loaded"}
    assert loaded[0][0] == 0, pl
    # The newest checkpoint loaded wrongly in the restart: rejected, and the same call resumed from the one
    # before it, exactly as saved.
    assert loaded[1] == (before, saved[(0, before)]), (pl, loaded)
    assert 2 not in loaded, pl  # no crash loop: the restarted attempt ran to the end
    assert {s for a, s in saved if a == 1} == {s for s in SAVES if s > before}, (pl, saved)
    with Ledger.open(root, readonly=True) as led:
        # the newest was saved again by the restarted job: a new attempt whose history keeps the rejection.
        assert {r["step"]: r["state"] for r in led.checkpoints()} == {s: "certified" for s in SAVES}, pl
        history = led.certifications(newest)
        assert any(h["state"] == "rejected" and h["reasons"][0]["code"] == "load_mismatch" for h in history), (
            pl,
            history,
        )
        assert led.runs()[-1]["resumed_from"] == before, pl


# (mode, the ranks the point is reached on, point, flags): every rank writes its file; only the coordinator
# (rank 0) publishes the checkpoint by the rename
MID_SAVE = [("sync", range(WORLD), "during_write", []), ("async", [0], "before_rename", ["--async"])]


@pytest.mark.scenario
@pytest.mark.scenario_ci
@pytest.mark.parametrize("mode,victims,point,extra", MID_SAVE, ids=[m[0] for m in MID_SAVE])
def test_sigkill_inside_a_save_under_torchrun_resumes_exactly_the_last_saved_state(
    tmp_path, request, mode, victims, point, extra
):
    """A rank SIGKILLs itself inside a save after the first (sync: any rank, in the middle of writing its file;
    async: the coordinator in its commit thread, every file written, before the rename that would publish the
    step), in torchrun's first attempt; rank and save placed by the session's seed. torchrun restarts the job;
    the interrupted save is recorded as such, never resumed from; the restart resumes from the save before it
    with exactly the model and optimizer state the job printed when it saved that step, saves the later steps
    again, and finishes."""
    pl = place(request, ranks=victims, steps=SAVES[1:])
    resumed = saves_before(pl.step)[-1]
    root = tmp_path / "run"
    events = torchrun_ddp(
        root,
        "--steps",
        STEPS,
        "--save-every",
        SAVE_EVERY,
        "--crash-rank",
        pl.rank,
        "--crash-step",
        pl.step,
        "--crash-point",
        point,
        *extra,
    )
    crashes = [e for e in events if e["event"] == "crash"]
    assert crashes == [{"event": "crash", "attempt": 0, "step": pl.step, "point": point, "rank": pl.rank}], (pl, events)
    saved = {(e["attempt"], e["step"]): e["digest"] for e in events if e["event"] == "saved"}
    loaded = {e["attempt"]: (e["step"], e["digest"]) for e in events if e["event"] == "loaded"}
    if mode == "sync":
        assert (0, pl.step) not in saved, pl  # the interrupted save never returned
    assert loaded[1] == (resumed, saved[(0, resumed)]), (pl, loaded)  # exactly that state, by the job's own digest
    assert 2 not in loaded and {s for a, s in saved if a == 1} == {s for s in SAVES if s > resumed}, (pl, saved)
    with Ledger.open(root, readonly=True) as led:
        assert {r["step"]: r["state"] for r in led.checkpoints()} == {s: "certified" for s in SAVES}, pl
        history = [h for h in led.certifications(pl.step) if h["state"] != "writing"]
        assert history[0]["state"] == "rejected" and history[0]["reasons"][0]["code"] == "save_interrupted", (
            pl,
            history,
        )
        assert [run["resumed_from"] for run in led.runs()] == [None, resumed], pl
    assert not list(root.glob(".step-*")), pl  # the interrupted attempt's temp dir was cleaned up
