"""examples/nanogpt/train.py (nanoGPT's train.py shape, the README's integration) under real torchrun."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_cli

SCRIPT = REPO / "examples" / "nanogpt" / "train.py"


def _torchrun(out_dir, *overrides, restarts=2):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.5",
        str(SCRIPT),
        f"--out_dir={out_dir}",
        f"--log_file={out_dir}/log",
        *overrides,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def _log(out_dir, rank):
    return [json.loads(line) for line in (out_dir / f"log.rank{rank}").read_text().splitlines()]


@pytest.mark.scenario
@pytest.mark.scenario_ci  # 15-30 s on 2 cores: CI runs it in its scenario tier, keeping make test within 15 min
@pytest.mark.slow
def test_nanogpt_killed_rank_resumes_exact_saved_state(tmp_path):
    out = tmp_path / "gpt"
    _torchrun(out, "--max_iters=12", "--eval_interval=4", "--crash_rank=1", "--crash_iter=10")
    for rank in (0, 1):
        log = _log(out, rank)
        saved = {e["iter"]: e for e in log if e["event"] == "save" and e["attempt"] == 0}
        resumed = [e for e in log if e["event"] == "resume" and e["attempt"] == 1]
        assert sorted(saved) == [4, 8] and len(resumed) == 1
        # The oracle: what the job itself printed when it saved step 8, on each rank (model, optimizer, and the
        # rank's own prefetched batch restored through RankLocal).
        assert resumed[0]["iter"] == 8
        assert resumed[0]["digest"] == saved[8]["digest"] and resumed[0]["batch"] == saved[8]["batch"]
        # nanoGPT evaluates (and so saves) at the top of the loop: the resumed run saves 8 again, then 12
        assert [e["iter"] for e in log if e["event"] == "save" and e["attempt"] == 1] == [8, 12]
    rc, stdout, _ = run_cli("ls", out, "--json")
    assert rc == 0
    assert {c["step"]: c["state"] for c in json.loads(stdout)["checkpoints"]} == {
        4: "certified",
        8: "certified",
        12: "certified",
    }
    rc, stdout, _ = run_cli("resume", out, "--latest-clean")
    assert rc == 0 and stdout.strip().endswith("step-00000012")


@pytest.mark.scenario
@pytest.mark.slow
def test_nanogpt_wrapped_or_unwrapped_model_gives_the_same_replay_targets(tmp_path):
    from scout_ckpt.ledger import Ledger

    targets = {}
    for unwrapped in (False, True):
        out = tmp_path / f"gpt-{unwrapped}"
        _torchrun(
            out, "--max_iters=4", "--eval_interval=4", "--replay=True", f"--pass_unwrapped={unwrapped}", restarts=0
        )
        with Ledger.open(out, readonly=True) as led:
            targets[unwrapped] = led.runs()[-1]["policy"]["replay_targets"]
            assert {r["step"]: r["state"] for r in led.checkpoints()} == {4: "certified"}
    assert targets[False] == targets[True]
    names = {t[1] if isinstance(t, list) else t for t in targets[False]}
    assert {"transformer.h.0", "transformer.h.1"} <= names, names
