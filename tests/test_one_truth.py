"""One truth per step: a verdict reaches every copy, in every tier, and a save never outruns one.

Real gloo ranks (scout_ckpt.testing.launch.run_ranks), real SQLite ledgers and journals, real CLI subprocesses;
faults placed by real means (a NaN written into a weight, a slow commit thread, a deleted ledger file).
"""

from __future__ import annotations

import itertools
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


@pytest.mark.scenario
@pytest.mark.parametrize(("save_step", "load"), [(5, False), (10, True)], ids=["over_old_step", "loaded_step"])
def test_a_resave_of_a_certified_step_never_reaches_a_write_a_sigkill_could_interrupt(saved, save_step, load):
    """The suspected case: a re-save of a certified step replaced its row with `writing`, and a SIGKILL before
    the commit's rename left the good folder judged `save_interrupted`. Rank 0 SIGKILLs itself at the save's
    first write point; the save never gets there (refused over an old step; not made again for the step just
    loaded), so no rank dies; the folder and its certified row are as they were, and the restart loads step 10
    (the digest the job printed)."""
    root, printed = saved
    before = {k: v for k, v in _files(root).items() if k.startswith("step-")}
    out = run_ranks(w.resave_then_sigkill, 2, str(root), save_step, load, timeout=240)
    if load:
        assert [o.result.get("loaded") for o in out] == [10, 10], [o.result for o in out]
        assert [o.result["verdict"].get("not_saved") for o in out] == ["resumed_from_this_step"] * 2
    else:
        assert [o.result.get("refused") for o in out] == ["SaveRefused"] * 2, [o.result for o in out]
    assert {k: v for k, v in _files(root).items() if k.startswith("step-")} == before
    assert (_ls(root)[save_step]["state"], _ls(root)[save_step]["reasons"]) == ("certified", [])
    got = run_ranks(w.restart, 2, str(root), timeout=240)
    assert {(o.result["loaded"], o.result["digest"]) for o in got} == {(10, printed[10][1])}


# ---- a verdict on a step holds for every copy, in every tier ---------------------------------------------------

TWO_NODES = {"LOCAL_WORLD_SIZE": "1"}


def test_a_quarantined_step_reached_again_by_a_later_run_is_saved_anew_with_the_quarantined_folder_kept(saved):
    """The operator quarantines step 10; the restart resumes step 5 and, training on, saves step 10 again. The
    save is not refused (a refusal would stop every restart at step 10): the quarantined folder is set aside,
    unchanged, the new attempt is judged on its own evidence, and the next restart loads the new step 10 with the
    digest the job printed when it saved it. The quarantine stays in the step's history."""
    root, _ = saved
    rc, so, se = run_cli("quarantine", root, 10, "--reason", "suspect host")
    assert rc == 0, so + se
    (folder,) = [p.name for p in root.iterdir() if p.name.startswith("step-") and p.name.endswith("10")]
    quarantined = {k: v for k, v in _files(root).items() if k.startswith(folder + "/")}
    out = run_ranks(w.restart, 2, str(root), 10, timeout=240)
    assert [o.result.get("loaded") for o in out] == [5, 5], [o.result for o in out]
    assert [o.result["verdict"]["state"] for o in out] == ["certified", "certified"], [o.result for o in out]
    (aside,) = [p.name for p in root.iterdir() if p.name.startswith(folder + ".scout-quarantined-")]
    kept = {k.replace(aside, folder, 1): v for k, v in _files(root).items() if k.startswith(aside + "/")}
    assert kept == quarantined and (root / folder).is_dir()  # the quarantined bytes kept, the new step beside them
    got = run_ranks(w.restart, 2, str(root), timeout=240)
    assert {(o.result["loaded"], o.result["digest"]) for o in got} == {(10, out[0].result["saved_digest"])}
    rc, so, se = run_cli("explain", root, 10, "--json")
    states = [h["state"] for h in json.loads(so)["history"]]
    assert rc == 0 and "quarantined" in states and states[-1] == "certified", so + se


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


def _reject(root, step: int, code: str, source: str) -> None:
    """A step-level rejection through the call every verdict change outside a commit goes through (journal
    first, then the ledger; journal.record_transition)."""
    from scout_ckpt.ledger import Ledger, journal

    with Ledger.open(root) as led:
        assert journal.record_transition(
            led, root, step, "rejected", [{"code": code, "ranks": [1]}], source=source, expect="certified"
        )


