"""A quarantined step reached again, on every storage: the run that wrote the quarantined attempt is refused, a
later incarnation (resumed from an earlier step) saves the step anew, and the quarantined attempt's bytes are
kept, byte for byte, out of reach of the start-up sweep, `gc` and retention; the views show where they lie.

Judged by the jobs' own digests (sha256 of the state each saved or loaded) and by the test's own record of the
quarantined attempt's bytes, never by scout-ckpt's account of itself. The fast tests drive the real ledger and a
real S3 server (moto) in-process; the scenarios run real gloo ranks."""

from __future__ import annotations

import hashlib
import json
import sqlite3

import pytest

from scout_ckpt.format import layout
from scout_ckpt.ledger import Ledger
from scout_ckpt.testing.launch import run_ranks
from tests import test_s3
from tests import workers_qseam as wq
from tests.conftest import run_cli
from tests.test_s3 import CREDS, _attempts, _cli, _store

TWO_NODES = {"LOCAL_WORLD_SIZE": "1"}
endpoint, run = test_s3.endpoint, test_s3.run  # fixtures: the moto server, a fresh prefix on it


def _committed(led, step: int, attempt: str, path: str, run_id: str) -> None:
    led.record_writing(step, run_id, attempt, path)
    led.record_commit(
        step,
        run_id=run_id,
        path=path,
        nbytes=4,
        manifest_digest=f"m-{attempt}",
        files=[],
        evidence={},
        state="certified",
        reasons=[],
        attempt=attempt,
    )


def _objects(where, name: str) -> dict[str, str]:
    """{object: sha256 of its bytes} under one attempt prefix: the test's own record of the bytes."""
    base, fs = f"{where['prefix']}/{name}", where["fs"]
    return {p[len(base) + 1 :]: hashlib.sha256(fs.cat_file(p)).hexdigest() for p in fs.find(base)}


# ---- in-process: the real ledger and the real S3 server, no ranks (fast) ---------------------------------------


def test_an_object_store_attempt_is_set_aside_for_a_later_run_only_and_kept_by_the_sweep_and_gc(run, tmp_path):
    """Step 4's attempt A (run r1) is quarantined. r1 saving step 4 again is refused (Quarantined) with the row
    and the objects as they were; r2 saving it is recorded over the row, with an event naming A's prefix. The
    start-up sweep and `gc` then keep A's objects byte for byte, while they still remove a dead attempt of
    another step (an interrupted save) and an older attempt of a step saved again after a walk-back. With the
    events gone (a ledger rebuilt from the bucket), the journal's quarantine still keeps A."""
    from scout_ckpt.errors import Quarantined
    from scout_ckpt.object_store.attempts import sweep
    from scout_ckpt.ops import retention
    from scout_ckpt.ops.operator import quarantine

    store = _store(run)
    a4, b4 = layout.attempt_dirname(4, "A"), layout.attempt_dirname(4, "B")
    old2, new2, dead6 = (layout.attempt_dirname(*k) for k in [(2, "old"), (2, "new"), (6, "dead")])
    for name in (a4, b4, old2, new2, dead6):
        run["fs"].pipe_file(store.key(name, "__0_0.distcp"), name.encode() * 3)
    for name in (a4, b4, old2, new2):
        run["fs"].pipe_file(store.key(name, layout.MANIFEST_NAME), b"{}")
    kept = _objects(run, a4)
    with Ledger.open(tmp_path, create=True) as led:
        led.begin_run("r1", world_size=2, topology={}, policy={"require": ["bytes"]})
        _committed(led, 2, "old", old2, "r1")
        _committed(led, 4, "A", a4, "r1")
        led.record_writing(6, "r1", "dead", dead6)
        led.transition(6, "rejected", [{"code": "save_interrupted"}], source="startup", expect="writing")
    quarantine(tmp_path, 4, "suspect node")
    with Ledger.open(tmp_path) as led:
        with pytest.raises(Quarantined):
            led.record_writing(4, "r1", "B", b4, over_quarantined=True)
        assert (led.checkpoint(4)["state"], led.checkpoint(4)["path"]) == ("quarantined", a4)
        _committed(led, 2, "new", new2, "r2")  # a step saved again after a walk-back: its old attempt is dead
        led.record_writing(4, "r2", "B", b4, over_quarantined=True)
        assert (led.checkpoint(4)["attempt"], led.checkpoint(4)["path"]) == ("B", b4)
        (event,) = [e["detail"] for e in led.events(("quarantine_set_aside",))]
        assert (event["path"], event["attempt"], event["run_id"], event["storage"]) == (a4, "A", "r1", "object_store")
        swept = sweep(led, store, source="startup")
        assert sorted(r["attempt"] for r in swept["removed"]) == sorted([old2, dead6])
        gone = retention.apply(led, tmp_path, 1, store=store)
    assert a4 in _attempts(run) and _objects(run, a4) == kept
    assert old2 not in _attempts(run) and dead6 not in _attempts(run) and gone["swept"]["removed"] == []
    with sqlite3.connect(tmp_path / "scout-ledger.db") as db:  # as a ledger rebuilt from the bucket: no events
        db.execute("DELETE FROM events WHERE kind='quarantine_set_aside'")
    with Ledger.open(tmp_path) as led:
        assert sweep(led, store, source="gc")["removed"] == []
    assert _objects(run, a4) == kept


