"""A user's plain FSDP2 script (examples/train_fsdp.py: fully_shard on every Linear and the root, AdamW, the
Checkpointer's defaults, no invariant) under real `torchrun --max-restarts`, gloo on CPU.

The oracle is the job's own: at every save and after every load it prints the sha256 of its full (unsharded)
model and optimizer state, gathered with DCP's `get_state_dict(full_state_dict=True)`; a resume is right when the
digest printed after loading step S equals the one printed when S was saved. Certification and attribution are
read back through the command line (`scout-ckpt ls/explain/report --json`), as an operator would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "examples" / "train_fsdp.py"
FLIP_PARAM, FLIP_INDEX = "blocks.1.fc2.weight", 37          # a late parameter, an interior element
UPDATE_PARAM, UPDATE_INDEX = "blocks.1.fc1.weight", 517


def run_job(root, *args, ranks=2, restarts=1, timeout=600):
    """torchrun the example; returns (completed process, the job's SCOUT-FSDP records)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "--max-restarts", str(restarts), "--monitor-interval", "0.5", str(SCRIPT), str(root), *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    recs = [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines() if line.startswith("SCOUT-FSDP ")]
    return p, recs


def cli(*args) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "scout_ckpt.cli", *map(str, args), "--json"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120, check=False)
    return p.returncode, json.loads(p.stdout)


def states(root) -> dict[int, str]:
    rc, out = cli("ls", root)
    assert rc == 0, out
    return {c["step"]: c["state"] for c in out["checkpoints"]}


def saved_digests(recs) -> dict[tuple[int, int], str]:
    return {(r["attempt"], r["step"]): r["digest"] for r in recs if r["event"] == "saved"}


def loaded(recs) -> dict[int, tuple[int, str | None]]:
    return {r["attempt"]: (r["step"], r["digest"]) for r in recs if r["event"] == "loaded"}


def test_plain_fsdp_script_certifies_every_checkpoint_and_resumes_exactly_after_a_kill(tmp_path):
    root = tmp_path / "run"
    p, recs = run_job(root, "--steps", 12, "--save-every", 4, "--crash-rank", 1, "--crash-step", 10)
    assert p.returncode == 0, p.stderr[-3000:]
    saved = saved_digests(recs)
    assert {s for _, s in saved} == {4, 8, 12}
    assert all(r["state"] == "certified" for r in recs if r["event"] == "saved")   # certified at its commit
    got = loaded(recs)
    assert got[0] == (0, None)
    assert got[1] == (8, saved[(0, 8)])              # the job's own digest: exactly the state it saved at 8
    assert states(root) == {4: "certified", 8: "certified", 12: "certified"}
    rc, out = cli("explain", root, 8)
    assert rc == 0 and out["evidence"]["consensus"]["status"] == "not_applicable"
    assert {out["evidence"][k]["status"] for k in ("shard_replay", "at_rest")} == {"pass"}


def verdict(recs, attempt, step) -> dict:
    """The verdict the job's own save returned (rank 0), with its reasons."""
    return next(r for r in recs if r["event"] == "saved" and (r["attempt"], r["step"]) == (attempt, step))


def history(root, step) -> list[str]:
    _, out = cli("explain", root, step)
    return [h["state"] for h in out["history"]]


@pytest.mark.scenario
@pytest.mark.scenario_ci   # the CI tier's FSDP2 shard fault
def test_a_flipped_low_mantissa_bit_in_one_ranks_shard_is_caught_attributed_and_never_resumed(tmp_path):
    root = tmp_path / "run"
    # Rank 1, after the optimizer step of step 8 (a save step): bit 0 of an interior element of a late parameter.
    p, recs = run_job(root, "--steps", 12, "--save-every", 4, "--flip", f"1:8:{FLIP_PARAM}:{FLIP_INDEX}:0",
                      "--kill-after-fault", 1)
    assert p.returncode == 0, p.stderr[-3000:]
    assert any(r["event"] == "fault" and r["rank"] == 1 for r in recs)
    v = verdict(recs, 0, 8)
    assert v["state"] == "rejected"
    assert [(r["code"], r["ranks"], r["tensors"]) for r in v["reasons"]] == [("at_rest_changed", [1], [FLIP_PARAM])]
    saved = saved_digests(recs)
    assert loaded(recs)[1] == (4, saved[(0, 4)])       # resumed before the fault, exactly as saved
    assert states(root) == {4: "certified", 8: "certified", 12: "certified"}   # 8 re-saved clean after the restart
    assert history(root, 8) == ["writing", "rejected", "writing", "certified"]


