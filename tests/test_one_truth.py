"""One truth per step: a verdict reaches every copy, in every tier, and a save never outruns one.

Real gloo ranks (scout_ckpt.testing.launch.run_ranks), real SQLite ledgers and journals, real CLI subprocesses;
faults placed by real means (a NaN written into a weight, a slow commit thread, a deleted ledger file).
"""

from __future__ import annotations

import json
import shutil

import pytest

from scout_ckpt.testing.launch import run_ranks
from tests import workers_one_truth as w
from tests.conftest import run_cli
from tests.test_s3 import _load, _save, endpoint, run  # noqa: F401 - fixtures: the moto server, a fresh prefix


def _ls(root) -> dict:
    rc, out, err = run_cli("ls", root, "--json")
    assert rc == 0, err
    return {r["step"]: r for r in json.loads(out)["checkpoints"] if r.get("tier", "durable") == "durable"}


# ---- a save never outruns a verdict it could depend on ---------------------------------------------------------


def test_a_durable_save_waits_for_the_local_verdict_it_descends_from(tmp_path):
    """Step 2's local save holds a NaN and its commit thread is slowed by 2 s; the NaN is gone again before the
    durable save of step 3, which descends from it. The durable save sees the local verdict first: step 3 is
    rejected for `lineage_tainted`, never certified."""
    root, local_dir = tmp_path / "run", tmp_path / "local"
    out = run_ranks(w.local_verdict_races_durable_save, 2, str(root), str(local_dir), timeout=180)
    r = out[0].result
    assert r["local"] and r["local"]["state"] == "rejected", r
    assert r["durable"]["state"] == "rejected"
    assert "lineage_tainted" in {x["code"] for x in r["durable"]["reasons"]}
    row = _ls(root)[3]
    assert row["state"] == "rejected"


# ---- a lost ledger costs no certificate; could-not-check never starts from scratch -----------------------------


@pytest.fixture(scope="module")
def _saved_5_10(tmp_path_factory):
    """A 2-rank job that saved (and certified) steps 5 and 10, with the digests it printed at each save."""
    root = tmp_path_factory.mktemp("saved") / "run"
    out = run_ranks(w.train_and_save, 2, str(root), timeout=240)
    return root, out[0].result


@pytest.fixture
def saved(_saved_5_10, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(_saved_5_10[0], root)
    return root, _saved_5_10[1]


def _lose(root, what):
    for name in ["scout-ledger.db", "scout-ledger.db-wal", "scout-ledger.db-shm"] + (
        ["scout-journal.jsonl"] if what == "ledger+journal" else []
    ):
        p = root / name
        if p.exists():
            p.unlink()
    if what == "truncated":
        (root / "scout-ledger.db").write_bytes(b"")


def _files(root) -> dict:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "scout-ledger.db" not in p.name and ".leases" not in p.parts
    }


@pytest.mark.parametrize("what", ["deleted", "truncated"])
def test_a_lost_ledger_restarts_from_the_newest_certified_step(saved, what):
    """The job certified steps 5 and 10; its ledger file is lost. The restart rebuilds it from the manifests and
    the journal and loads step 10: the digest it computes after the load is the one the job printed at step 10."""
    root, printed = saved
    assert printed[10][0] == "certified" and printed[5][0] == "certified"
    _lose(root, what)
    out = run_ranks(w.restart, 2, str(root), timeout=240)
    assert [o.result.get("loaded") for o in out] == [10, 10]
    assert {o.result["digest"] for o in out} == {printed[10][1]}


def test_steps_a_rebuild_cannot_vouch_for_refuse_the_start_instead_of_step_0(saved):
    """Ledger and journal both lost: the rebuild cannot re-establish consensus, so steps 5 and 10 are committed
    (`unverified_after_rebuild`). The start is refused on every rank (CheckpointsUnverified, naming the steps),
    never a fresh start that would save over them; the checkpoints are left as they were."""
    root, _ = saved
    _lose(root, "ledger+journal")
    out = run_ranks(w.restart, 2, str(root), 5, timeout=240)
    refused = [o.result.get("refused") for o in out]
    assert refused == ["CheckpointsUnverified", "CheckpointsUnverified"], [o.result for o in out]
    assert "10, 5" in out[0].result["message"] and "unverified_after_rebuild" in out[0].result["message"]
    assert [o.result.get("verdict") for o in out] == [None, None]


