"""Two jobs on one ROOT (#25, "also look at"): the second may not save into the first one's run.

Real `torchrun` jobs (tests/scripts/fsdp_interval_job.py: FSDP2, 2 gloo ranks, the Checkpointer's defaults). The
first saves step 5 and then stays alive (paused); a second job, launched by another torchrun on the same ROOT,
starts, loads what is certified (as an evaluation job may), and is refused at its first save with one clear error
on every rank (RootInUse as the cause of SaveRefused); nothing of the first job's is touched. The first then runs
on to 10, certified, judged by its own printed digests. A restart of the same job on that ROOT afterwards (a new
torchrun, the lease free since the first one exited) resumes at 10 exactly as saved. The torchrun restart of one
job (same TORCHELASTIC_RUN_ID, a new generation) is exercised by test_murphy_interval.py's flip test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from scout_ckpt.errors import RootInUse
from scout_ckpt.ops.startup import take_run_lease
from tests.conftest import REPO
from tests.test_murphy_interval import cli, run_job, saved

SCRIPT_ARGS = ("--save-every", 5)


def test_the_run_lease_is_shared_in_one_process_and_refuses_another(tmp_path):
    a = take_run_lease(tmp_path)
    b = take_run_lease(tmp_path)  # a second Checkpointer of the same process: the same lease
    assert a is b and a.held
    a.record()  # what open_run_ledger does once the start succeeded
    code = (
        "import sys; from scout_ckpt.ops.startup import take_run_lease; from scout_ckpt.errors import RootInUse\n"
        "l = take_run_lease(sys.argv[1], wait_s=0)\n"
        "try:\n    l.check()\nexcept RootInUse as e:\n    print('refused', e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.stdout.startswith("refused") and "another job is saving checkpoints here" in p.stdout, p
    assert f"pid {os.getpid()}" in p.stdout
    a.release()
    b.release()  # the last user lets go: another process may take it now
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "", p
    assert issubclass(RootInUse, Exception)


@pytest.mark.scenario
def test_a_second_job_on_a_live_root_is_refused_and_the_first_stays_certified(tmp_path):
    root, signals = tmp_path / "run", tmp_path / "signals"
    signals.mkdir()
    first = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, json; from tests.test_murphy_interval import run_job\n"
            "p, recs = run_job(sys.argv[1], '--steps', 10, '--save-every', 5, '--pause-after', '5:' + sys.argv[2],"
            " restarts=0)\nprint(json.dumps({'rc': p.returncode, 'recs': recs, 'err': p.stderr[-3000:]}))",
            str(root),
            str(signals),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(REPO),
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + 600
        while len(list(signals.glob("paused-*"))) < 2 and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.2)
        assert len(list(signals.glob("paused-*"))) == 2, "the first job never reached its pause"
        p, recs = run_job(root, "--steps", 10, *SCRIPT_ARGS, restarts=0)
        assert p.returncode != 0
        assert "another job is saving checkpoints here" in p.stderr and "checkpoint 10 not saved" in p.stderr, p.stderr[
            -3000:
        ]
        assert not [r for r in recs if r["event"] == "saved"]  # nothing saved into the first job's ROOT
        assert next(r for r in recs if r["event"] == "loaded")["step"] == 5  # it could load what is certified
    finally:
        (signals / "go").touch()
        out, _ = first.communicate(timeout=900)
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["rc"] == 0, doc["err"]
    mine = saved(doc["recs"], 0)
    assert {s: v["state"] for s, v in mine.items()} == {5: "certified", 10: "certified"}
    assert {c["step"]: c["state"] for c in cli("ls", root)["checkpoints"]} == {5: "certified", 10: "certified"}
    # the same job started again on its ROOT (the lease is free): it resumes at 10, exactly as saved
    p, recs = run_job(root, "--steps", 15, *SCRIPT_ARGS, restarts=0)
    assert p.returncode == 0, p.stderr[-3000:]
    loaded = next(r for r in recs if r["event"] == "loaded")
    assert (loaded["step"], loaded["digest"]) == (10, mine[10]["digest"])
    assert saved(recs, 0)[15]["state"] == "certified"