def test_a_durable_save_of_a_later_run_sets_aside_the_fast_tiers_quarantined_copy(tmp_path):
    """A step the fast tier alone holds (run r1's local save), quarantined: r1's durable save of it is refused;
    r2's is recorded, the local row leaves the way (the step is the new attempt's alone) and an event names
    r1's local folder with the digests its row recorded, which the orphan sweep keeps."""
    from scout_ckpt.errors import Quarantined
    from scout_ckpt.ledger import aside, tiers
    from scout_ckpt.ops.operator import quarantine
    from scout_ckpt.save import local_tier_rows as rows

    files = [{"path": "rank-0.pt", "size": 3, "digest": "xxh3_128:ab", "rank": 0, "host": "h", "where": "/l/x"}]
    with Ledger.open(tmp_path, create=True) as led:
        led.begin_run("r1", world_size=1, topology={}, policy={"require": ["bytes"]})
        rows.record(
            led,
            step=4,
            run_id="r1",
            state="certified",
            dir="r1/step-00000004",
            world_size=1,
            layout={},
            files=files,
            copies=[],
            evidence={},
            signatures={},
            reasons=[],
        )
    quarantine(tmp_path, 4, "suspect node")
    with Ledger.open(tmp_path) as led:
        with pytest.raises(Quarantined):
            led.record_writing(4, "r1", "b4", "step-00000004", over_quarantined=True)
        assert tiers.row(led, 4)["state"] == "quarantined" and led.checkpoint(4) is None
        led.record_writing(4, "r2", "b4", "step-00000004", over_quarantined=True)
        assert led.checkpoint(4)["state"] == "writing" and tiers.row(led, 4) is None
        (event,) = aside.records(led, 4)
        assert (event["tier"], event["dir"], event["run_id"], event["files"]) == (
            "local",
            "r1/step-00000004",
            "r1",
            files,
        )
        assert aside.kept_dirs(led) == {"r1/step-00000004"}


# ---- scenarios: real gloo ranks ----------------------------------------------------------------------------------


@pytest.mark.scenario
def test_s3_a_quarantined_step_is_refused_to_its_run_and_saved_anew_by_the_next_with_its_objects_kept(run):
    """2 ranks on S3. Run 1 saves 2 and 4; the operator quarantines 4 while it runs; run 1's save of 4 again is
    refused on every rank. Run 2 resumes step 2 (run 1's digest), trains to 4 and saves it: certified. The
    quarantined attempt's objects are unchanged after run 2's save, run 3's start-up sweep and `gc --keep 1`;
    run 3 loads step 4 with the digest run 2 printed; `ls`, `explain` and `resume --latest-clean` name the
    set-aside prefix and hand out the new attempt."""
    uri, ledger = run["uri"], run["ledger"]
    first = run_ranks(wq.s3_quarantined_by_its_own_run, 2, uri, ledger, run["ep"], timeout=300, env=CREDS)
    assert [o.result["refused"]["error"] for o in first] == ["SaveRefused"] * 2, [o.result for o in first]
    saved = first[0].result["saved"]
    with Ledger.open(ledger, readonly=True) as led:
        quarantined = led.checkpoint(4)
    assert quarantined["state"] == "quarantined"
    kept = _objects(run, quarantined["path"])
    assert layout.MANIFEST_NAME in kept

    from tests import workers_s3 as w

    second = run_ranks(w.save_steps, 2, uri, ledger, run["ep"], [4], resume=True, timeout=300, env=CREDS)
    r2 = second[0].result
    assert r2["loaded"] == {"step": 2, "digest": saved[2]}, r2
    assert r2["verdicts"] == {4: "certified"}, r2
    assert _objects(run, quarantined["path"]) == kept
    third = run_ranks(w.load_latest, 2, uri, ledger, run["ep"], timeout=300, env=CREDS)
    assert third[0].result["step"] == 4 and third[0].result["digest"] == r2["saved"][4], third[0].result
    _cli(run, "gc", ledger, "--keep", "1", check_rc=0)
    assert _objects(run, quarantined["path"]) == kept

    aside_uri = f"{uri}/{quarantined['path']}"
    rc, out, err = _cli(run, "ls", ledger, "--json")
    listed = json.loads(out)
    assert rc == 0 and [(r["step"], r["where"]) for r in listed["set_aside"]] == [(4, aside_uri)], (out, err)
    row4 = {r["step"]: r for r in listed["checkpoints"]}[4]
    assert row4["state"] == "certified" and row4["path"] != quarantined["path"]
    rc, out, err = _cli(run, "explain", ledger, "4", "--json")
    doc = json.loads(out)
    assert rc == 0 and [r["attempt"] for r in doc["set_aside"]] == [quarantined["attempt"]], (out, err)
    assert "quarantined" in [h["state"] for h in doc["history"]]
    rc, out, err = _cli(run, "resume", ledger, "--latest-clean", "--json")
    found = json.loads(out)
    assert rc == 0 and found["path"] == f"{uri}/{row4['path']}" and found["set_aside"][0]["where"] == aside_uri, (
        out,
        err,
    )


