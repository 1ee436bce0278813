"""Health evidence end to end (issue 10): a fake NVML source reports an uncorrectable ECC error on rank 1 between
two saves of a real 2-rank job with the library defaults and its observers. Under FSDP2 (single-owner shards)
the next checkpoint is not certified and `explain` names the event; under DDP the next save's consensus compares
every replica after the event and the checkpoint is certified. Judged from the ledger and the real CLI."""

from __future__ import annotations

import json

import pytest

from scout_ckpt.ledger import Ledger
from scout_ckpt.testing.launch import run_ranks
from tests import workers_health as W
from tests.conftest import run_cli


class _Runs(dict):
    """mode -> (root, each rank's result), each job run when a test first asks for its mode (the CI tier runs
    the FSDP2 one alone)."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, mode):
        root = self.tmp_path_factory.mktemp(mode) / "run"
        res = run_ranks(W.w_ecc_between_saves, 2, str(root), mode, timeout=400, pg_timeout_s=180)
        self[mode] = (root, [o.result for o in res])
        return self[mode]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _Runs(tmp_path_factory)


def _event(results) -> dict:
    (ev,) = results[0]["events"]
    assert ev["kind"] == "health" and ev["ranks"] == [W.FAULTY]
    assert ev["detail"]["metric"] == "ecc_uncorrected_volatile"
    return ev


@pytest.mark.slow
@pytest.mark.scenario  # a 2-rank job with observers each (6 min for both on a machine at load 40)
@pytest.mark.scenario_ci
def test_ecc_on_an_fsdp_rank_between_saves_leaves_the_next_checkpoint_uncertified(runs):
    root, results = runs["fsdp"]
    assert results[0]["mode"] == "fsdp" and results[0]["replay"]  # the defaults: replay and shard evidence on
    ev = _event(results)
    for r in results:  # every rank got the same verdicts, and the default ended the generation at 6 on each
        assert {s: v["state"] for s, v in r["verdicts"].items()} == {3: "certified", 6: "rejected"}
        assert r["verdicts"][6].get("raised")
    rc, out, _ = run_cli("explain", root, 6, "--json")
    assert rc == 1
    doc = json.loads(out)
    health = doc["evidence"]["health"]
    assert health["status"] == "fail"
    assert health["reasons"] == [
        {
            "code": "health_fault",
            "ranks": [W.FAULTY],
            "event": ev["id"],
            "metric": "ecc_uncorrected_volatile",
            "step": ev["step"],
        }
    ]
    assert doc["reasons"] == health["reasons"]  # the event decided: nothing else held 6 back
    # the other evidence of 6 is what the same job's certified step 3 had, kind by kind
    rc3, out3, _ = run_cli("explain", root, 3, "--json")
    assert rc3 == 0
    ev3 = json.loads(out3)["evidence"]
    assert {k: v["status"] for k, v in doc["evidence"].items() if k != "health"} == {
        k: v["status"] for k, v in ev3.items() if k != "health"
    }
    rc, text, err = run_cli("explain", root, 6)
    said = f"health_fault(ecc_uncorrected_volatile;event {ev['id']})[ranks {W.FAULTY}]"  # the event that decided
    assert rc == 1 and said in text and said in err
    rc, out, _ = run_cli("resume", root, "--latest-clean")
    assert rc == 0 and out.strip().endswith("step-00000003")
    with Ledger.open(root, readonly=True) as led:
        assert {c["step"]: c["state"] for c in led.checkpoints()} == {3: "certified", 6: "rejected"}


@pytest.mark.slow
@pytest.mark.scenario
def test_ecc_on_a_ddp_rank_is_cleared_by_consensus_after_the_event(runs):
    root, results = runs["ddp"]
    assert results[0]["mode"] == "ddp"
    ev = _event(results)
    for r in results:
        assert {s: v["state"] for s, v in r["verdicts"].items()} == {3: "certified", 6: "certified", 9: "certified"}
    rc, out, _ = run_cli("explain", root, 6, "--json")
    assert rc == 0
    health = json.loads(out)["evidence"]["health"]
    assert health["status"] == "pass" and health["cleared_by"] == "consensus"
    assert [e["event"] for e in health["events"]] == [ev["id"]]
    rc, out, _ = run_cli("explain", root, 9, "--json")
    assert json.loads(out)["evidence"]["health"]["events_seen"] == 0  # the window moved on after 6
    rc, out, _ = run_cli("certify", root, "--all")
    assert rc == 0, out