def _revoke(root, step: int) -> None:
    """An update fault found at step+1 with a cycle of 2 (ShardEvidence.revoke): steps in (step-1, step+1]."""
    from types import SimpleNamespace

    from scout_ckpt.ledger import Ledger
    from scout_ckpt.save.evidence.shard import ShardEvidence

    shard = ShardEvidence.__new__(ShardEvidence)
    shard.log = SimpleNamespace(cycle=2)
    bad = {"step": step + 1, "status": "fail", "ranks": [1], "reasons": [{"code": "shard_replay_mismatch"}]}
    with Ledger.open(root) as led:
        assert step in shard.revoke(led, root, [bad])


def _local_verdict(root, step: int) -> None:
    """A step-level verdict reached through the fast tier's row (its own consensus attributed a rank)."""
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.save import local_tier_rows as local_rows

    with Ledger.open(root) as led:
        reasons = [{"code": "consensus_attributed", "ranks": [1]}]
        assert local_rows.set_state(led, step, "rejected", reasons, expect="certified")


def _release_after_rejection(root, step: int) -> None:
    """An operator quarantines a rejected step, then releases it: the release never raises it again."""
    _reject(root, step, "load_mismatch", "load")
    run_cli("quarantine", root, str(step), "--reason", "matrix", check_rc=0)
    run_cli("release", root, str(step), "--reason", "matrix", check_rc=0)


# Every path that lowers a step's trust, each through the function (or command) that path calls; "none" is the
# control: nothing lowered.
LOWER = {
    "none": lambda root, step: None,
    "quarantine": lambda root, step: run_cli("quarantine", root, str(step), "--reason", "matrix", check_rc=0),
    "release": _release_after_rejection,
    "revocation": _revoke,
    "certify": lambda root, step: _reject(root, step, "invariant_failed", "certify"),
    "replay": lambda root, step: _reject(root, step, "replay_sdc", "replay"),
    "load_mismatch": lambda root, step: _reject(root, step, "load_mismatch", "load"),
    "lineage": lambda root, step: _reject(root, step, "lineage_tainted", "lineage"),
    "local_verdict": _local_verdict,
}


def _gc(root) -> None:
    run_cli("gc", root, "--keep", "2", check_rc=0)


def _rebuild(root) -> None:
    """The ledger rebuilt by the command (the old one kept beside it and read for the fast tier's rows)."""
    rc, _, err = run_cli("ledger", "rebuild", root)
    assert rc != 2, err  # 1: a step it could not vouch for; judged below by what the restart loads


# What may follow the lowering before the restart: nothing, a gc (rejected and partial steps go first), a
# ledger rebuild (the verdict must come back from the journal and the rows).
AFTER = {"as_is": lambda root: None, "gc": _gc, "rebuild": _rebuild}


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


TIERS = ["durable", "local", "peer"]
MATRIX = list(itertools.product(LOWER, TIERS, AFTER))


@pytest.mark.scenario
@pytest.mark.parametrize(("path", "tier", "after"), MATRIX, ids=["-".join(c) for c in MATRIX])
def test_a_lowered_step_is_never_loaded_from_any_copy(tiers_run, path, tier, after):
    """Every trust-lowering path x every kind of copy that could hand out step 6 x what may follow (nothing, gc,
    a ledger rebuild): the restart never loads step 6 (judged by the digest the job printed at step 6), and
    loads local step 4 instead (its printed digest); the control ("none") loads step 6 from that copy."""
    root, local_dir, printed = tiers_run
    _keep_only(tier, root, local_dir, 6)
    LOWER[path](root, 6)
    AFTER[after](root)
    got = _restart_tiers(root, local_dir)
    if path == "none":
        assert (got["loaded"], got["digest"]) == (6, printed[6]), got
        assert got["tier"] == ("durable" if tier == "durable" else "local"), got
        assert (got["fetched"] == [0]) == (tier == "peer"), got
        return
    assert got["digest"] != printed[6], got
    assert (got["loaded"], got["digest"]) == (4, printed[4]), got