@pytest.mark.scenario
@pytest.mark.scenario_ci  # the CI tier's fast-tier seam: about 17 s on 2 busy cores
def test_fast_tier_a_quarantined_local_step_is_refused_to_its_run_and_saved_anew_by_the_next(tmp_path):
    """2 ranks as 2 nodes; local saves every 2 steps, a durable save at 3. The operator quarantines step 4 (held
    by the fast tier alone); run 1's local save of 4 again is rejected (`quarantined`) and leaves every file of
    its step-4 folder as it was, although it saved another state, and so does the retention (keep=1) of its next
    local save, step 6, which the operator then quarantines too. Run 2 resumes durable step 3 (run 1's digest),
    saves 4 locally: certified. Run 3 loads local step 4 with the digest run 2 computed; run 1's quarantined
    files are still there byte for byte after the start-up sweeps of runs 2 and 3; `ls` and `explain` name
    them."""
    root, local = tmp_path / "run", tmp_path / "local"
    first = run_ranks(wq.tiers_quarantined_by_its_own_run, 2, str(root), str(local), timeout=300, env=TWO_NODES)
    r1 = [o.result for o in first]
    assert [r["verdicts"] for r in r1] == [{3: "certified", 4: "certified", 6: "certified"}] * 2, r1
    assert [(r["again"]["state"], r["again"]["reasons"][0]["code"]) for r in r1] == [("rejected", "quarantined")] * 2
    assert all(r["before"] and r["after"] == r["before"] for r in r1), r1
    run1 = r1[0]["run_id"]

    second = run_ranks(wq.tiers_later_run_reaches_the_step, 2, str(root), str(local), timeout=300, env=TWO_NODES)
    r2 = [o.result for o in second]
    assert [(r["loaded"], r["tier"], r["loaded_digest"]) for r in r2] == [(3, "durable", r1[0]["digests"][3])] * 2
    assert [r["verdict"]["state"] for r in r2] == ["certified"] * 2, r2

    from tests import workers_one_truth as w1

    third = run_ranks(w1.tiers_restart, 2, str(root), str(local), timeout=300, env=TWO_NODES)
    assert [(o.result["loaded"], o.result["tier"], o.result["digest"]) for o in third] == [
        (4, "local", r2[0]["digest"])
    ] * 2, [o.result for o in third]
    for rank, r in enumerate(r1):
        assert wq._files(local / f"node{rank}" / run1 / "step-00000004") == r["before"]

    rc, out, err = run_cli("ls", root, "--json")
    listed = json.loads(out)
    assert rc == 0 and [(r["step"], r["tier"], r["dir"]) for r in listed["set_aside"]] == [
        (4, "local", f"{run1}/step-00000004")
    ], (out, err)
    assert {r["step"]: (r["state"], r["run_id"]) for r in listed["local"]}[4] == ("certified", r2[0]["run_id"])
    rc, out, err = run_cli("explain", root, "4", "--json")
    assert rc == 0 and [r["run_id"] for r in json.loads(out)["set_aside"]] == [run1], (out, err)


def _job_lines(p) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines() if line.startswith("S3-JOB ")]


