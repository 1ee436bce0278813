"""Certified when committed (issue 10), judged from what `save()` returned, the ledger and the real CLI:

* an SDC fault (rank 1's block computing wrongly from step 6) firing between the saves at 4 and 8 of an FSDP2 job
  with the defaults (replay on for single-owner shards) rejects checkpoint 8 at its commit, naming the block and
  rank 1, and 12 after it; 4 stays certified and is where `resume --latest-clean` goes;
* the same fault in a DDP job with the defaults (replay is on for replicas too) rejects checkpoint 8 at its
  commit, attributed to rank 1 at 3 ranks, although the replicas agree bit for bit on the poisoned state;
* a healthy user-shaped DDP job with the defaults ends with every checkpoint certified at its commit, every target
  replayed: `resume --latest-clean --require replay` returns the last step, `certify --all` exits 0;
* a DDP script that never calls `ckpt.step()` has no replay: its saves are certified on the rest of the evidence,
  the replay evidence `not_applicable` (replay_no_step_hook), and `resume --latest-clean --require replay` refuses
  them (exit 1) while plain `resume --latest-clean` hands out the newest;
* a healthy demo job with the defaults (FSDP2: replay on by default) likewise.
"""

from __future__ import annotations

import json

import pytest

from scout_ckpt.ledger import Ledger
from scout_ckpt.testing.launch import run_ranks
from tests import workers_replay_certified as W
from tests.conftest import run_cli as _run_cli