def _lose_ledger_dir_and_rebuild(s3run) -> None:
    """The node holding an S3 run's ledger_dir is lost, ledger and journal; `ledger rebuild LEDGER --uri` brings
    back what the bucket holds (manifests, the journal's copy)."""
    shutil.rmtree(s3run["ledger"])
    rc, _, err = run_cli("ledger", "rebuild", s3run["ledger"], "--uri", s3run["uri"])
    assert rc != 2, err  # 1: a step it could not vouch for; judged below by what the restart loads


S3_AFTER = {
    "as_is": lambda s3run: None,
    "gc": lambda s3run: _gc(s3run["ledger"]),
    "rebuild": _lose_ledger_dir_and_rebuild,
}
S3_MATRIX = list(itertools.product([p for p in LOWER if p != "local_verdict"], S3_AFTER))


@pytest.mark.scenario
@pytest.mark.parametrize(("path", "after"), S3_MATRIX, ids=["-".join(c) for c in S3_MATRIX])
def test_a_lowered_step_of_an_s3_run_is_never_loaded(run, monkeypatch, path, after):  # noqa: F811 (a fixture)
    """The object-store tier: an S3 run saves steps 2 and 4; step 4 is lowered by every path (on the run's
    ledger_dir, as an operator or the job would) and then left, gc'd, or its ledger_dir lost and rebuilt from the
    bucket: the restart never loads step 4 (the digest the job printed) and loads step 2; the control loads 4.
    (The fast tier's own verdict, "local_verdict", has no row on an S3-only run.)"""
    monkeypatch.setenv("AWS_ENDPOINT_URL", run["ep"])  # the commands below reach the bucket (the journal's copy)
    printed = _save(run, [2, 4])
    assert printed["verdicts"] == {2: "certified", 4: "certified"}, printed
    LOWER[path](run["ledger"], 4)
    S3_AFTER[after](run)
    got = _load(run)
    if path == "none":
        assert (got["step"], got["digest"]) == (4, printed["saved"][4]), got
        return
    assert got["digest"] != printed["saved"][4], got
    assert (got["step"], got["digest"]) == (2, printed["saved"][2]), got