@pytest.mark.scenario
def test_s3_under_torchrun_a_restart_saves_the_quarantined_newest_step_anew_and_the_next_resumes_it(run):
    """The user's DDP script (tests/scripts/s3_ddp_job.py) under real torchrun, 2 gloo ranks, saving every 2 steps
    to s3:// up to step 8; the operator quarantines step 8. The next launch resumes step 6 (the digest the first
    printed), trains to 8 and saves it anew: certified, another attempt; the quarantined attempt's objects are
    unchanged, and `ls` names its prefix. A third launch resumes step 8 with the digest the second printed."""
    p = test_s3._torchrun(run, "--steps", "8", "--save-every", "2")
    assert p.returncode == 0, p.stderr[-4000:]
    first = {e["step"]: e for e in _job_lines(p) if e["event"] == "saved"}
    assert sorted(first) == [2, 4, 6, 8], first
    _cli(run, "quarantine", run["ledger"], "8", "--reason", "suspect node", check_rc=0)
    with Ledger.open(run["ledger"], readonly=True) as led:
        quarantined = led.checkpoint(8)
    kept = _objects(run, quarantined["path"])

    p = test_s3._torchrun(run, "--steps", "8", "--save-every", "2")
    assert p.returncode == 0, p.stderr[-4000:]
    lines = _job_lines(p)
    assert [(e["event"], e["step"]) for e in lines] == [("loaded", 6), ("saved", 8)], lines
    assert lines[0]["digest"] == first[6]["digest"] and lines[1]["state"] == "certified", lines
    assert _objects(run, quarantined["path"]) == kept
    rc, out, err = _cli(run, "ls", run["ledger"], "--json")
    listed = json.loads(out)
    assert rc == 0 and [(r["step"], r["attempt"]) for r in listed["set_aside"]] == [(8, quarantined["attempt"])]

    p = test_s3._torchrun(run, "--steps", "8", "--save-every", "2")
    assert p.returncode == 0, p.stderr[-4000:]
    assert [(e["event"], e["step"], e["digest"]) for e in _job_lines(p)] == [("loaded", 8, lines[1]["digest"])]
    assert _objects(run, quarantined["path"]) == kept


def _tree(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.scenario
def test_fast_tier_under_torchrun_a_restart_saves_the_quarantined_local_step_anew_and_the_next_resumes_it(tmp_path):
    """The fast tier's job (tests/scripts/fast_tier_job.py) under real torchrun, 2 nodes of 1 rank, each its own
    local directory: local steps 2-8, durable step 6. The operator quarantines step 8 (held by the fast tier
    alone). The next launch resumes step 6, trains to 8 and saves it locally anew; the launch after resumes local
    step 8 with the digest the second printed at its save; the first run's step-8 files stay, byte for byte, on
    both nodes through both start-ups, and `ls` names them."""
    from tests.test_one_truth_torchrun import _run

    root, dirs = tmp_path / "run", [tmp_path / f"node-disk-{i}" for i in range(2)]
    first = _run(root, dirs, 8)
    run1 = {e["run_id"] for e in first if e["event"] == "local_saved"}
    assert len(run1) == 1, first
    (run1_id,) = run1
    quarantined = [d / run1_id / "step-00000008" for d in dirs]
    kept = [_tree(f) for f in quarantined]
    assert all(kept), kept
    run_cli("quarantine", root, "8", "--reason", "suspect node", check_rc=0)

    second = _run(root, dirs, 8)
    loads = {e["rank"]: e for e in second if e["event"] == "loaded"}
    printed6 = {e["rank"]: e["digest"] for e in first if e["event"] == "saved" and e["step"] == 6}
    assert {r: (e["step"], e["digest"]) for r, e in loads.items()} == {r: (6, printed6[r]) for r in range(2)}
    saved8 = {e["rank"]: e["digest"] for e in second if e["event"] == "local_saved" and e["step"] == 8}
    assert sorted(saved8) == [0, 1], second

    third = _run(root, dirs, 8)
    loads = {e["rank"]: (e["step"], e["tier"], e["digest"]) for e in third if e["event"] == "loaded"}
    assert loads == {r: (8, "local", saved8[r]) for r in range(2)}, third
    assert [_tree(f) for f in quarantined] == kept
    rc, out, err = run_cli("ls", root, "--json")
    listed = json.loads(out)
    assert rc == 0 and [(r["step"], r["dir"]) for r in listed["set_aside"]] == [(8, f"{run1_id}/step-00000008")]
