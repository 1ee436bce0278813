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
from tests.placement import place
from tests.torchrun_errors import why_failed

SCRIPT = REPO / "examples" / "train_fsdp.py"
FLIP_PARAM, FLIP_INDEX = "blocks.1.fc2.weight", 37  # a late parameter, an interior element
UPDATE_PARAM, UPDATE_INDEX = "blocks.1.fc1.weight", 517


def run_job(root, *args, ranks=2, restarts=1, timeout=600):
    """torchrun the example; returns (completed process, the job's SCOUT-FSDP records)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONFAULTHANDLER": "1",
    }  # a fatal signal prints every thread's stack
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.5",
        str(SCRIPT),
        str(root),
        *map(str, args),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    recs = [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines() if line.startswith("SCOUT-FSDP ")]
    return p, recs


def cli(*args) -> tuple[int, dict]:
    p = subprocess.run(
        [sys.executable, "-m", "scout_ckpt.cli", *map(str, args), "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
        check=False,
    )
    return p.returncode, json.loads(p.stdout)


def states(root) -> dict[int, str]:
    rc, out = cli("ls", root)
    assert rc == 0, out
    return {c["step"]: c["state"] for c in out["checkpoints"]}


def saved_digests(recs) -> dict[tuple[int, int], str]:
    return {(r["attempt"], r["step"]): r["digest"] for r in recs if r["event"] == "saved"}


def loaded(recs) -> dict[int, tuple[int, str | None]]:
    return {r["attempt"]: (r["step"], r["digest"]) for r in recs if r["event"] == "loaded"}


@pytest.mark.scenario
@pytest.mark.scenario_ci  # 15-30 s on 2 cores: CI runs it in its scenario tier, keeping make test within 15 min
def test_plain_fsdp_script_certifies_every_checkpoint_and_resumes_exactly_after_a_kill(tmp_path, request):
    # either rank SIGKILLed after the optimizer step of any step after the first save, placed by the seed
    pl = place(request, ranks=range(2), steps=range(5, 13))
    resumed = max(s for s in (4, 8, 12) if s < pl.step)  # the newest save before the kill
    root = tmp_path / "run"
    p, recs = run_job(root, "--steps", 12, "--save-every", 4, "--crash-rank", pl.rank, "--crash-step", pl.step)
    assert p.returncode == 0, (pl, why_failed(p.stderr))
    assert [(r["rank"], r["step"], r["attempt"]) for r in recs if r["event"] == "crash"] == [(pl.rank, pl.step, 0)], (
        pl,
        recs,
    )
    saved = saved_digests(recs)
    assert {s for _, s in saved} == {4, 8, 12}, pl
    assert all(r["state"] == "certified" for r in recs if r["event"] == "saved"), (pl, recs)  # at its commit
    got = loaded(recs)
    assert got[0] == (0, None), pl
    assert got[1] == (resumed, saved[(0, resumed)]), (pl, got)  # the job's own digest: exactly the state saved
    assert states(root) == {4: "certified", 8: "certified", 12: "certified"}, pl
    rc, out = cli("explain", root, resumed)
    assert rc == 0 and out["evidence"]["consensus"]["status"] == "not_applicable", (pl, out)
    assert {out["evidence"][k]["status"] for k in ("shard_replay", "at_rest")} == {"pass"}, (pl, out)


def verdict(recs, attempt, step) -> dict:
    """The verdict the job's own save returned (rank 0), with its reasons."""
    return next(r for r in recs if r["event"] == "saved" and (r["attempt"], r["step"]) == (attempt, step))


def history(root, step) -> list[str]:
    _, out = cli("explain", root, step)
    return [h["state"] for h in out["history"]]


@pytest.mark.scenario
@pytest.mark.scenario_ci  # the CI tier's FSDP2 shard fault
def test_a_flipped_low_mantissa_bit_in_one_ranks_shard_is_caught_attributed_and_never_resumed(tmp_path, request):
    # Either rank (placed by the seed), after the optimizer step of step 8: a save step with a clean save before
    # it to resume from and one after it (the restart's) in the 12 steps: bit 0 of an interior element of a late
    # parameter.
    pl = place(request, ranks=range(2), steps=[8])
    root = tmp_path / "run"
    p, recs = run_job(
        root,
        "--steps",
        12,
        "--save-every",
        4,
        "--flip",
        f"{pl.rank}:{pl.step}:{FLIP_PARAM}:{FLIP_INDEX}:0",
        "--kill-after-fault",
        1,
    )
    assert p.returncode == 0, (pl, why_failed(p.stderr))
    assert any(r["event"] == "fault" and r["rank"] == pl.rank for r in recs), (pl, recs)
    v = verdict(recs, 0, pl.step)
    assert v["state"] == "rejected", (pl, v)
    assert [(r["code"], r["ranks"], r["tensors"]) for r in v["reasons"]] == [
        ("at_rest_changed", [pl.rank], [FLIP_PARAM])
    ], (pl, v)
    saved = saved_digests(recs)
    assert loaded(recs)[1] == (pl.step - 4, saved[(0, pl.step - 4)]), pl  # resumed before the fault, as saved
    assert states(root) == {4: "certified", 8: "certified", 12: "certified"}, pl  # re-saved clean after restart
    assert history(root, pl.step) == ["writing", "rejected", "writing", "certified"], pl