@pytest.mark.scenario
def test_a_copy_whose_bytes_fail_is_ruled_out_alone_and_every_view_lists_the_copies(tiers_run):
    """One byte of step 6's durable folder flips; `certify --step 6` rejects that copy (digest_mismatch). The
    step is still certified: `ls --json` lists step 6 with its durable folder failed and its node-local files
    and peer copies passing, `explain --json` says the same, and the restart loads step 6 from the fast tier
    (the digest the job printed at step 6). gc and report list the same steps."""
    root, local_dir, printed = tiers_run
    victim = sorted((root / "step-00000006").glob("*.distcp"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    rc, out, err = run_cli("certify", root, "--step", "6", "--json")
    assert rc == 1 and "digest_mismatch" in out, (out, err)
    rc, out, err = run_cli("ls", root, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    step6 = next(v for v in doc["steps"] if v["step"] == 6)
    assert (step6["state"], step6["tiers"]) == ("certified", {"durable": "rejected", "local": "certified"})
    by_kind = {}
    for c in step6["copies"]:
        by_kind.setdefault(c["kind"], []).append(c["bytes"]["status"])
    assert by_kind == {"durable_folder": ["fail"], "node_local": ["pass", "pass"], "peer": ["pass", "pass"]}
    assert next(r for r in doc["checkpoints"] if r["step"] == 6)["copies"] == step6["copies"]
    # local step 2 went with the fast tier's own retention: it stays listed, as deleted
    assert {v["step"]: v["state"] for v in doc["steps"]} == {
        6: "certified",
        4: "certified",
        3: "certified",
        2: "deleted",
    }
    rc, out, _ = run_cli("explain", root, "6", "--json")
    got = json.loads(out)
    assert (rc, got["state"], got["step_state"], got["copies"]) == (1, "rejected", "certified", step6["copies"])
    rc, out, err = run_cli("report", root, "--json")
    assert rc == 0 and {v["step"] for v in json.loads(out)["steps"]} == {2, 3, 4, 6}, err
    rc, out, err = run_cli("gc", root, "--keep", "3", "--dry-run", "--json")
    assert rc == 0 and next(v for v in json.loads(out)["steps"] if v["step"] == 6)["state"] == "certified", err
    got = _restart_tiers(root, local_dir)
    assert (got["loaded"], got["tier"], got["digest"]) == (6, "local", printed[6]), got


def _pending_local_step(led, step: int) -> None:
    """A local save recorded while replay was pending (the row as the local tier commits it: committed,
    replay `missing` with replay_pending), its bytes and consensus passing."""
    from scout_ckpt import policy
    from scout_ckpt.save import local_tier_rows as local_rows

    ev = {
        "bytes": policy.evidence(policy.PASS, []),
        "consensus": policy.evidence(policy.PASS, []),
        "replay": policy.evidence(policy.MISSING, [{"code": "replay_pending", "awaiting": ["blocks.0"]}]),
    }
    v = policy.evaluate({"require": ["bytes", "consensus", "replay"]}, ev)
    assert v.state == "committed"
    local_rows.record(
        led,
        step=step,
        run_id="r1",
        state=v.state,
        dir=f"r1/step-{step:08d}",
        world_size=2,
        layout={},
        files=[],
        copies=[],
        evidence=ev,
        signatures={},
        reasons=v.reasons,
    )


@pytest.mark.parametrize(("status", "settled"), [("AGREE", "certified"), ("ATTRIBUTED", "rejected")])
def test_a_local_save_waiting_on_replay_is_settled_by_the_next_replay(tmp_path, status, settled):
    """A local save committed while replay was pending (`replay_pending`) is re-decided by the replays that
    follow, through the same call that settles the durable tier's pending saves (ReplayEvidence.settle_pending):
    certified by a clean replay after it, rejected (replay_sdc) by one that attributes a rank. Before, a local
    row waited forever: never a restart candidate, and never rejected by the replay that found the fault."""
    from types import SimpleNamespace

    from scout_ckpt.ledger import Ledger
    from scout_ckpt.save import local_tier_rows as local_rows
    from scout_ckpt.save.evidence.replay import ReplayEvidence

    with Ledger.open(tmp_path, create=True) as led:
        pol = {"require": ["bytes", "consensus", "replay"]}
        led.begin_run("r1", world_size=2, topology={}, policy=pol)
        _pending_local_step(led, 4)
        rep = ReplayEvidence(SimpleNamespace(targets=lambda: [("block", "blocks.0")]))
        rep.bind(ledger=led, root=tmp_path, run_id="r1", policy=pol, is_coordinator=True)
        rep.stepped = True
        row = {"run_id": "r1", "recipe": "block", "target": "blocks.0"}
        # a clean replay before the save (coverage up to it), then the first one after it
        led.add_replays(
            [{**row, "step": 3, "status": "AGREE", "ranks": []}, {**row, "step": 5, "status": status, "ranks": [1]}]
        )
        rep.settle_pending()
        row = local_rows.row(led, 4)
    assert row["state"] == settled, row
    assert row["evidence"]["replay"]["status"] == ("pass" if status == "AGREE" else "fail")


@pytest.mark.scenario
def test_with_the_defaults_every_local_save_is_certified_at_its_commit_and_restarts_exactly(tmp_path):
    """With the defaults (replay on), a local save runs the replay sweep over what the interval did not cover,
    so no local save waits on replay: each is certified as it is committed, `ls` agrees, and a restart loads the
    newest local step (the digest the job printed at that step). A save that did wait (`replay_pending`) is
    settled by the replays that follow it: test_a_local_save_waiting_on_replay_is_settled_by_the_next_replay."""
    root, local_dir = tmp_path / "run", tmp_path / "local"
    out = run_ranks(w.tiers_job_with_replay, 2, str(root), str(local_dir), timeout=300, env=TWO_NODES)
    r = out[0].result
    assert r["verdicts"] == {2: "certified", 4: "certified", 6: "certified", 8: "certified"}, r["verdicts"]
    rc, doc, err = run_cli("ls", root, "--json")
    assert rc == 0, err
    local = {x["step"]: x["state"] for x in json.loads(doc)["local"] if x["state"] != "deleted"}
    assert local == {6: "certified", 8: "certified"}, local  # the tier keeps 2 by default
    got = _restart_tiers(root, local_dir)
    assert (got["loaded"], got["tier"], got["digest"]) == (8, "local", r["digests"][8]), got


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
