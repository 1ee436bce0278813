"""Issue 5 end to end: model-intrinsic invariants, exact resume of the whole training state, FSDP without replicas.

Every test runs the real demo job (3 worker processes, gloo, real SIGKILL, real restarts) through `run_demo`:

* FSDP2 (no replicas) with `--constraint sphere --mixing online`: healthy checkpoints are certified by bytes,
  invariants and replay, consensus being `not_applicable`; a `param` bit flip in rank 1's own shard breaks the
  Frobenius sphere and the checkpoint is rejected naming rank 1; a crash later, the restarted job resumes from the
  newest *clean* checkpoint (before the rejected one) and ends bitwise where the uninterrupted run ended.
* DDP with `--mixing online`: a rank whose mixture weights drift (still a distribution: the simplex invariant
  cannot tell) is named by save-time consensus; after a crash the job resumes past the rejected checkpoint and
  ends bitwise equal to the uninterrupted run, mixture weights and loss curve included.
"""

from __future__ import annotations

import json

import pytest

from scout_ckpt.demo import faults, run_demo
from scout_ckpt.errors import BadInput
from scout_ckpt.ledger import Ledger

# save_every 8 > the replay runner's 7 targets: the demo turns replay on, so FSDP certification includes it.
FSDP = dict(ranks=3, steps=24, save_every=8, mode="fsdp", constraint="sphere", mixing="online", quiet=True)
DDP = dict(ranks=3, steps=12, save_every=4, mode="ddp", mixing="online", quiet=True)


@pytest.fixture(scope="module")
def fsdp_clean(tmp_path_factory):
    return run_demo(tmp_path_factory.mktemp("fsdp_clean") / "run", **FSDP)


@pytest.fixture(scope="module")
def ddp_clean(tmp_path_factory):
    return run_demo(tmp_path_factory.mktemp("ddp_clean") / "run", **DDP)


def _codes(reasons) -> set[str]:
    return {r.get("code") for r in reasons or [] if isinstance(r, dict)}


def _sdc(result, step, source):
    return [
        e
        for e in result["events"]
        if e["kind"] == "sdc" and e["step"] == step and (e["detail"] or {}).get("source") == source
    ]


def _assert_same_final_state(run, clean):
    """The whole training state, not only the model: digest of model + optimizer, the mixture weights, the
    sphere, and every step's loss (which depends on the data position, the RNG and the LR schedule)."""
    assert run["completed"] and run["final_digest"] == clean["final_digest"]
    assert run["mixing_weights"] == clean["mixing_weights"]
    assert run.get("sphere_deviation") == clean.get("sphere_deviation")
    assert run["losses"]["curve"] == clean["losses"]["curve"]


@pytest.mark.slow
def test_fsdp_healthy_checkpoints_are_certified_without_replicas(fsdp_clean):
    r = fsdp_clean
    assert r["completed"] and r["restarts"] == 0 and r["replay"] is True
    rows = {c["step"]: c for c in r["checkpoints"]}
    assert sorted(rows) == [8, 16, 24]
    for step in (8, 16):
        assert rows[step]["state"] == "certified", rows[step]
        ev = rows[step]["evidence"]
        assert (ev["bytes"], ev["invariants"], ev["replay"]) == ("pass", "pass", "pass")
        # sharded state has no replica: consensus is not applicable (the shard evidence vouches instead)
        assert ev["consensus"] == "not_applicable"
    # the last one too: the save-boundary sweep replays every target at the save step itself, so no replay after
    # the end of the job is awaited (replay.schedule.coverage)
    assert rows[24]["state"] == "certified" and rows[24]["reasons"] == [], rows[24]
    assert rows[24]["evidence"]["replay"] == "pass"
    assert not [e for e in r["events"] if e["kind"] in ("sdc", "crash", "hang", "desync")]
    assert r["sphere_deviation"] < 1e-3
    with Ledger.open(r["dir"], readonly=True) as ledger:
        policy = ledger.runs()[0]["policy"]
        assert "consensus" in policy["allow_not_applicable"] and "replay" in policy["require"]
        for step in (8, 16):
            ev = ledger.evidence(step)
            assert ev["consensus"]["status"] == "not_applicable"
            assert ev["consensus"]["reasons"][0]["code"] == "no_replicas"
            # the invariants that vouch for the single-owner shards: every constrained matrix and the simplex
            checked = ev["invariants"]["checked"]
            assert checked.get("simplex(mixing.weights)") == 1
            assert sum(n for k, n in checked.items() if k.startswith("frobenius_sphere")) == 16
            # every replay target (blocks, embedding, head, optimizer) confirmed at or after the save
            replay = ev["replay"]
            assert set(replay["confirmed_after"]) == {
                "embedding",
                "blocks.0",
                "blocks.1",
                "blocks.2",
                "blocks.3",
                "head",
                "optimizer",
            }
            assert min(replay["confirmed_after"].values()) >= step


