"""The observer's hierarchy across two torchrun agents (as two nodes): a desync on node 1, and a node slow as a whole.

A desync: one rank of node 1 issues an all_reduce the others never issue; the root names a desync with that
global rank and its node, the observers abort the job, and torchrun's restart resumes from the newest clean step
with the state the job itself saved (its printed digests). A node slow as a whole: every rank of node 1 computes slower from the first step. Its aggregator sees no odd rank
inside the node; the root compares the nodes' paces (observer/node_pace.py) and names the node's ranks as one
straggler with its node. The healthy control, the same job without the fault, has no event."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.placement import place
from tests.test_multinode import NNODES, NPROC, job_lines, newest_save_before, run_agents

pytestmark = [pytest.mark.scenario, pytest.mark.timing]  # the observer's judgement: `make stress` too


def events_of(root) -> list[dict]:
    rc, out, err = run_cli("report", root, "--json")
    assert rc == 0, err
    return json.loads(out)["events"]


def test_a_desync_on_node_1_is_named_with_its_node_and_the_job_resumes(tmp_path, request):
    # not at a save step (6, 9) nor the last (10): as the hang's twin in test_multinode.py
    pl = place(request, ranks=range(NPROC), steps=(4, 5, 7, 8))
    resumed = newest_save_before(pl.step, 3)
    root = tmp_path / "run"
    args = ["--steps", "10", "--save-every", "3", "--fault", "desync", "--fault-node", "1", "--stall-s", "4"]
    results = run_agents(root, *args, "--fault-local", str(pl.rank), "--fault-step", str(pl.step))
    for node, r in enumerate(results):
        assert r.returncode == 0, (pl, node, r.stderr[-4000:])
    fault = json.loads((root / "fault.json").read_text())
    assert (fault["node_rank"], fault["local_rank"], fault["step"], fault["kind"]) == (1, pl.rank, pl.step, "desync")
    lines = job_lines(results)
    loads = [e for e in lines if e["event"] == "loaded"]
    runs = [e["run_id"] for e in loads]
    first_saves = {e["step"]: e["digest"] for e in lines if e["event"] == "saved" and e["run_id"] == runs[0]}
    assert len(loads) >= 2 and loads[-1]["step"] == resumed, (pl, lines)
    assert loads[-1]["digest"] == first_saves[resumed], (pl, lines)
    desyncs = [e for e in events_of(root) if e["kind"] == "desync" and e.get("run_id") == runs[0]]
    assert desyncs and desyncs[0]["ranks"] == [fault["rank"]], (pl, desyncs)
    detail = desyncs[0]["detail"]
    assert detail["hierarchy"]["nodes"] == NNODES and detail["node_rank"] == 1, detail
    assert "node 1" in detail["nodes"][str(fault["rank"])], detail


def test_a_node_slow_as_a_whole_is_a_straggler_named_with_its_node(tmp_path):
    root = tmp_path / "run"
    args = ["--steps", "120", "--save-every", "60", "--fault", "slow", "--fault-node", "1", "--fault-local", "-1"]
    results = run_agents(root, *args, "--fault-step", "1")
    for node, r in enumerate(results):
        assert r.returncode == 0, (node, r.stderr[-4000:])
    fault = json.loads((root / "fault.json").read_text())
    assert (fault["node_rank"], fault["kind"]) == (1, "slow"), fault
    node_ranks = list(range(NPROC, 2 * NPROC))  # torchrun: node 1's ranks follow node 0's
    events = events_of(root)
    stragglers = [e for e in events if e["kind"] == "straggler"]
    assert stragglers and all(e["ranks"] == node_ranks for e in stragglers), stragglers
    detail = stragglers[0]["detail"]
    assert (detail["scope"], detail["node"], detail["host"]) == ("node", 1, fault["host"]), detail
    assert not [e for e in events if e["kind"] in ("hang", "crash", "desync")], events


def test_the_healthy_control_has_no_event(tmp_path):
    root = tmp_path / "run"
    results = run_agents(root, "--steps", "120", "--save-every", "60")
    for node, r in enumerate(results):
        assert r.returncode == 0, (node, r.stderr[-4000:])
    assert not [e for e in events_of(root) if e["kind"] in ("straggler", "hang", "crash", "desync")]
