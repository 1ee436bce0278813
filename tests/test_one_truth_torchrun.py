"""The fault placements of one-truth-per-step under real torchrun, with the defaults (replay, consensus, the fast
tier every 2 steps, a durable save every 6), at 2 and at 3 ranks, one rank per node (each node its own local
directory, peer copies on the next node).

A first generation trains steps 1-8 (durable step 6; local steps 2, 4, 6 and 8, all kept); then a step is lowered
the way an operator or the job's own evidence would lower it, and a second generation restarts. Each restart is
judged by the digest the job printed when it saved (tests/scripts/fast_tier_job.py: sha256 of its model and
optimizer, computed without scout-ckpt): it loads exactly the newest step nobody lowered, never the lowered one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scout_ckpt.testing import agents
from tests.conftest import REPO, run_cli

SCRIPT = REPO / "tests" / "scripts" / "fast_tier_job.py"
JOB = ["--save-every", "6", "--local-every", "2", "--keep-local", "4"]


def _agents(root: Path, dirs: list[Path], steps: int, script: Path = SCRIPT, max_restarts: int = 2):
    return agents.run_agents(
        script,
        [str(root), "--steps", str(steps), *JOB],
        nnodes=len(dirs),
        nproc=1,
        repo=REPO,
        max_restarts=max_restarts,
        first_hosts=True,
        timeout=600,
        node_env={n: {"SCOUT_TEST_LOCAL_DIR": str(d)} for n, d in enumerate(dirs)},
    )


def _lines(results) -> list[dict]:
    dec, out = json.JSONDecoder(), []
    for r in results:
        for chunk in r.stdout.split("FT-JOB ")[1:]:
            out.append(dec.raw_decode(chunk)[0])
    return out


def _run(root: Path, dirs: list[Path], steps: int) -> list[dict]:
    results = _agents(root, dirs, steps)
    for node, r in enumerate(results):
        assert r.returncode == 0, (node, r.stderr[-4000:])
    return _lines(results)


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def _generation_one(request, tmp_path_factory):
    """Steps 1-8 at `world` ranks; the digests every rank printed at each save (local and durable)."""
    world = request.param
    base = tmp_path_factory.mktemp(f"gen1-{world}")
    dirs = [base / f"node-disk-{i}" for i in range(world)]
    lines = _run(base / "run", dirs, 8)
    printed = {(e["rank"], e["step"]): e["digest"] for e in lines if e["event"] in ("local_saved", "saved")}
    states = {e["step"]: e["state"] for e in lines if e["event"] == "saved"}
    assert states == {6: "certified"}, states
    return base, world, printed


@pytest.fixture
def generation_one(_generation_one, tmp_path):
    base, world, printed = _generation_one
    shutil.copytree(base, tmp_path / "gen", symlinks=True)
    root = tmp_path / "gen" / "run"
    return root, [tmp_path / "gen" / f"node-disk-{i}" for i in range(world)], world, printed


def _local_states(root: Path) -> dict[int, str]:
    rc, out, err = run_cli("ls", root, "--json")
    assert rc == 0, err
    return {r["step"]: r["state"] for r in json.loads(out)["local"]}


def _quarantine(root: Path, *steps: int) -> None:
    for s in steps:
        run_cli("quarantine", root, str(s), "--reason", "suspect node", check_rc=0)


def _revoke_6(root: Path) -> None:
    """An update fault found at step 7 by the shard evidence, cycle 2 (ShardEvidence.revoke, the call the job
    makes): steps in (5, 7] are charged, durable step 6 and local step 6 alike."""
    from types import SimpleNamespace

    from scout_ckpt.ledger import Ledger
    from scout_ckpt.save.evidence.shard import ShardEvidence

    shard = ShardEvidence.__new__(ShardEvidence)
    shard.log = SimpleNamespace(cycle=2)
    bad = {"step": 7, "status": "fail", "ranks": [1], "reasons": [{"code": "shard_replay_mismatch", "ranks": [1]}]}
    with Ledger.open(root) as led:
        assert 6 in shard.revoke(led, root, [bad])


# placement -> (how step(s) are lowered, the step the restart must load)
PLACEMENTS = {
    # a step the fast tier alone holds, quarantined by the operator
    "quarantine_local_step": (lambda root: _quarantine(root, 8), 6),
    # a step both tiers hold, quarantined once, and the newest: the restart goes to local step 4
    "quarantine_both_tiers": (lambda root: _quarantine(root, 8, 6), 4),
    # revocation across tiers: the durable and the local copy of step 6 rejected by one decision
    "revocation_across_tiers": (lambda root: (_quarantine(root, 8), _revoke_6(root)), 4),
}


@pytest.mark.scenario
@pytest.mark.parametrize(
    "placement",
    [
        "quarantine_local_step",
        "quarantine_both_tiers",
        "revocation_across_tiers",
    ],
)
def test_a_restart_under_torchrun_loads_the_newest_step_nobody_lowered(generation_one, placement):
    root, dirs, world, printed = generation_one
    lower, expect = PLACEMENTS[placement]
    assert _local_states(root)[8] == "certified"
    lower(root)
    lines = _run(root, dirs, expect + 1)  # the restart and one step: no save over a lowered step
    loads = {e["rank"]: e for e in lines if e["event"] == "loaded"}
    assert sorted(loads) == list(range(world)), loads
    for rank, e in loads.items():
        assert e["step"] == expect, (placement, e)
        assert e["digest"] == printed[(rank, expect)], (placement, rank, e)
        assert e["digest"] != printed[(rank, 8)]
    assert _local_states(root)[8] == "quarantined"  # the operator's decision stands after the restart


@pytest.mark.scenario
def test_eio_on_every_candidate_under_torchrun_refuses_the_start_and_rejects_nothing(generation_one):
    """Every step folder and every node-local file answers EIO in the restarted job: every rank refuses the
    start (CheckpointsUnreadable) instead of training from step 0 over the checkpoints, so no rank loads or saves
    anything; once the storage answers, the next restart loads step 8 (the digest the job printed at step 8)."""
    root, dirs, world, printed = generation_one
    before = _local_states(root)
    results = _agents(root, dirs, 9, script=REPO / "tests" / "scripts" / "eio_fast_tier_job.py", max_restarts=0)
    assert all(r.returncode != 0 for r in results), [r.returncode for r in results]
    assert "CheckpointsUnreadable" in "".join(r.stderr for r in results)
    lines = _lines(results)
    assert [e for e in lines if e["event"] in ("loaded", "local_saved", "saved")] == [], lines
    assert _local_states(root) == before  # could-not-check rejected nothing
    loads = {e["rank"]: e for e in _run(root, dirs, 9) if e["event"] == "loaded"}
    assert {(r, e["step"], e["digest"]) for r, e in loads.items()} == {(r, 8, printed[(r, 8)]) for r in range(world)}


@pytest.mark.scenario
@pytest.mark.parametrize(
    "world",
    [pytest.param(2, marks=pytest.mark.scenario_ci), 3],  # CI: one generation and its restart, 30-40 s
    ids=["2ranks", "3ranks"],
)
def test_a_local_verdict_racing_the_durable_save_ends_the_generation_before_it_certifies(tmp_path, world):
    """Rank 1's local save at step 6 holds a NaN (its commit slowed by 2 s); the NaN is gone before the durable
    save of step 6. The durable save waits for the local verdict: the generation ends (LiveStateCorrupt) before
    step 6 is certified in either tier, torchrun restarts it, and the restart loads local step 4 (the digest the
    job printed at step 4), then trains on to step 8 cleanly."""
    root, dirs = tmp_path / "run", [tmp_path / f"node-disk-{i}" for i in range(world)]
    results = _agents(root, dirs, 8, script=REPO / "tests" / "scripts" / "race_fast_tier_job.py")
    for node, r in enumerate(results):
        assert r.returncode == 0, (node, r.stderr[-4000:])
    lines = _lines(results)
    faults = [e for e in lines if e["event"] == "live_fault"]
    # Every rank raises LiveStateCorrupt, but each is its own agent here: the first rank to exit has torchrun tear
    # the others down, and a loaded machine (make stress, .ci/run beside two CPU burners) can end a rank before it
    # prints. What the run must show: the live fault at step 6, never a durable save of the first generation, and
    # the restart's loads below.
    assert faults and {e["fault_step"] for e in faults} == {6}, lines
    first_run = {e["run_id"] for e in faults}
    assert [e for e in lines if e["event"] == "saved" and e["run_id"] in first_run] == []
    printed = {(e["rank"], e["step"]): e["digest"] for e in lines if e["event"] == "local_saved" and e["step"] == 4}
    loads = [e for e in lines if e["event"] == "loaded" and e["run_id"] not in first_run]
    assert {(e["rank"], e["step"], e["tier"]) for e in loads} == {(r, 4, "local") for r in range(world)}, loads
    assert all(e["digest"] == printed[(e["rank"], 4)] for e in loads), loads
