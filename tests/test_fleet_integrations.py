"""Every integration's jobs name hardware: the HF Trainer, Accelerate, Lightning, TorchTitan, DeepSpeed and
Megatron-Core jobs of the integrations' own tests, run with SCOUT_CKPT_HOST / SCOUT_CKPT_JOB / SCOUT_CKPT_FLEET set,
record where each rank ran (host, local rank, device) with the run, which is what every event naming a rank carries
into the fleet record (ledger events' detail.devices). The oracle is the launch: one torchrun agent of 2 workers on
the host the test names, so rank r is local rank r there. One Trainer job with an SDC placed on rank 1 goes all the
way: the fleet store lists that host and local rank, and no other."""

from __future__ import annotations

import json

import pytest

from scout_ckpt.ledger import Ledger
from tests import framework_jobs
from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.scenario


def fleet_env(monkeypatch, tmp_path, host: str) -> dict:
    env = {"SCOUT_CKPT_HOST": host, "SCOUT_CKPT_JOB": f"job-{host}", "SCOUT_CKPT_FLEET": str(tmp_path / "fleet.db")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # the launch helpers pass os.environ on to torchrun and its workers
    return env


def places(root) -> list[tuple]:
    """(rank, host, local rank, device) of every rank of every run in ROOT's ledger."""
    with Ledger.open(root, readonly=True) as led:
        return [
            (
                p["rank"],
                (p["device"] or {}).get("host"),
                (p["device"] or {}).get("local_rank"),
                (p["device"] or {}).get("device"),
            )
            for run in led.runs()
            for p in led.rank_places(run["id"])
        ]


def torchrun_placed(host: str, runs: int = 1) -> list[tuple]:
    return [(r, host, r, f"{host}:cpu{r}") for _ in range(runs) for r in range(2)]


def test_hf_trainer_records_where_each_rank_ran_and_its_sdc_reaches_the_fleet_store(tmp_path, monkeypatch):
    from tests.test_integration_transformers import torchrun

    fleet_env(monkeypatch, tmp_path, "node-hf")
    out = tmp_path / "out"
    torchrun(out, "--sdc-rank", 1, "--sdc-step", 3, "--no-resume", ranks=3, limit=None)
    with Ledger.open(out, readonly=True) as led:
        run = led.runs()[-1]["id"]
        got = [(p["rank"], p["device"]["host"], p["device"]["local_rank"]) for p in led.rank_places(run)]
    assert got == [(r, "node-hf", r) for r in range(3)]
    _, so, _ = run_cli("suspects", "--json", "--fleet", tmp_path / "fleet.db", check_rc=0)
    # sdc verdicts only: on loaded cores the observer may name a straggler, which is not this test's fault
    listed = [(s["host"], s["local_rank"], s["jobs"]) for s in json.loads(so)["suspects"] if "sdc" in s["verdicts"]]
    assert listed == [("node-hf", 1, ["job-node-hf"])]


def test_deepspeed_records_where_each_rank_ran(tmp_path, monkeypatch):
    fleet_env(monkeypatch, tmp_path, "node-ds")
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    script = REPO / "tests" / "scripts" / "ds_job.py"
    framework_jobs.torchrun(
        script, save_dir, ev, "--stage", 1, "--steps", 2, "--save-every", 2, "--accept-single-owner"
    )
    assert places(save_dir) == torchrun_placed("node-ds")


def test_megatron_records_where_each_rank_ran(tmp_path, monkeypatch):
    fleet_env(monkeypatch, tmp_path, "node-mg")
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    script = REPO / "tests" / "scripts" / "mg_job.py"
    framework_jobs.torchrun(script, save_dir, ev, "--iters", 2, "--save-every", 2, "--accept-single-owner")
    assert places(save_dir) == torchrun_placed("node-mg")


def test_lightning_records_where_each_rank_ran(tmp_path, monkeypatch):
    from tests.test_integration_lightning import torchrun

    fleet_env(monkeypatch, tmp_path, "node-pl")
    root = tmp_path / "pl"
    torchrun(root, "--steps", 2, "--save-every", 2)
    assert places(root) == torchrun_placed("node-pl")


def test_accelerate_records_where_each_rank_ran(tmp_path, monkeypatch):
    from tests.test_integration_accelerate import torchrun

    fleet_env(monkeypatch, tmp_path, "node-acc")
    root = tmp_path / "acc"
    torchrun(root, tmp_path / "trace", "--epochs", 1, "--samples", 8)
    assert places(root) == torchrun_placed("node-acc")


def test_torchtitan_records_where_each_rank_ran(tmp_path):
    from scout_ckpt.testing.launch import run_ranks
    from tests import workers_torchtitan as w

    # spawned ranks, not torchrun: no LOCAL_RANK, so the device is the host's with an unknown local rank
    env = {"SCOUT_CKPT_HOST": "node-tt", "SCOUT_CKPT_JOB": "job-tt", "SCOUT_CKPT_FLEET": str(tmp_path / "fleet.db")}
    run_ranks(w.train, 2, str(tmp_path / "tt"), 2, timeout=400, env=env)  # the manager's folder: tt/ckpt
    assert places(tmp_path / "tt" / "ckpt") == [(r, "node-tt", None, "node-tt:cpu?") for r in range(2)]