@pytest.mark.scenario
def test_a_wrong_optimizer_update_on_one_rank_is_caught_and_attributed(tmp_path, request):
    # From a step placed by the seed on, one rank's live AdamW update of one element of its shard lands one ulp
    # off; the rank dies 6 steps later (the cycle is 4 steps here: the fault is found before). The step is 9 or
    # 10: more than a cycle after the first save (a clean save before every one the fault may be in), the kill
    # within the 16 steps, and not a save step (there the save's replay sweep meets the fault first: its
    # optimizer replays disagree, inconclusive with 2 ranks, and the generation ends at that save).
    pl = place(request, ranks=range(2), steps=range(9, 11))
    root = tmp_path / "run"
    p, recs = run_job(
        root,
        "--steps",
        16,
        "--save-every",
        4,
        "--update-fault",
        f"{pl.rank}:{pl.step}:{UPDATE_PARAM}:{UPDATE_INDEX}",
        "--kill-after-fault",
        6,
    )
    assert p.returncode == 0, (pl, why_failed(p.stderr))
    assert any(r["event"] == "fault" and r["rank"] == pl.rank for r in recs), (pl, recs)
    _, rep = cli("report", root)
    sdc = [e for e in rep["events"] if e["kind"] == "sdc" and e["detail"].get("source") == "shard_replay"]
    assert sdc and all(e["ranks"] == [pl.rank] for e in sdc), (pl, sdc)  # attributed to the faulty rank
    found = min(e["step"] for e in sdc)
    assert pl.step <= found < pl.step + 4, (pl, found)
    where = [w for e in sdc for r in e["detail"]["reasons"] for w in r.get("where", [])]
    assert any(w.startswith(f"{UPDATE_PARAM}[{UPDATE_INDEX}]") for w in where), (pl, where)
    # Every save the fault may be in (a cycle before it was found, and after) is rejected, at commit or revoked.
    first_bad = min(s for s in (4, 8, 12) if s > found - 4)
    for s in (4, 8, 12):
        if s >= first_bad:
            assert "rejected" in history(root, s), (pl, s, history(root, s))
    saved = saved_digests(recs)
    resumed = max(s for s in (4, 8, 12) if s < first_bad)
    assert loaded(recs)[1] == (resumed, saved[(0, resumed)]), pl  # before the fault, exactly as saved
    assert resumed < pl.step, pl


@pytest.mark.scenario
def test_hsdp_keeps_consensus_across_replicas_and_adds_shard_evidence(tmp_path, request):
    # 2x2 (replicate, shard); a rank placed by the seed flips a low bit at step 8 (as in the flip test above) and
    # dies a step later.
    pl = place(request, ranks=range(4), steps=[8])
    root = tmp_path / "run"
    p, recs = run_job(
        root,
        "--hsdp",
        "--steps",
        12,
        "--save-every",
        4,
        "--flip",
        f"{pl.rank}:{pl.step}:{FLIP_PARAM}:{FLIP_INDEX}:0",
        "--kill-after-fault",
        1,
        ranks=4,
    )
    assert p.returncode == 0, (pl, why_failed(p.stderr))
    _, out = cli("explain", root, 4)
    assert out["state"] == "certified", (pl, out)
    assert {k: out["evidence"][k]["status"] for k in ("consensus", "shard_replay", "at_rest")} == {
        "consensus": "pass",
        "shard_replay": "pass",
        "at_rest": "pass",
    }, (pl, out)
    assert states(root) == {4: "certified", 8: "certified", 12: "certified"}, pl  # 8 re-saved after the restart
    saved = saved_digests(recs)
    assert loaded(recs)[1] == (4, saved[(0, 4)]), pl
    # The rejected attempt of 8: at rest names the faulty rank; consensus across the replicate dim saw its copy
    # differ from its replica's (two copies: detected, not attributable by consensus alone).
    v = verdict(recs, 0, pl.step)
    assert v["state"] == "rejected", (pl, v)
    codes = {(r["code"], tuple(r.get("ranks") or ())) for r in v["reasons"]}
    assert ("at_rest_changed", (pl.rank,)) in codes, (pl, codes)
    assert any(c.startswith("consensus") for c, _ in codes), (pl, codes)


@pytest.mark.scenario
def test_the_first_save_is_certified_at_its_commit_when_the_cycle_is_longer_than_the_save_interval(tmp_path):
    root = tmp_path / "run"
    p, recs = run_job(root, "--d-model", 256, "--steps", 20, "--save-every", 10)
    assert p.returncode == 0, why_failed(p.stderr)
    assert [(r["step"], r["state"]) for r in recs if r["event"] == "saved"] == [(10, "certified"), (20, "certified")]
    _, out = cli("explain", root, 10)
    ev = out["evidence"]["shard_replay"]
    assert ev["cycle"] > 20 and ev["steps"] == [1, 10] and ev["status"] == "pass"  # every step since the start