def test_a_job_that_does_not_load_cannot_save_over_a_certified_step(saved):
    """A job pointed at ROOT that trains from scratch without loading: its save of step 5 is refused on every
    rank; step 5's folder and its certified row are left as they were."""
    root, _ = saved
    before = _files(root)
    out = run_ranks(w.restart, 2, str(root), 5, load=False, timeout=240)
    assert [o.result.get("refused") for o in out] == ["SaveRefused", "SaveRefused"], [o.result for o in out]
    assert "certified" in out[0].result["message"]
    assert _ls(root)[5]["state"] == "certified"
    after = _files(root)
    assert {k: v for k, v in after.items() if k.startswith("step-")} == {
        k: v for k, v in before.items() if k.startswith("step-")
    }


# ---- the journal is checkable: a hash chain over its records ---------------------------------------------------


def test_every_record_links_to_the_one_before_and_an_edit_breaks_the_chain_there(tmp_path):
    from scout_ckpt.ledger import journal

    for step, state in ((5, "certified"), (10, "rejected"), (15, "certified")):
        journal.journal_verdict(tmp_path, step, f"a{step}", f"d{step}", state, [], "save")
    recs = journal.read(tmp_path)
    assert [r["prev"] == (journal.link(recs[i - 1]) if i else "") for i, r in enumerate(recs)] == [True] * 3
    assert journal.verify(recs)["intact"]
    p = journal.path(tmp_path)
    lines = p.read_text().splitlines()
    p.write_text("\n".join([lines[0], lines[1].replace('"rejected"', '"certified"'), lines[2]]) + "\n")
    assert journal.verify(journal.read(tmp_path))["broken_at"] == 2
    p.write_text("\n".join([lines[0], lines[2]]) + "\n")  # the rejection removed
    assert journal.verify(journal.read(tmp_path))["broken_at"] == 2


def test_a_journal_missing_a_rejection_restores_no_certificate(saved):
    """Step 10 was rejected after the job (a load mismatch, journal first), and the run went on recording; then
    the rejection's line is removed from the journal and the ledger is lost. The chain is broken, so the rebuild
    restores no certificate: the restart refuses (never loads step 10, whose rejection was removed), `ledger
    rebuild` exits 1 naming the break, and `ls` without a ledger certifies nothing."""
    from scout_ckpt.ledger import Ledger, journal

    root, printed = saved
    with Ledger.open(root) as led:
        journal.record_transition(
            led, root, 10, "rejected", [{"code": "load_mismatch"}], source="load", expect="certified"
        )
        row = led.checkpoint(5)
        journal.journal_verdict(root, 5, row["attempt"], row["manifest_digest"], "certified", [], "certify")
    p = journal.path(root)
    p.write_text("".join(line for line in p.read_text().splitlines(keepends=True) if '"load_mismatch"' not in line))
    _lose(root, "deleted")
    rc, out, _ = run_cli("ls", root, "--json")
    assert rc == 0 and {r["step"]: r["state"] for r in json.loads(out)["checkpoints"]} == {
        5: "committed",
        10: "committed",
    }
    out = run_ranks(w.restart, 2, str(root), timeout=240)
    assert [o.result.get("refused") for o in out] == ["CheckpointsUnverified"] * 2, [o.result for o in out]
    assert printed[10][1] not in {o.result.get("digest") for o in out}
    rc, _, err = run_cli("ledger", "rebuild", root)
    assert rc == 1 and "chain is broken" in err


# ---- a verdict on a step holds for every copy, in every tier ---------------------------------------------------

TWO_NODES = {"LOCAL_WORLD_SIZE": "1"}


@pytest.fixture(scope="module")
def _tiers_template(tmp_path_factory):
    """2 ranks as 2 nodes: local steps 2, 4, 6 (each rank's file on its node, a peer copy on the other), durable
    steps 3 and 6; the digests the job printed at every step."""
    base = tmp_path_factory.mktemp("tiers")
    out = run_ranks(w.tiers_job, 2, str(base / "run"), str(base / "local"), timeout=300, env=TWO_NODES)
    r = out[0].result
    assert r["durable"] == {3: "certified", 6: "certified"} and r["last_local"]["state"] == "certified", r
    return base, r["digests"]


@pytest.fixture
def tiers_run(_tiers_template, tmp_path):
    base, printed = _tiers_template
    shutil.copytree(base / "run", tmp_path / "run")
    shutil.copytree(base / "local", tmp_path / "local")
    return tmp_path / "run", tmp_path / "local", printed


def _restart_tiers(root, local_dir):
    out = run_ranks(w.tiers_restart, 2, str(root), str(local_dir), timeout=300, env=TWO_NODES)
    assert out[0].result.get("loaded") == out[1].result.get("loaded"), [o.result for o in out]
    return out[0].result


