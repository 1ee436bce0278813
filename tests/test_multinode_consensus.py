"""Consensus through the node aggregators on two torchrun agents (consensus/node_exchange.py): a replica of node 1
that diverges after an optimizer step (after that step's replay, before its save: only the save's consensus can
see it) makes the save not certified, naming that global rank; the job's restart resumes from the newest clean
step with the state the job itself saved (its printed digests), and the job's later saves pass through the same
per-node exchange. The oracle of the rank is the job's own fault.json."""

from __future__ import annotations

import json

import pytest

from scout_ckpt.ledger import Ledger
from tests.conftest import run_cli
from tests.placement import place
from tests.test_multinode import NNODES, NPROC, job_lines, run_agents

pytestmark = pytest.mark.scenario


def test_a_replica_of_node_1_that_diverges_is_named_by_the_per_node_consensus(tmp_path, request):
    pl = place(request, ranks=range(NPROC), steps=(6, 9))  # a save step after the first save
    root = tmp_path / "run"
    results = run_agents(
        root,
        "--steps",
        "12",
        "--save-every",
        "3",
        "--fault",
        "diverge",
        "--fault-node",
        "1",
        "--fault-local",
        str(pl.rank),
        "--fault-step",
        str(pl.step),
    )
    for node, r in enumerate(results):
        assert r.returncode == 0, (pl, node, r.stderr[-4000:])
    fault = json.loads((root / "fault.json").read_text())
    assert (fault["node_rank"], fault["local_rank"], fault["step"], fault["kind"]) == (1, pl.rank, pl.step, "diverge")
    victim = fault["rank"]
    assert victim == NPROC + pl.rank, (pl, fault)  # torchrun: node 1's ranks follow node 0's
    lines = job_lines(results)
    loads = [e for e in lines if e["event"] == "loaded"]
    runs = [e["run_id"] for e in loads]
    first_saves = {e["step"]: e["digest"] for e in lines if e["event"] == "saved" and e["run_id"] == runs[0]}
    resumed = pl.step - 3
    assert max(first_saves) == resumed and loads[-1]["step"] == resumed, (pl, lines)
    assert loads[-1]["digest"] == first_saves[resumed], pl

    with Ledger.open(root, readonly=True) as led:
        assert {r["step"]: r["state"] for r in led.checkpoints()} == {s: "certified" for s in (3, 6, 9, 12)}, pl
        # the first run's save of the fault step was rejected, consensus naming the diverged rank alone
        first = runs[0].rsplit("-", 1)[1]
        history = led.certifications(pl.step, all_outcomes=True)
        rejected = [h for h in history if h["state"] == "rejected" and h["attempt"].startswith(first)]
        assert len(rejected) == 1, (pl, history)
        codes = {r["code"]: r for r in rejected[0]["reasons"]}
        assert codes["consensus_attributed"]["ranks"] == [victim], (pl, rejected)
        ev = led.evidence(12)["consensus"]
    assert ev["status"] == "pass" and ev["exchange"] == "per_node", ev
    assert [g["members"] for g in ev["groups"]] == [list(range(NNODES * NPROC))], ev
    rc, out, err = run_cli("report", root, "--json")
    assert rc == 0, err
    sdc = [e for e in json.loads(out)["events"] if e["kind"] == "sdc"]
    assert sdc and all(e["ranks"] == [victim] and e["step"] == pl.step for e in sdc), (pl, sdc)