@pytest.mark.scenario
def test_a_wrong_optimizer_update_on_one_rank_is_caught_and_attributed(tmp_path):
    root = tmp_path / "run"
    # From step 9 on, rank 0's live AdamW update of one element of its shard lands one ulp off; rank 0 dies 6
    # steps later (the cycle is 4 steps here: the fault is found before).
    p, recs = run_job(root, "--steps", 16, "--save-every", 4, "--update-fault",
                      f"0:9:{UPDATE_PARAM}:{UPDATE_INDEX}", "--kill-after-fault", 6)
    assert p.returncode == 0, p.stderr[-3000:]
    assert any(r["event"] == "fault" and r["rank"] == 0 for r in recs)
    _, rep = cli("report", root)
    sdc = [e for e in rep["events"] if e["kind"] == "sdc" and e["detail"].get("source") == "shard_replay"]
    assert sdc and all(e["ranks"] == [0] for e in sdc), sdc            # attributed to the faulty rank
    found = min(e["step"] for e in sdc)
    assert 9 <= found < 9 + 4
    where = [w for e in sdc for r in e["detail"]["reasons"] for w in r.get("where", [])]
    assert any(w.startswith(f"{UPDATE_PARAM}[{UPDATE_INDEX}]") for w in where), where
    # Every save the fault may be in (a cycle before it was found, and after) is rejected, at commit or revoked.
    first_bad = min(s for s in (4, 8, 12) if s > found - 4)
    for s in (4, 8, 12):
        if s >= first_bad:
            assert "rejected" in history(root, s), (s, history(root, s))
    saved = saved_digests(recs)
    resumed = max(s for s in (4, 8, 12) if s < first_bad)
    assert loaded(recs)[1] == (resumed, saved[(0, resumed)])         # before the fault, exactly as saved
    assert resumed < 9


@pytest.mark.scenario
def test_hsdp_keeps_consensus_across_replicas_and_adds_shard_evidence(tmp_path):
    root = tmp_path / "run"
    # 2x2 (replicate, shard); rank 3 flips a low bit at step 8 and dies a step later.
    p, recs = run_job(root, "--hsdp", "--steps", 12, "--save-every", 4, "--flip",
                      f"3:8:{FLIP_PARAM}:{FLIP_INDEX}:0", "--kill-after-fault", 1, ranks=4)
    assert p.returncode == 0, p.stderr[-3000:]
    _, out = cli("explain", root, 4)
    assert out["state"] == "certified"
    assert {k: out["evidence"][k]["status"] for k in ("consensus", "shard_replay", "at_rest")} == \
        {"consensus": "pass", "shard_replay": "pass", "at_rest": "pass"}
    assert states(root) == {4: "certified", 8: "certified", 12: "certified"}    # 8 re-saved after the restart
    saved = saved_digests(recs)
    assert loaded(recs)[1] == (4, saved[(0, 4)])
    # The rejected attempt of 8: at rest names rank 3; consensus across the replicate dim saw its copy differ
    # from rank 1's (two copies: detected, not attributable by consensus alone).
    v = verdict(recs, 0, 8)
    assert v["state"] == "rejected"
    codes = {(r["code"], tuple(r.get("ranks") or ())) for r in v["reasons"]}
    assert ("at_rest_changed", (3,)) in codes, codes
    assert any(c.startswith("consensus") for c, _ in codes), codes


@pytest.mark.scenario
def test_the_first_save_is_certified_at_its_commit_when_the_cycle_is_longer_than_the_save_interval(tmp_path):
    root = tmp_path / "run"
    p, recs = run_job(root, "--d-model", 256, "--steps", 20, "--save-every", 10)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [(r["step"], r["state"]) for r in recs if r["event"] == "saved"] == [(10, "certified"), (20, "certified")]
    _, out = cli("explain", root, 10)
    ev = out["evidence"]["shard_replay"]
    assert ev["cycle"] > 20 and ev["steps"] == [1, 10] and ev["status"] == "pass"   # every step since the start