def test_a_step_held_only_by_the_local_tier_can_be_quarantined_and_is_never_loaded(tiers_run):
    """Local step 4 has no durable folder. `quarantine ROOT 4` quarantines it (exit 0; `ls` shows the local row
    quarantined); the restart loads durable step 3 (its printed digest), never local step 4; `release` gives the
    local step its state back."""
    root, local_dir, printed = tiers_run
    rc, _, err = run_cli("quarantine", root, "4", "--reason", "suspect node")
    assert rc == 0, err
    rc, out, _ = run_cli("ls", root, "--json")
    local = {r["step"]: r["state"] for r in json.loads(out)["local"]}
    assert local[4] == "quarantined"
    got = _restart_tiers(root, local_dir)
    assert (got["loaded"], got["digest"]) == (6, printed[6])  # the newest step is untouched
    rc, _, err = run_cli("quarantine", root, "6", "--reason", "suspect node")
    assert rc == 0, err
    got = _restart_tiers(root, local_dir)
    assert (got["loaded"], got["tier"], got["digest"]) == (3, "durable", printed[3])
    rc, out, err = run_cli("release", root, "4", "--reason", "node replaced", "--json")
    assert rc == 0 and json.loads(out)["state"] == "certified", err


def _lower(path: str, root, step: int) -> None:
    """Lower STEP's trust by one of the paths that do it, each through the function (or command) that path
    calls; "none" is the control: nothing lowered."""
    from scout_ckpt.ledger import Ledger, journal
    from scout_ckpt.save import local_tier_rows as local_rows

    if path == "none":
        return
    if path == "quarantine":
        run_cli("quarantine", root, str(step), "--reason", "matrix", check_rc=0)
        return
    with Ledger.open(root) as led:
        if path == "revocation":  # an update fault found at step+1 with a cycle of 2: steps in (step-1, step+1]
            from types import SimpleNamespace

            from scout_ckpt.save.evidence.shard import ShardEvidence

            shard = ShardEvidence.__new__(ShardEvidence)
            shard.log = SimpleNamespace(cycle=2)
            assert step in shard.revoke(
                led,
                root,
                [
                    {
                        "step": step + 1,
                        "status": "fail",
                        "ranks": [1],
                        "reasons": [{"code": "shard_replay_mismatch", "ranks": [1]}],
                    }
                ],
            )
        elif path == "local_verdict":  # a step-level verdict reached through the local row (its own consensus)
            assert local_rows.set_state(
                led, step, "rejected", [{"code": "consensus_attributed", "ranks": [1]}], expect="certified"
            )
        else:
            code, source = {
                "certify": ("invariant_failed", "certify"),
                "replay": ("replay_sdc", "replay"),
                "load_mismatch": ("load_mismatch", "load"),
            }[path]
            assert journal.record_transition(
                led, root, step, "rejected", [{"code": code, "ranks": [1]}], source=source, expect="certified"
            )


def _keep_only(tier: str, root, local_dir, step: int) -> None:
    """Leave STEP's bytes in one kind of copy: the durable folder; the local files (own node's); or, for rank 0,
    only the peer copy its ring neighbour holds. The rows stay as they are."""
    name = f"step-{step:08d}"
    if tier == "durable":
        for d in local_dir.glob(f"node*/*/{name}"):
            shutil.rmtree(d)
        return
    shutil.rmtree(root / name)
    if tier == "peer":
        (own,) = local_dir.glob(f"node0/*/{name}/rank-0.pt")
        own.unlink()


PATHS = ["none", "quarantine", "revocation", "certify", "replay", "load_mismatch", "local_verdict"]
TIERS = ["durable", "local", "peer"]


@pytest.mark.scenario
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("path", PATHS)
def test_a_lowered_step_is_never_loaded_from_any_copy(tiers_run, path, tier):
    """Every trust-lowering path x every kind of copy that could hand out step 6: the restart never loads step
    6 (judged by the digest the job printed at step 6), and loads local step 4 instead (its printed digest);
    the control ("none") loads step 6 from that copy."""
    root, local_dir, printed = tiers_run
    _keep_only(tier, root, local_dir, 6)
    _lower(path, root, 6)
    got = _restart_tiers(root, local_dir)
    if path == "none":
        assert (got["loaded"], got["digest"]) == (6, printed[6]), got
        assert got["tier"] == ("durable" if tier == "durable" else "local"), got
        assert (got["fetched"] == [0]) == (tier == "peer"), got
        return
    assert got["digest"] != printed[6], got
    assert (got["loaded"], got["digest"]) == (4, printed[4]), got


# ---- an object-store run whose ledger_dir is lost, twice -------------------------------------------------------


