"""The fleet record from real torchrun jobs: two agents on one machine stand for two hosts (SCOUT_CKPT_HOST per
agent), every job writes to one fleet store, and the test judges by where it placed the fault (the job's own
ROOT/fault.json, written by the faulted rank), never by scout-ckpt's own account of it.

- a persistent fault pinned to one host and local rank in two jobs: listed persistent, with both jobs;
- a one-off fault on another rank in a third job: listed transient (and not drained);
- every other device (healthy) is never listed;
- a layer no rank can reproduce (noise on every rank): triaged not_hardware, no device listed;
- a rank on a persistent suspect with on_suspect="exit": exits with EXIT_SUSPECT_DEVICE, an ERROR naming it;
- a fleet store lost, locked by another writer or unwritable: the job's saves certify all the same;
- a loss anomaly (a spike, a NaN): triaged from the loss, by the fault placed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from scout_ckpt.fleet.store import FleetStore
from scout_ckpt.ledger import Ledger
from scout_ckpt.options import EXIT_SUSPECT_DEVICE
from scout_ckpt.testing import agents
from tests.conftest import REPO, run_cli, tmpfs
from tests.placement import place

SCRIPT = REPO / "tests" / "scripts" / "fleet_job.py"
HOSTS = ("node-a", "node-b")
NPROC = 2

pytestmark = pytest.mark.scenario


def two_host_job(root: Path, store: Path, job: str, *args: str) -> list[subprocess.CompletedProcess]:
    env = {n: {"SCOUT_CKPT_HOST": h, "SCOUT_CKPT_JOB": job} for n, h in enumerate(HOSTS)}
    results = agents.run_agents(
        SCRIPT,
        [root, "--fleet", store, *args],
        nnodes=len(HOSTS),
        nproc=NPROC,
        repo=REPO,
        max_restarts=0,
        node_env=env,
        timeout=500,
    )
    for node, r in enumerate(results):
        assert r.returncode == 0, (job, node, r.stderr[-3000:])
    return results


def one_host_job(
    root: Path, store: Path, host: str, job: str, *args: str, nproc: int = 2
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
        "SCOUT_CKPT_HOST": host,
        "SCOUT_CKPT_JOB": job,
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.5",
        str(SCRIPT),
        str(root),
        "--fleet",
        str(store),
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=500)


def device_of(rank: int) -> tuple[str, int]:
    """Global rank -> (host, local rank) under two agents of NPROC workers (agent n holds ranks n*NPROC...)."""
    return HOSTS[rank // NPROC], rank % NPROC


def suspects(store: Path) -> list[dict]:
    _, out, _ = run_cli("suspects", "--json", "--fleet", store, check_rc=0)
    return json.loads(out)["suspects"]


def test_persistent_in_two_jobs_transient_once_healthy_never(tmp_path, request):
    bad = place(request, ranks=range(len(HOSTS) * NPROC))
    once = place(request, ranks=[r for r in range(len(HOSTS) * NPROC) if r != bad.rank])
    (bad_host, bad_local), (once_host, once_local) = device_of(bad.rank), device_of(once.rank)
    store = tmp_path / "fleet.db"
    for job in ("job-1", "job-2"):
        two_host_job(
            tmp_path / job,
            store,
            job,
            "--fault",
            "persistent",
            "--fault-host",
            bad_host,
            "--fault-local",
            str(bad_local),
        )
    two_host_job(
        tmp_path / "job-3",
        store,
        "job-3",
        "--fault",
        "transient",
        "--fault-host",
        once_host,
        "--fault-local",
        str(once_local),
    )
    placed = [json.loads((tmp_path / j / "fault.json").read_text()) for j in ("job-1", "job-2", "job-3")]
    assert [(p["host"], p["local_rank"]) for p in placed] == [(bad_host, bad_local)] * 2 + [(once_host, once_local)]
    listed = {(s["host"], s["local_rank"]): s for s in suspects(store)}
    assert (listed[(bad_host, bad_local)]["class"], listed[(bad_host, bad_local)]["jobs"]) == (
        "persistent",
        ["job-1", "job-2"],
    )
    assert (listed[(once_host, once_local)]["class"], listed[(once_host, once_local)]["jobs"]) == (
        "transient",
        ["job-3"],
    )
    assert set(listed) == {(bad_host, bad_local), (once_host, once_local)}  # the healthy devices: never
    _, out, _ = run_cli("suspects", "--format", "slurm", "--fleet", store, check_rc=0)
    drained = [dict(w.split("=", 1) for w in shlex.split(line)[2:])["NodeName"] for line in out.splitlines()]
    assert drained == [bad_host]
    _, out, _ = run_cli(
        "suspects", "--explain", listed[(bad_host, bad_local)]["device"], "--json", "--fleet", store, check_rc=0
    )
    assert {(Path(v["root"]).name, v["step"]) for v in json.loads(out)["verdicts"]} >= {("job-1", 4), ("job-2", 4)}


def test_a_layer_no_rank_reproduces_is_not_hardware_and_lists_no_device(tmp_path):
    store, root = tmp_path / "fleet.db", tmp_path / "job-n"
    r = one_host_job(root, store, "node-c", "job-n", "--fault", "numerics", nproc=3)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((root / "fault.json").read_text())["kind"] == "numerics"
    _, out, _ = run_cli("suspects", "--json", "--fleet", store, check_rc=0)
    got = json.loads(out)
    assert (got["suspects"], len(got["not_hardware"]) > 0) == ([], True)


def _store_naming(tmp_path: Path, host: str, local: int) -> Path:
    """A fleet store in which (host, local) is a persistent suspect of two jobs: imported from two ROOTs whose
    ledgers record one persistent replay verdict each, written through the ledger's own API."""
    store = tmp_path / "fleet.db"
    for job in ("job-1", "job-2"):
        root = tmp_path / job
        root.mkdir()
        with Ledger.open(root, create=True) as led:
            led.begin_run("run-1", world_size=2, topology={}, policy={}, versions={})
            led.record_ranks(
                "run-1",
                [
                    {
                        "rank": r,
                        "host": host,
                        "node_rank": 0,
                        "local_rank": r,
                        "pid": 1,
                        "device": {"host": host, "local_rank": r, "device": f"{host}:cpu{r}", "job": job},
                    }
                    for r in range(2)
                ],
            )
            led.add_event(
                "sdc",
                step=4,
                ranks=[local],
                run_id="run-1",
                detail={"source": "replay", "triage": {"class": "persistent"}},
            )
        run_cli("fleet", "import", root, "--fleet", store, check_rc=0)
    return store