def run_cli(*args):
    """The real CLI; `certify` imports torch and re-checks invariants: give it room on a loaded machine."""
    import os
    import subprocess

    from tests.conftest import CLI, REPO

    if args[0] != "certify":
        return _run_cli(*args)
    p = subprocess.run(
        [*CLI, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return p.returncode, p.stdout, p.stderr


STEPS, SAVE_EVERY, FAULT = 12, 4, (1, 1, 6, 1.5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("certified")
    roots = base / "fault", base / "healthy", base / "ddp_fault"
    out = run_ranks(
        W.w_sdc_and_healthy,
        3,
        *map(str, roots),
        STEPS,
        SAVE_EVERY,
        FAULT,
        SAVE_EVERY - 1,
        timeout=900,
        pg_timeout_s=300,
    )
    return roots, [o.result for o in out]


def _first_verdicts(root):
    """The first recorded state of each step: what its commit decided, before any later evidence."""
    with Ledger.open(root, readonly=True) as led:
        return {
            r["step"]: next(h["state"] for h in led.certifications(r["step"]) if h["state"] != "writing")
            for r in led.checkpoints()
        }


@pytest.mark.slow
def test_sdc_between_two_saves_rejects_the_next_checkpoint_at_its_commit(runs):
    (root, _, _), results = runs
    res = [r["fault"] for r in results]
    assert res[0]["mode"] == "fsdp" and res[0]["replay"]
    for r in res:  # the live state is bad: save 8 raised LiveStateCorrupt on every rank, the generation ended
        assert {s: v["state"] for s, v in r["verdicts"].items()} == {4: "certified", 8: "rejected"}
        assert r["ended"] == 8
    sdc = [x for x in res[0]["verdicts"][8]["reasons"] if x["code"] == "replay_sdc"]
    assert sdc and {(x["target"], tuple(x["ranks"])) for x in sdc} == {("layers.1", (1,))}
    assert _first_verdicts(root) == {4: "certified", 8: "rejected"}
    rc, out, _ = run_cli("resume", root, "--latest-clean")
    assert rc == 0 and out.strip().endswith("step-00000004")


@pytest.mark.slow
def test_sdc_in_a_ddp_job_with_the_defaults_is_attributed_and_never_certified(runs):
    """Rank 1's layers.1 computes wrongly from step 6 in a DDP job with no option set: DDP averages its gradient
    into every replica, so consensus agrees on the poisoned state; replay (on by default) rejects save 8 at its
    commit naming layers.1 and rank 1 (3 ranks: a strict majority), and the restart goes to 4."""
    (_, _, root), results = runs
    res = [r["ddp_fault"] for r in results]
    assert res[0]["mode"] == "ddp" and res[0]["replay"]
    for r in res:
        assert {s: v["state"] for s, v in r["verdicts"].items()} == {4: "certified", 8: "rejected"}
        assert r["ended"] == 8
    reasons = res[0]["verdicts"][8]["reasons"]
    assert {(x["target"], tuple(x["ranks"])) for x in reasons if x["code"] == "replay_sdc"} == {("layers.1", (1,))}
    assert not any(x["code"].startswith("consensus") for x in reasons), reasons  # the replicas agreed
    rc, out, _ = run_cli("resume", root, "--latest-clean")
    assert rc == 0 and out.strip().endswith("step-00000004")


@pytest.mark.slow
def test_healthy_user_script_certifies_every_checkpoint_at_its_commit(runs):
    (_, root, _), results = runs
    res = [r["healthy"] for r in results]
    assert res[0]["mode"] == "ddp" and res[0]["replay"]
    for r in res:
        assert {s: v["state"] for s, v in r["verdicts"].items()} == {4: "certified", 8: "certified", 12: "certified"}
        assert r["ended"] is None
    assert _first_verdicts(root) == {4: "certified", 8: "certified", 12: "certified"}
    rc, out, _ = run_cli("resume", root, "--latest-clean", "--require", "replay")
    assert rc == 0 and out.strip().endswith("step-00000012")
    with Ledger.open(root, readonly=True) as led:
        assert led.evidence(12)["replay"]["status"] == "pass"
    rc, out, err = run_cli("certify", root, "--all")
    assert rc == 0, (out, err)


@pytest.mark.slow
@pytest.mark.scenario  # 4 ranks (HSDP 2 x 2), two runs: make scenarios
def test_sdc_in_an_hsdp_job_with_the_defaults_is_attributed_and_a_healthy_one_certifies(tmp_path):
    """HSDP on a 2 x 2 (replicate, shard) mesh, the defaults: rank 1's layers.1 computes wrongly from step 6 ->
    save 8 rejected at its commit (replay_sdc naming layers.1 and rank 1: four peers, a strict majority), the
    generation ended there; the same job without the fault certifies every save."""
    out = run_ranks(
        W.w_user_script,
        4,
        str(tmp_path / "fault"),
        "hsdp",
        STEPS,
        SAVE_EVERY,
        fault=FAULT,
        timeout=900,
        pg_timeout_s=300,
    )
    for o in out:
        r = o.result
        assert r["mode"].startswith("hsdp") and r["replay"], r["mode"]
        assert {s: v["state"] for s, v in r["verdicts"].items()} == {4: "certified", 8: "rejected"}, r["verdicts"]
    reasons = out[0].result["verdicts"][8]["reasons"]
    assert {(x["target"], tuple(x["ranks"])) for x in reasons if x["code"] == "replay_sdc"} == {("layers.1", (1,))}
    out = run_ranks(
        W.w_user_script, 4, str(tmp_path / "healthy"), "hsdp", STEPS, SAVE_EVERY, timeout=900, pg_timeout_s=300
    )
    assert all(
        {s: v["state"] for s, v in o.result["verdicts"].items()} == {4: "certified", 8: "certified", 12: "certified"}
        for o in out
    )


@pytest.mark.slow
@pytest.mark.scenario  # a whole FSDP demo job and the offline certify (11 min at load 40): make scenarios
def test_healthy_demo_with_the_defaults_certifies_every_checkpoint(tmp_path):
    from scout_ckpt.demo import run_demo

    # a generous stall threshold: a false hang on a loaded machine would restart the job (not what is tested)
    r = run_demo(tmp_path / "run", ranks=2, steps=12, save_every=4, mode="fsdp", quiet=True, stall_s=30.0)
    assert r["completed"] and r["restarts"] == 0, r["generations"]
    assert [(c["step"], c["state"]) for c in r["checkpoints"]] == [
        (4, "certified"),
        (8, "certified"),
        (12, "certified"),
    ]
    assert _first_verdicts(r["dir"]) == {4: "certified", 8: "certified", 12: "certified"}
    with Ledger.open(r["dir"], readonly=True) as led:
        assert "replay" in led.runs()[0]["policy"]["require"]  # the library default for FSDP
    rc, out, _ = run_cli("resume", r["dir"], "--latest-clean", "--json")
    assert rc == 0 and json.loads(out)["step"] == 12
    rc, out, err = run_cli("certify", r["dir"], "--all")
    assert rc == 0, (out, err)


def test_a_script_without_the_step_hook_is_certified_without_replay_and_require_replay_refuses_it(tmp_path):
    """A DDP job that saves without ever calling ckpt.step() (tests/workers_ckpt.save_and_reload: steps 3 and 4):
    certified on bytes, consensus and invariants; replay says why it covers nothing; `--require replay` refuses
    every step (exit 1, each named on stderr), plain `resume` hands out 4; an unknown kind is bad input (exit 2)."""
    from tests import workers_ckpt as wc

    out = run_ranks(wc.save_and_reload, 2, str(tmp_path), False, timeout=300)
    assert [v["state"] for v in out[0].result["verdicts"]] == ["certified", "certified"]
    with Ledger.open(tmp_path, readonly=True) as led:
        ev = led.evidence(4)["replay"]
    assert ev["status"] == "not_applicable" and ev["reasons"][0]["code"] == "replay_no_step_hook", ev
    rc, out_, err = run_cli("resume", tmp_path, "--latest-clean", "--require", "replay", "--json")
    assert rc == 1 and json.loads(out_)["step"] is None, (out_, err)
    assert "skipped step 4" in err and "skipped step 3" in err, err
    rc, out_, _ = run_cli("resume", tmp_path, "--latest-clean")
    assert rc == 0 and out_.strip().endswith("step-00000004")
    rc, out_, err = run_cli("resume", tmp_path, "--latest-clean", "--require", "replays")
    assert rc == 2 and out_ == "" and err.count("\n") == 1 and "not an evidence kind" in err, err