@pytest.mark.scenario  # 50 s; the same faults under real torchrun: tests/test_fsdp_torchrun.py
@pytest.mark.slow
def test_fsdp_param_flip_is_attributed_and_crash_resume_is_bitwise(tmp_path, fsdp_clean):
    """Rank 1's shard of a sphere-constrained matrix gets a high exponent bit flipped (asked for step 13, it lands
    right before the next save, step 16): the sphere invariant rejects step 16 naming rank 1, and that verdict ends
    the generation (the live state is bad). The restarted job resumes from step 8 (16 is rejected); rank 2 dies
    mid-save at step 24 in that generation; the next resumes from 16 (certified this time) and ends bitwise equal
    to the uninterrupted run."""
    r = run_demo(tmp_path / "run", inject=["param:rank=1:step=13", "crash:rank=2:step=24"], **FSDP)
    assert r["completed"] and r["restarts"] == 2

    rejected16 = [x for x in r["rejections"] if x["step"] == 16]
    assert rejected16 and "invariant_failed" in rejected16[0]["reasons"]
    with Ledger.open(r["dir"], readonly=True) as ledger:
        verdicts = [c for c in ledger.certifications() if c["step"] == 16 and c["state"] == "rejected"]
        failed = [
            x
            for c in verdicts
            for x in c["reasons"] or []
            if x.get("code") == "invariant_failed" and x.get("check") == "frobenius_sphere"
        ]
        assert failed and all(x["ranks"] == [1] for x in failed)
        assert [run["resumed_from"] for run in ledger.runs()] == [None, 8, 16]
    events = _sdc(r, 16, "invariants")
    assert events and all(e["ranks"] == [1] for e in events if e["detail"]["check"] == "frobenius_sphere")
    assert any(e["detail"]["check"] == "frobenius_sphere" for e in events)
    fired = {f["kind"]: f["fired"] for f in r["injections"]}
    # asked for step 13, it landed right before the save of step 16 (after that step's retraction)
    assert [(x["rank"], x["requested_step"], x["step"], x["generation"]) for x in fired["param"]] == [(1, 13, 16, 0)]
    assert [(x["rank"], x["generation"]) for x in fired["crash"]] == [(2, 1)]

    # the restarted generation redid 9..24 without the (transient) flip: its checkpoints are healthy
    rows = {c["step"]: c for c in r["checkpoints"]}
    assert rows[8]["state"] == rows[16]["state"] == "certified"
    _assert_same_final_state(r, fsdp_clean)


@pytest.mark.scenario
@pytest.mark.slow
def test_ddp_mixing_drift_is_named_by_consensus_and_crash_resume_is_bitwise(tmp_path, ddp_clean):
    """Rank 2's mixture weights drift after step 6 (still on the simplex): consensus at the step-8 save names
    rank 2 on the mixing weights, and that verdict ends the generation. The restarted job resumes from step 4 (8
    is rejected); rank 1 dies mid-save at step 12 in that generation; the next resumes from 8 and ends bitwise
    equal to the uninterrupted run."""
    r = run_demo(tmp_path / "run", inject=["drift:rank=2:step=6", "crash:rank=1:step=12"], **DDP)
    assert r["completed"] and r["restarts"] == 2

    with Ledger.open(r["dir"], readonly=True) as ledger:
        verdicts = [c for c in ledger.certifications() if c["step"] == 8 and c["state"] == "rejected"]
        reasons = [x for c in verdicts for x in c["reasons"] or []]
        attributed = [x for x in reasons if x.get("code") == "consensus_attributed"]
        assert attributed and all(x["ranks"] == [2] for x in attributed), reasons
        assert any(t.endswith("mixing.weights") for x in attributed for t in x["tensors"])
        assert "invariant_failed" not in _codes(reasons)  # a drifted mixture is still a distribution
        assert [run["resumed_from"] for run in ledger.runs()] == [None, 4, 8]
    events = _sdc(r, 8, "consensus")
    assert events and all(e["ranks"] == [2] for e in events)
    fired = {f["kind"]: f["fired"] for f in r["injections"]}
    assert [(x["rank"], x["step"], x["generation"]) for x in fired["drift"]] == [(2, 6, 0)]
    assert fired["drift"][0]["before"] != fired["drift"][0]["after"]
    assert abs(sum(fired["drift"][0]["after"]) - 1.0) < 1e-12

    rows = {c["step"]: c for c in r["checkpoints"]}
    assert [(s, rows[s]["state"]) for s in sorted(rows)] == [(4, "certified"), (8, "certified"), (12, "certified")]
    _assert_same_final_state(r, ddp_clean)