def test_a_lost_ledger_dir_of_an_s3_run_restarts_from_the_newest_certified_step_twice(run):  # noqa: F811
    """An S3 run saves steps 2 and 4; its ledger_dir is lost; the next generation rebuilds it from the bucket
    (manifests and the journal's copy) and loads step 4 (the digest the job printed), then saves step 6. The
    ledger_dir is lost again: the journal restored from the bucket the first time kept its seq and its chain, so
    the next generation loads step 6, never starts afresh."""
    printed = _save(run, [2, 4])["saved"]
    shutil.rmtree(run["ledger"])
    got = _load(run, then_save=6)
    assert (got["step"], got["digest"]) == (4, printed[4])
    assert got["verdict"] == "certified"
    shutil.rmtree(run["ledger"])
    got = _load(run)
    assert got["step"] == 6


# ---- a walk-back that rejects its last candidate leaves no mismatched values to train on ----------------------


def test_a_walk_back_that_rejects_every_candidate_for_load_mismatch_refuses_to_start(saved):
    """Every load's values differ from the certified signatures (a loader fault after dcp.load): steps 10 and
    5 are rejected (load_mismatch), and with none left the start is refused on every rank (StateOverwritten, exit
    code 75) instead of returning None with step 5's mismatched values in the caller's state."""
    root, _ = saved
    out = run_ranks(w.restart_with_loader_fault, 2, str(root), timeout=240)
    assert [o.result.get("refused") for o in out] == ["StateOverwritten"] * 2, [o.result for o in out]
    assert out[0].result["exit_code"] == 75
    rows = _ls(root)
    assert [rows[s]["state"] for s in (5, 10)] == ["rejected", "rejected"]
    assert {r["code"] for s in (5, 10) for r in rows[s]["reasons"]} == {"load_mismatch"}


def test_eio_on_every_copy_of_every_step_refuses_the_start_and_rejects_nothing(tiers_run):
    """Every durable folder and every node-local file answers EIO: the restart refuses on every rank
    (CheckpointsUnreadable, exit code 75, naming local and durable steps) instead of starting from step 0;
    nothing was rejected, so once the storage answers the restart loads step 6 (its printed digest)."""
    root, local_dir, printed = tiers_run
    out = run_ranks(w.tiers_restart_eio, 2, str(root), str(local_dir), timeout=300, env=TWO_NODES)
    assert [o.result.get("refused") for o in out] == ["CheckpointsUnreadable"] * 2, [o.result for o in out]
    assert "6 (local)" in out[0].result["message"] and "could_not_check" in out[0].result["message"]
    got = _restart_tiers(root, local_dir)
    assert (got["loaded"], got["digest"]) == (6, printed[6])


def test_a_save_of_a_certified_step_or_of_a_step_quarantined_in_either_tier_is_refused(tmp_path):
    """The ledger's `writing` row is where a save starts: refused for a certified step (a job's save), for a
    step quarantined in the durable tier, and for one quarantined only in the fast tier; each refusal is in the
    history and the rows are left as they were."""
    from scout_ckpt.errors import CertifiedStep, Quarantined
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.ops.operator import quarantine
    from scout_ckpt.save import local_tier_rows as rows

    with Ledger.open(tmp_path, create=True) as led:
        led.begin_run("r1", world_size=2, topology={}, policy={"require": ["bytes"]})
        led.record_writing(3, "r1", "a3", "step-00000003")
        led.record_commit(
            3,
            run_id="r1",
            path="step-00000003",
            nbytes=1,
            manifest_digest="m3",
            files=[],
            evidence={},
            state="certified",
            reasons=[],
            attempt="a3",
        )
        rows.record(
            led,
            step=4,
            run_id="r1",
            state="certified",
            dir="r1/step-00000004",
            world_size=2,
            layout={},
            files=[],
            copies=[],
            evidence={},
            signatures={},
            reasons=[],
        )
    quarantine(tmp_path, 4, "suspect node")
    with Ledger.open(tmp_path) as led:
        with pytest.raises(CertifiedStep):
            led.record_writing(3, "r2", "b3", "step-00000003", keep_certified=True)
        with pytest.raises(Quarantined):
            led.record_writing(4, "r2", "b4", "step-00000004", keep_certified=True)
        assert (led.checkpoint(3)["state"], led.checkpoint(3)["attempt"]) == ("certified", "a3")
        assert led.checkpoint(4) is None and rows.row(led, 4)["state"] == "quarantined"
        led.record_writing(3, "r2", "c3", "step-00000003")  # a tool's re-record (adopt) is not a job's save
        assert led.checkpoint(3)["state"] == "writing"