@pytest.mark.scenario_ci  # the CI tier's fleet scenario: one 2-rank job that refuses to start
def test_a_rank_on_a_persistent_suspect_exits_with_the_replace_node_code(tmp_path):
    store = _store_naming(tmp_path, "node-d", 1)
    r = one_host_job(tmp_path / "job-3", store, "node-d", "job-3", "--on-suspect", "exit")
    assert f"exitcode  : {EXIT_SUSPECT_DEVICE}" in r.stderr, r.stderr[-3000:]
    assert "node-d:cpu1" in next(line for line in r.stderr.splitlines() if "ERROR" in line and "suspect" in line)


@contextlib.contextmanager
def unusable_store(tmp_path: Path, how: str):
    """A fleet store path the job cannot write: `lost` (its directory does not exist), `locked` (another
    process's writer holds the lock for the whole job), `unwritable` (on a filesystem remounted read-only)."""
    if how == "lost":
        yield tmp_path / "no-such-dir" / "fleet.db"
    elif how == "locked":
        path = tmp_path / "fleet.db"
        FleetStore.open(path).close()
        holder = sqlite3.connect(str(path), isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        try:
            yield path
        finally:
            holder.execute("ROLLBACK")
            holder.close()
    else:
        with tmpfs("1M") as d:
            FleetStore.open(d / "fleet.db").close()
            subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
            yield d / "fleet.db"


@pytest.mark.parametrize("how", ["lost", "locked", "unwritable"])
def test_a_fleet_store_that_cannot_be_written_never_fails_a_save(tmp_path, how):
    root = tmp_path / "job-h"
    with unusable_store(tmp_path, how) as store:
        r = one_host_job(root, store, "node-e", "job-h")
    states = [
        json.loads(line.split(" ", 1)[1])["state"] for line in r.stdout.splitlines() if line.startswith("FLEET-JOB ")
    ]
    assert (r.returncode, states) == (0, ["certified", "certified"]), r.stderr[-3000:]


LOSS_FAULTS = {  # the fault the job places -> the class it must get, by what the fault is
    "loss-persistent": "persistent",  # the rank computes its layer wrongly from step K on, replays included
    "loss-transient": "transient",  # its live forward is wrong at step K only
    "nan-data": "not_hardware",  # its batch holds a NaN: any rank given that work computes the same
}


@pytest.mark.parametrize("fault", sorted(LOSS_FAULTS))
def test_a_loss_anomaly_triggers_triage_and_records_its_class(tmp_path, request, fault):
    # spikes need the rule's history of finite losses first (replay.loss_triage.LOSS_MIN_HISTORY = 10)
    pl = place(request, ranks=range(2), steps=range(12, 15))
    store, root = tmp_path / "fleet.db", tmp_path / "job-l"
    r = one_host_job(
        root,
        store,
        "node-l",
        "job-l",
        "--loss",
        "--steps",
        "16",
        "--save-every",
        "8",
        "--fault",
        fault,
        "--fault-host",
        "node-l",
        "--fault-local",
        str(pl.rank),
        "--fault-step",
        str(pl.step),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    placed = json.loads((root / "fault.json").read_text())
    assert (placed["kind"], placed["local_rank"], placed["step"]) == (fault, pl.rank, pl.step)
    with Ledger.open(root, readonly=True) as led:
        found = [e for e in led.events(("sdc",)) if (e["detail"] or {}).get("source") == "loss"]
    got = [(e["step"], e["ranks"], e["detail"]["triage"]["class"]) for e in found]
    assert got == [(pl.step, [placed["rank"]], LOSS_FAULTS[fault])], pl
    listed = {(s["host"], s["local_rank"]): s["class"] for s in suspects(store)}
    expected = {} if LOSS_FAULTS[fault] == "not_hardware" else {("node-l", pl.rank): LOSS_FAULTS[fault]}
    assert listed == expected, pl