def test_issue5_injection_options_fail_before_starting(tmp_path):
    with pytest.raises(BadInput, match="not a save step"):
        run_demo(tmp_path / "a", ranks=3, steps=16, save_every=8, inject=["crash:rank=1:step=5"], quiet=True)
    with pytest.raises(BadInput, match="needs --mixing online"):
        run_demo(tmp_path / "b", ranks=3, steps=8, save_every=4, inject=["drift:rank=1:step=2"], quiet=True)
    with pytest.raises(BadInput, match="amount"):
        run_demo(
            tmp_path / "c",
            ranks=3,
            steps=8,
            save_every=4,
            mixing="online",
            inject=["drift:rank=1:step=2:amount=0"],
            quiet=True,
        )
    with pytest.raises(BadInput, match="rank 3 does not exist"):
        run_demo(
            tmp_path / "d", ranks=3, steps=8, save_every=4, mixing="online", inject=["drift:rank=3:step=2"], quiet=True
        )
    assert not any((tmp_path / d).exists() for d in "abcd")


def test_param_flip_waits_for_the_next_save_boundary(tmp_path):
    """A flip before a retraction would be rescaled away or smeared over every rank (faults.py): it lands right
    before the first save at or after its step; other faults keep their own step."""
    fs = faults.parse_all(
        ["param:rank=1:step=13", "param:rank=1:step=16", "param:rank=1:step=23", "hang:rank=1:step=13"]
    )
    inj = faults.Injector(fs, rank=1, generation=0, root=tmp_path, save_every=8, steps=22)
    assert [inj.due_step(f) for f in fs] == [16, 16, 22, 13]
    assert faults.Injector(fs, 1, 0, tmp_path).due_step(fs[0]) == 13  # no save schedule known: its own step


def test_drift_spec_round_trips():
    f = faults.parse("drift:rank=2:step=6:amount=0.5")
    assert (f.kind, f.rank, f.step, f.opts) == ("drift", 2, 6, {"amount": 0.5})
    assert faults.parse(f.spec) == f
    assert faults.parse("drift:rank=0:step=1").opts == {"amount": 0.25}


def test_drift_mixture_stays_on_the_simplex_but_moves():
    from scout_ckpt.demo.data import OnlineMixer

    m = OnlineMixer(4)
    before = m.weights.clone()
    faults.drift_mixture(m, 0.25)
    m.check()
    assert not m.weights.equal(before) and float(m.weights[0]) > float(before[0])


def test_explain_shows_replay_coverage_per_target(fsdp_clean):
    """`explain` lists, per block, the embedding, the head and the optimizer, where its clean replays were."""
    from tests.conftest import run_cli

    root = fsdp_clean["dir"]
    rc, out, _ = run_cli("explain", root, 8, "--json")
    replay = json.loads(out)["evidence"]["replay"]
    assert rc == 0 and replay["status"] == "pass"
    targets = {"embedding", "head", "optimizer", *(f"blocks.{i}" for i in range(4))}
    assert set(replay["coverage"]) == targets and all(s is not None for s in replay["coverage"].values())
    assert all(s is not None and s >= 8 for s in replay["confirmed_after"].values())
    rc, text, _ = run_cli("explain", root, 8)
    for t in targets:
        assert any(line.split()[:1] == [t] and "clean at step" in line for line in text.splitlines()), t
