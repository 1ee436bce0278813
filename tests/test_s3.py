"""Checkpoints on S3, end to end against a real S3-compatible HTTP server started here (moto's standalone
server), with 2 gloo ranks: save, certify, resume (the s3:// URI), load (exact, by the job's own digest), async
saves and a failed async upload, export, FSDP2 with resharding on load, a writer SIGKILLed mid-upload, a
corrupted object, retention. `make test` installs s3fs and moto (the Makefile's integration extras): they are
imported unconditionally, so a broken install fails here instead of skipping."""

from __future__ import annotations

import json
import os
import uuid

import moto.server as moto_server
import pytest
import s3fs

from scout_ckpt.format import layout
from scout_ckpt.ledger import Ledger
from scout_ckpt.save.object_store_io import reader_for
from scout_ckpt.testing.launch import run_ranks
from tests import workers_s3 as w
from tests.conftest import ledger_write_lock, run_cli

BUCKET = "scout-test"
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def endpoint():
    os.environ.update(CREDS)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    ep = f"http://{host}:{port}"
    fs = _fs(ep)
    # moto's backend is process-wide: a module that reuses this fixture (test_one_truth) starts a second server on
    # the same state, where the bucket already exists
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    yield ep
    server.stop()


def _fs(ep):
    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": ep}, use_listings_cache=False, skip_instance_cache=True)


@pytest.fixture
def run(endpoint, tmp_path):
    """A fresh prefix on the bucket and a local ledger_dir."""
    prefix = f"{BUCKET}/run-{uuid.uuid4().hex[:8]}"
    return {
        "uri": f"s3://{prefix}",
        "prefix": prefix,
        "ledger": str(tmp_path / "ledger"),
        "ep": endpoint,
        "fs": _fs(endpoint),
    }


def _cli(run, *args, check_rc=None):
    env = {**CREDS, "AWS_ENDPOINT_URL": run["ep"]}
    return run_cli(*args, env=env, check_rc=check_rc)


def _attempts(run) -> dict[str, set[str]]:
    """{attempt prefix (or plain folder): {object names}} under the run's prefix; the journal's copy
    (scout-journal/, object_store/bucket_journal.py) is not a checkpoint and is left out."""
    out: dict[str, set[str]] = {}
    for path in run["fs"].find(run["prefix"]):
        head, _, tail = path[len(run["prefix"]) + 1 :].partition("/")
        if head != "scout-journal":
            out.setdefault(head, set()).add(tail)
    return out


def _uploads(run) -> list[dict]:
    bucket, _, prefix = run["prefix"].partition("/")
    return run["fs"].call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/").get("Uploads") or []


def _save(run, steps, **kw):
    out = run_ranks(w.save_steps, 2, run["uri"], run["ledger"], run["ep"], steps, timeout=240, env=CREDS, **kw)
    return out[0].result


def _load(run, **kw):
    out = run_ranks(w.load_latest, 2, run["uri"], run["ledger"], run["ep"], timeout=240, env=CREDS, **kw)
    assert out[0].result == out[1].result  # replicated state: both ranks loaded the same step and bytes
    return out[0].result


@pytest.mark.parametrize(
    "width",
    [
        pytest.param(16, marks=(pytest.mark.scenario, pytest.mark.scenario_ci)),  # CI tier
        pytest.param(1280, marks=pytest.mark.scenario),
    ],
    ids=["small", "multipart"],
)
def test_save_certify_resume_load_exactly_then_async_saves(run, width, capsys, monkeypatch):
    """Sync saves, the CLI on the ledger_dir, then a restart that loads exactly and goes on with
    async_save=True as a user would write it: saves at 6 and 8 with training in between (the next optimizer step
    runs while the upload is in flight), and rank 1's upload of step 10 raises once its first part has been sent.
    Step 10 commits nothing (no manifest, rank 1's multipart upload aborted, the error raised by the job's
    wait()); the next restart loads step 8 with exactly the digest the job computed when it saved 8, and
    `export --latest-clean` writes step 8's weights. Every load and the export are judged by the job's own
    sha256 of the state it saved.

    `multipart` (make scenarios): 6.5 MB per matrix and per AdamW moment, so a rank's file spans more than one
    5 MiB part and the failing upload has sent a part before it raises. `small`: every file is one buffered
    request, and the failure comes before it is sent (the abort of a part already sent is also tested
    in-process, test_manifest_is_a_conditional_create_and_an_error_mid_upload_commits_nothing)."""
    saved = _save(run, [2, 4], width=width)
    assert saved["verdicts"] == {2: "certified", 4: "certified"}
    attempts = _attempts(run)
    assert sorted(layout.parse_attempt_dir(a)[0] for a in attempts) == [2, 4]
    for names in attempts.values():  # every attempt: its manifest, .metadata and one file per rank, nothing else
        assert names == {layout.MANIFEST_NAME, ".metadata", "__0_0.distcp", "__1_0.distcp"}, names
    with open(os.path.join(run["ledger"], "scout-storage.json")) as f:
        assert json.loads(f.read())["uri"] == run["uri"]

    rc, out, err = _cli(run, "certify", run["ledger"], "--json")
    assert rc == 0, err
    assert all(r["state"] == "certified" for r in json.loads(out)["results"])
    rc, out, err = _cli(run, "resume", run["ledger"], "--latest-clean")
    assert rc == 0, err
    assert out.strip().startswith(run["uri"] + "/step-00000004.attempt-"), out
    rc, out, _ = _cli(run, "ls", run["ledger"], "--json")
    assert [(r["step"], r["state"]) for r in json.loads(out)["checkpoints"]] == [(2, "certified"), (4, "certified")]
    rc, _, err = _cli(run, "resume", "s3://" + run["prefix"], "--latest-clean")
    assert rc == 2 and "ledger_dir" in err and "Traceback" not in err

    # The restart: loads 4 exactly, then async saves 6, 8 and a failing 10 (its upload raises on rank 1).
    out = run_ranks(
        w.save_steps,
        2,
        run["uri"],
        run["ledger"],
        run["ep"],
        [6, 8, 10],
        width=width,
        resume=True,
        async_save=True,
        fail=(10, 1),
        timeout=240,
        env=CREDS,
    )
    assert out[0].result["loaded"] == out[1].result["loaded"] == {"step": 4, "digest": saved["saved"][4]}
    again = out[0].result
    assert set(again["verdicts"].values()) == {None}  # async: save() returns at once
    assert out[1].result["failed"] == [10]
    # The injected error fires inside torch.save's zip writer, which loses it (and then reports "unexpected
    # pos"): every rank's error names the upload's own error.
    for o in out:
        assert list(o.result["errors"]) == [10], o.result
        assert "injected upload failure at step 10 on rank 1" in o.result["errors"][10], o.result["errors"]
    # The failed save is settled when it fails (the coordinator's commit thread), not at the next start.
    with Ledger.open(run["ledger"], readonly=True) as led:
        states = {r["step"]: r["state"] for r in led.checkpoints()}
        st10 = led.checkpoint(10)
    assert states == {2: "certified", 4: "certified", 6: "certified", 8: "certified", 10: "rejected"}, states
    assert st10["reasons"][0]["code"] == "commit_failed", st10
    assert "injected upload failure at step 10 on rank 1" in st10["reasons"][0]["detail"], st10
    committed = [a for a, names in _attempts(run).items() if layout.MANIFEST_NAME in names]
    assert sorted(layout.parse_attempt_dir(a)[0] for a in committed) == [2, 4, 6, 8]
    for a, names in _attempts(run).items():
        if layout.parse_attempt_dir(a)[0] == 10:
            assert "__1_0.distcp" not in names, names  # no truncated object of the failed upload
    assert _uploads(run) == []  # rank 1's (multipart) upload was aborted

    loaded = _load(run, width=width)
    assert loaded["step"] == 8 and loaded["digest"] == again["saved"][8], (loaded, again["saved"])
    with Ledger.open(run["ledger"], readonly=True) as led:
        st10 = led.checkpoint(10)
    assert st10["state"] == "rejected" and st10["reasons"][0]["code"] == "commit_failed", st10
    assert sorted(layout.parse_attempt_dir(a)[0] for a in _attempts(run)) == [2, 4, 6, 8]

    # export from the S3 run: the weights of step 8 exactly as the job held them when it saved (its own sha256).
    # In process (the CLI is store_for + this call; a subprocess would cost seconds of imports): the store is
    # the one the ledger_dir is bound to, credentials from the environment as for the CLI.
    from safetensors.torch import load_file

    from scout_ckpt.ops.export import export

    dest = os.path.join(os.path.dirname(run["ledger"]), "export")
    os.mkdir(dest)
    res = export(run["ledger"], None, f"{dest}/m.safetensors")
    assert res["step"] == 8 and res["source"].startswith(run["uri"] + "/step-00000008.attempt-"), res
    assert w.digest(load_file(f"{dest}/m.safetensors")) == again["models"][8]
    assert os.listdir(dest) == ["m.safetensors"]  # the verified local copy it read from is gone

    # the rebuild through cli.main in this process (a subprocess's imports cost seconds of `make test`; the
    # torchrun scenario runs it as a real command), `resume` as a real command
    monkeypatch.setenv("AWS_ENDPOINT_URL", run["ep"])
    name = _lose_ledger_dir_and_rebuild(run, lambda *args: _main(capsys, *args))
    assert _digest_at(_store(run), name, width) == again["saved"][6]  # the job's own sha256 when it saved step 6


def _lose_ledger_dir_and_rebuild(run, rebuild_cli=None) -> str:
    """The node holding the ledger_dir died: it is gone, binding, ledger and journal. Step 8 (the newest) is made
    uncertified first: one interior byte of one object changes, same size. `ledger rebuild LEDGER_DIR --uri`
    brings back what the bucket proves: 2, 4 and 6 certified (re-verified by ranged reads, and a certified verdict
    for that exact manifest in the journal's copy on the bucket), 8 rejected (digest_mismatch). Then `resume
    --latest-clean` (the real command line) returns an attempt of step 6; its name is returned, for the caller to
    judge by the job's own digest. `rebuild_cli(*args)` -> (rc, out, err): how the rebuild is run (default:
    the real command line in a subprocess)."""
    import shutil

    from scout_ckpt.ledger import journal
    from scout_ckpt.object_store import bucket_journal

    store = _store(run)
    # journal.append copied every record to the store as the job ran (bucket_journal.mirror): nothing else
    # brings them there before the ledger_dir is lost.
    assert len(bucket_journal.read(store)) >= len(journal.read(run["ledger"])) > 0
    (a8,) = store.committed()[8]
    key = f"{run['prefix']}/{a8}/__0_0.distcp"
    data = bytearray(run["fs"].cat_file(key))
    data[len(data) // 2] ^= 0x04
    run["fs"].pipe_file(key, bytes(data))
    shutil.rmtree(run["ledger"])
    before = _attempts(run)

    rc, out, err = (rebuild_cli or (lambda *a: _cli(run, *a)))(
        "ledger", "rebuild", run["ledger"], "--uri", run["uri"], "--json"
    )
    assert rc == 0, err
    doc = json.loads(out)
    rows = {r["step"]: r for r in doc["checkpoints"]}
    assert {s: r["state"] for s, r in rows.items()} == {
        2: "certified",
        4: "certified",
        6: "certified",
        8: "rejected",
    }, doc
    assert any(r["code"] == "digest_mismatch" and r["file"] == "__0_0.distcp" for r in rows[8]["reasons"]), rows[8]
    assert doc["uri"] == run["uri"] and doc["old_ledger"] == "no old ledger" and doc["journal"]["local"] == 0
    with open(os.path.join(run["ledger"], "scout-storage.json")) as f:
        assert json.loads(f.read())["uri"] == run["uri"]  # bound again: every command takes the ledger_dir
    assert _attempts(run) == before  # nothing on the bucket written or removed

    rc, out, err = _cli(run, "resume", run["ledger"], "--latest-clean")
    assert rc == 0, err
    path = out.strip()
    name = path[len(run["uri"]) + 1 :]
    assert path.startswith(run["uri"] + "/") and name in store.committed()[6], path
    assert "newer step 8 is rejected" in err and "digest_mismatch" in err, err
    return name


def _digest_at(store, name: str, width: int) -> str:
    """The job's oracle (workers_s3.digest) of the state stored under one attempt prefix, loaded in this process
    through the verified reader (the `.metadata` digest from the attempt's manifest)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    m, _ = store.read_manifest(name)
    (meta,) = [f["digest"] for f in m["files"] if f["path"] == layout.DCP_METADATA]
    model = w.make_model(seed=7, width=width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.zeros(1, model[0].in_features)).sum().backward()
    opt.step()  # AdamW's moments exist, with values unlike the checkpoint's
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader_for(store, name, meta))
    return w.digest(state)


@pytest.mark.scenario
def test_corrupted_object_is_rejected_and_walked_back(run):
    saved = _save(run, [2, 4, 6])
    assert set(saved["verdicts"].values()) == {"certified"}
    (a6,) = [a for a in _attempts(run) if layout.parse_attempt_dir(a)[0] == 6]
    key = f"{run['prefix']}/{a6}/__1_0.distcp"
    data = bytearray(run["fs"].cat_file(key))
    data[len(data) // 2] ^= 0x01  # one interior byte, same size
    run["fs"].pipe_file(key, bytes(data))

    dest = os.path.join(os.path.dirname(run["ledger"]), "export")  # export reads verified bytes only
    os.mkdir(dest)
    rc, out, err = _cli(run, "export", run["ledger"], "--step", "6", "--out", f"{dest}/m.safetensors")
    assert rc == 1 and "__1_0.distcp" in err and "digest_mismatch" in err and err.count("\n") == 1, (out, err)
    assert os.listdir(dest) == []

    loaded = _load(run)  # the job's own walk-back: ranged reads find step 6 changed, step 4 loads exactly
    assert loaded["step"] == 4 and loaded["digest"] == saved["saved"][4]
    rc, out, err = _cli(run, "resume", run["ledger"], "--latest-clean")
    assert rc == 0 and "/step-00000004.attempt-" in out, (out, err)
    assert "newer step 6 is rejected" in err and "digest_mismatch" in err
    rc, out, err = _cli(run, "certify", run["ledger"], "--json")
    assert rc == 1
    states = {r["step"]: r["state"] for r in json.loads(out)["results"]}
    assert states == {2: "certified", 4: "certified", 6: "rejected"}
    with Ledger.open(run["ledger"], readonly=True) as led:
        reasons = led.checkpoint(6)["reasons"]
    assert any(r["code"] == "digest_mismatch" and r["file"] == "__1_0.distcp" for r in reasons), reasons


@pytest.mark.scenario
def test_corrupted_object_found_by_certify_first(run):
    saved = _save(run, [2, 4])
    (a4,) = [a for a in _attempts(run) if layout.parse_attempt_dir(a)[0] == 4]
    key = f"{run['prefix']}/{a4}/__0_0.distcp"
    data = bytearray(run["fs"].cat_file(key))
    data[len(data) // 3] ^= 0x80
    run["fs"].pipe_file(key, bytes(data))
    rc, out, err = _cli(run, "certify", run["ledger"])
    assert rc == 1 and "step 4: rejected" in out and "digest_mismatch" in out, (out, err)
    rc, out, _ = _cli(run, "resume", run["ledger"], "--latest-clean")
    assert rc == 0 and "/step-00000002.attempt-" in out
    assert _load(run)["digest"] == saved["saved"][2]


@pytest.mark.scenario
def test_retention_deletes_objects_only_after_the_ledger_records_it(run):
    saved = _save(run, [1, 2, 3, 4], keep=2)
    assert set(saved["verdicts"].values()) == {"certified"}
    with Ledger.open(run["ledger"], readonly=True) as led:
        states = {r["step"]: r["state"] for r in led.checkpoints()}
        history = {s: [h["state"] for h in led.certifications(s)] for s in (1, 2)}
    assert states == {1: "deleted", 2: "deleted", 3: "certified", 4: "certified"}
    assert all(h[-1] == "deleted" for h in history.values()), history
    assert sorted(layout.parse_attempt_dir(a)[0] for a in _attempts(run)) == [3, 4]

    # gc with the ledger locked by another writer: the deletion intent cannot be recorded, so nothing is deleted.
    before = _attempts(run)
    with ledger_write_lock(os.path.join(run["ledger"], layout.LEDGER_NAME), 60):
        rc, _, err = _cli(run, "gc", run["ledger"], "--keep", "1")
    assert rc == 2 and "locked" in err, err
    assert _attempts(run) == before
    rc, out, err = _cli(run, "gc", run["ledger"], "--keep", "1", "--json")
    assert rc == 0, err
    assert json.loads(out)["delete"] == [3]
    assert sorted(layout.parse_attempt_dir(a)[0] for a in _attempts(run)) == [4]
    assert _load(run)["digest"] == saved["saved"][4]


@pytest.mark.scenario
@pytest.mark.scenario_ci  # the CI tier's S3 fault
def test_writer_killed_mid_upload_is_never_listed_and_its_upload_is_aborted(run):
    """Rank 1 SIGKILLs itself once the first part of its step-4 file has been uploaded (the file spans several
    5 MiB parts): a multipart upload is left open, no manifest. The restarted job aborts it, removes the dead
    attempt's objects, resumes from step 2 exactly and saves again."""
    width = 2048  # 16 MiB per weight and per AdamW moment: every rank's file spans several 5 MiB parts
    saved = _save(run, [2], width=width)
    out = run_ranks(
        w.save_steps,
        2,
        run["uri"],
        run["ledger"],
        run["ep"],
        [4],
        width=width,
        kill=(4, 1),
        timeout_s=20,
        timeout=240,
        env=CREDS,
        allow_failures=True,
    )
    assert out[1].exitcode == -9
    uploads = _uploads(run)
    assert uploads and all(".attempt-" in u["Key"] and "/step-00000004." in u["Key"] for u in uploads), uploads
    committed = [a for a, names in _attempts(run).items() if layout.MANIFEST_NAME in names]
    assert [layout.parse_attempt_dir(a)[0] for a in committed] == [2]
    rc, out_, _ = _cli(run, "resume", run["ledger"], "--latest-clean")
    assert rc == 0 and "/step-00000002.attempt-" in out_

    res = run_ranks(
        w.load_latest, 2, run["uri"], run["ledger"], run["ep"], width=width, then_save=6, timeout=240, env=CREDS
    )[0].result
    assert res["step"] == 2 and res["digest"] == saved["saved"][2] and res["verdict"] == "certified"
    assert _uploads(run) == []
    with Ledger.open(run["ledger"], readonly=True) as led:
        st4 = led.checkpoint(4)
        deletes = [e["detail"] for e in led.events(("object_delete",))]
    assert st4["state"] == "rejected" and st4["reasons"][0]["code"] == "save_interrupted"
    assert {d["what"] for d in deletes} == {"abort_multipart_upload", "delete_prefix"}
    assert sorted(layout.parse_attempt_dir(a)[0] for a in _attempts(run)) == [2, 6]


@pytest.mark.scenario
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_fsdp2_saves_certifies_and_loads_back_exactly_and_resharded(run, async_save):
    """FSDP2 (fully_shard at its defaults, 2 gloo ranks on CPU) through the Checkpointer to S3, sync and async:
    saves at 2 and 4 certified, `certify` agrees, and restarts on 2, 1 and 3 ranks (DCP resharding through the
    verified reader; 3 ranks shard 16 rows unevenly) load step 4 with exactly the sha256 the saving job computed of its full state (gathered to rank 0:
    cpu_offload leaves the other ranks' full state empty)."""
    saved = run_ranks(
        w.fsdp_save, 2, run["uri"], run["ledger"], run["ep"], async_save=async_save, timeout=300, env=CREDS
    )[0].result
    assert saved["mode"] == "fsdp", saved
    assert saved["verdicts"] == ({2: None, 4: None} if async_save else {2: "certified", 4: "certified"}), saved
    with Ledger.open(run["ledger"], readonly=True) as led:
        assert {r["step"]: r["state"] for r in led.checkpoints()} == {2: "certified", 4: "certified"}
    rc, out, err = _cli(run, "certify", run["ledger"], "--json")
    assert rc == 0 and {r["state"] for r in json.loads(out)["results"]} == {"certified"}, (out, err)
    for world in (2, 1, 3):
        got = run_ranks(w.fsdp_load, world, run["uri"], run["ledger"], run["ep"], timeout=300, env=CREDS)
        assert got[0].result == {"step": 4, "digest": saved["saved"][4]}, (world, got[0].result)


# ---- a user's DDP script under real torchrun ------------------------------------------------------------------


def _torchrun(run, *job_args: str, timeout: float = 600):
    """`torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/scripts/s3_ddp_job.py URI LEDGER_DIR`
    against this module's moto server; returns the CompletedProcess."""
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {
        **os.environ,
        **CREDS,
        "PYTHONPATH": str(REPO),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.5",
        str(REPO / "tests" / "scripts" / "s3_ddp_job.py"),
        run["uri"],
        run["ledger"],
        "--endpoint",
        run["ep"],
        *job_args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.scenario
def test_torchrun_job_killed_mid_save_resumes_exactly_from_s3(run):
    """The user's DDP script (tests/scripts/s3_ddp_job.py) under real torchrun, 2 gloo ranks, saving every 2
    steps to s3://; rank 1 is SIGKILLed in the middle of the save of step 6 (its file written, not yet sent;
    rank 0's may be on the store already, with no manifest). torchrun restarts both workers once: the job loads step 4 with exactly the digest it printed when it saved step 4, saves 6 and 8 again, and
    `ls --json` on the ledger_dir shows 2, 4, 6, 8 certified; the dead attempt's objects and upload are gone."""
    p = _torchrun(run, "--steps", "8", "--save-every", "2", "--kill-rank", "1", "--kill-step", "6", "--kill-at", "save")
    assert p.returncode == 0, p.stderr[-4000:]
    lines = [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines() if line.startswith("S3-JOB ")]
    loads = [e for e in lines if e["event"] == "loaded"]
    assert [(e["restart"], e["step"]) for e in loads] == [(0, 0), (1, 4)], lines
    first = {e["step"]: e for e in lines if e["event"] == "saved" and e["run_id"] == loads[0]["run_id"]}
    second = {e["step"]: e for e in lines if e["event"] == "saved" and e["run_id"] == loads[1]["run_id"]}
    assert sorted(first) == [2, 4] and sorted(second) == [6, 8], lines
    assert loads[1]["digest"] == first[4]["digest"]  # the job's own oracle: exactly the state it saved
    assert all(e["state"] == "certified" for e in [*first.values(), *second.values()]), lines

    rc, out, err = _cli(run, "ls", run["ledger"], "--json")
    assert rc == 0, err
    rows = json.loads(out)["checkpoints"]
    assert [(r["step"], r["state"]) for r in rows] == [(s, "certified") for s in (2, 4, 6, 8)], rows
    with Ledger.open(run["ledger"], readonly=True) as led:
        history6 = [(h["state"], [r["code"] for r in h["reasons"]]) for h in led.certifications(6)]
        latest = led.latest()
    assert ("rejected", ["save_interrupted"]) in history6, history6  # the killed attempt, kept in the history
    assert sorted(layout.parse_attempt_dir(a)[0] for a in _attempts(run)) == [2, 4, 6, 8]
    assert _uploads(run) == []
    rc, out, err = _cli(run, "resume", run["ledger"], "--latest-clean")
    assert rc == 0 and out.strip() == f"{run['uri']}/{latest['path']}", (out, err)

    # The node holding the ledger_dir dies and step 8 is damaged: rebuilt from the bucket, the next launch of the
    # same job loads step 6 with exactly the digest it printed when it saved step 6, and saves 8 again.
    name = _lose_ledger_dir_and_rebuild(run)
    p = _torchrun(run, "--steps", "8", "--save-every", "2")
    assert p.returncode == 0, p.stderr[-4000:]
    lines = [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines() if line.startswith("S3-JOB ")]
    loads = [e for e in lines if e["event"] == "loaded"]
    assert [(e["step"], e["digest"]) for e in loads] == [(6, second[6]["digest"])], lines
    assert [(e["step"], e["state"]) for e in lines if e["event"] == "saved"] == [(8, "certified")], lines
    with Ledger.open(run["ledger"], readonly=True) as led:
        assert led.checkpoint(6)["path"] == name


# ---- in-process: the store's pieces against the same server, no ranks (cheap) -----------------------------------


def _store(run):
    from scout_ckpt.object_store import open_store

    return open_store(run["uri"], w.options(run["ep"]))


def test_manifest_is_a_conditional_create_and_an_error_mid_upload_commits_nothing(run):
    import xxhash

    from scout_ckpt.errors import ManifestExists
    from scout_ckpt.save.object_store_io import _ObjectFileSystem

    store = _store(run)
    name = layout.attempt_dirname(1, "a")
    store.publish_manifest(name, b"{}")
    with pytest.raises(ManifestExists):
        store.publish_manifest(name, b'{"other": 1}')
    assert store.read_bytes(name, layout.MANIFEST_NAME) == b"{}"

    fs = _ObjectFileSystem(store.fs, None)
    for size in (1000, 6 << 20):  # a buffered small file; a file already sent in part (a multipart upload)
        path = store.key(name, f"__{size}_0.distcp")
        with pytest.raises(RuntimeError):
            with fs.create_stream(path, "wb") as s:
                s.write(os.urandom(size))
                raise RuntimeError("injected")
        assert not run["fs"].exists(path)  # plain FsspecWriter committed a truncated object here
    # An upload error inside torch.save's zip writer (DCP writes tensors with torch.save): the writer loses it
    # and fails with "unexpected pos"; create_stream raises the upload's own error, and commits nothing.
    import torch

    def fail():
        raise ConnectionError("injected: the store went away mid-upload")

    failing = _ObjectFileSystem(store.fs, fail)
    path = store.key(name, "__9_0.distcp")
    with pytest.raises(ConnectionError, match="went away mid-upload"):
        with failing.create_stream(path, "wb") as s:
            torch.save(torch.zeros(2 << 20), s)  # 8 MiB: the hook fires once the first 5 MiB part is sent
    assert not run["fs"].exists(path)
    assert _uploads(run) == []
    data = os.urandom(7 << 20)
    path = store.key(name, "__0_0.distcp")
    with fs.create_stream(path, "wb") as s:
        s.write(data[:3]), s.write(data[3:])
    assert fs.digests["__0_0.distcp"] == (len(data), f"xxh3_128:{xxhash.xxh3_128_hexdigest(data)}")
    assert run["fs"].cat_file(path) == data


def test_verification_by_ranged_reads_finds_every_kind_of_damage(run, tmp_path):
    from scout_ckpt.format.digests import bytes_digest

    store = _store(run)
    name = layout.attempt_dirname(3, "v")
    blobs = {"__0_0.distcp": os.urandom(19 << 20), "__1_0.distcp": os.urandom(5), ".metadata": b"m" * 10}
    for rel, data in blobs.items():
        run["fs"].pipe_file(store.key(name, rel), data)
    files = [{"path": rel, "size": len(d), "digest": bytes_digest(d)} for rel, d in blobs.items()]
    assert store.verify(name, files)["status"] == "pass"
    assert store.fetch(name, files, tmp_path / "copy") == []  # export's local copy: the same bytes, verified
    assert {rel: (tmp_path / "copy" / rel).read_bytes() for rel in blobs} == blobs

    bad = bytearray(blobs["__0_0.distcp"])
    bad[(9 << 20) + 7] ^= 0x10  # inside the second 8 MiB range
    run["fs"].pipe_file(store.key(name, "__0_0.distcp"), bytes(bad))
    assert [(r["code"], r["file"]) for r in store.fetch(name, files, tmp_path / "copy2")] == [
        ("digest_mismatch", "__0_0.distcp")
    ]
    run["fs"].pipe_file(store.key(name, "__1_0.distcp"), b"abc")
    run["fs"].pipe_file(store.key(name, "stray"), b"x")
    run["fs"].rm_file(store.key(name, ".metadata"))
    ev = store.verify(name, files)
    codes = sorted((r["code"], r.get("file")) for r in ev["reasons"])
    assert codes == [
        ("digest_mismatch", "__0_0.distcp"),
        ("missing_file", ".metadata"),
        ("truncated_file", "__1_0.distcp"),
        ("unexpected_file", "stray"),
    ], codes
    assert store.verify(layout.attempt_dirname(4, "none"), files)["reasons"][0]["code"] == "missing_dir"


def test_sweep_removes_dead_attempts_only_after_recording_them(run, tmp_path):
    from scout_ckpt.object_store.attempts import sweep
    from scout_ckpt.ops.settle import this_process_owner

    store = _store(run)
    names = {k: layout.attempt_dirname(*k) for k in [(1, "ok"), (2, "live"), (3, "dead"), (3, "old"), (9, "x")]}
    for (step, att), name in names.items():
        run["fs"].pipe_file(store.key(name, "__0_0.distcp"), b"data")
    for key in [(1, "ok"), (3, "old")]:
        run["fs"].pipe_file(store.key(names[key], layout.MANIFEST_NAME), b"{}")
    bucket, _, prefix = run["prefix"].partition("/")
    for key in [(2, "live"), (3, "dead")]:  # an open multipart upload in each
        run["fs"].call_s3("create_multipart_upload", Bucket=bucket, Key=f"{prefix}/{names[key]}/__1_0.distcp")
    with Ledger.open(tmp_path, create=True) as led:
        led.record_writing(1, "r", "ok", names[(1, "ok")])
        led.record_commit(
            1,
            run_id="r",
            path=names[(1, "ok")],
            nbytes=4,
            manifest_digest="d",
            files=[],
            evidence={},
            state="certified",
            reasons=[],
            attempt="ok",
        )
        led.record_writing(2, "r", "live", names[(2, "live")], owner=this_process_owner())
        led.record_writing(3, "r", "old", names[(3, "old")])
        led.record_writing(3, "r", "dead", names[(3, "dead")])  # a re-save of step 3, then it died
        led.transition(3, "rejected", [{"code": "save_interrupted"}], source="startup", expect="writing")
        out = sweep(led, store, source="gc")
        events = [e["detail"] for e in led.events(("object_delete",))]
    assert sorted((r["attempt"], r["why"]) for r in out["removed"]) == [
        (names[(3, "dead")], "interrupted"),
        (names[(3, "old")], "superseded"),
    ]
    assert [a["attempt"] for a in out["aborted"]] == [names[(3, "dead")]]
    assert {d.get("prefix") or d.get("key") for d in events} == {
        names[(3, "dead")],
        names[(3, "old")],
        f"{prefix}/{names[(3, 'dead')]}/__1_0.distcp",
    }
    assert sorted(_attempts(run)) == sorted([names[(1, "ok")], names[(2, "live")], names[(9, "x")]])
    assert [u["Key"].split("/")[1] for u in _uploads(run)] == [names[(2, "live")]]


# ---- ledger rebuild on an S3 run: bad input, and the journal's copy on the store (in-process, cheap) ------------


def _main(capsys, *args) -> tuple[int, str, str]:
    """The command line's own entry point (cli.main) in this process: (exit code, stdout, stderr)."""
    from scout_ckpt.cli import main

    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def _tree(path) -> dict:
    """{relative path: bytes} of every file under `path` ({} if it does not exist): "nothing modified"."""
    out = {}
    for dirpath, _, names in os.walk(path):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, path)] = f.read()
    return out


def test_rebuild_refuses_bad_input_with_one_line_and_modifies_nothing(run, tmp_path, capsys, monkeypatch):
    """`ledger rebuild`: wrong prefix, empty bucket, a foreign prefix (plain DCP folders; attempts that never
    committed), a --uri that contradicts the ledger_dir's binding, a ROOT holding a POSIX run, a --uri that is not
    s3://, no --uri for a lost binding (and `adopt`: a prefix with nothing to adopt, another URI); then (real subprocesses, their own environment) no credentials and no endpoint:
    exit 2, one line on stderr, no traceback, neither the ledger_dir nor the bucket changed."""
    from scout_ckpt import object_store

    monkeypatch.setenv("AWS_ENDPOINT_URL", run["ep"])
    fs = run["fs"]
    fs.mkdir("scout-empty")
    foreign = f"{BUCKET}/foreign-{uuid.uuid4().hex[:6]}"
    fs.pipe({f"{foreign}/step-4/.metadata": b"m", f"{foreign}/step-4/__0_0.distcp": b"d"})
    dead = f"{BUCKET}/dead-{uuid.uuid4().hex[:6]}"
    fs.pipe_file(f"{dead}/{layout.attempt_dirname(2, 'x')}/__0_0.distcp", b"d")  # no manifest: never committed
    bound = tmp_path / "bound"
    bound.mkdir()
    object_store.bind(bound, run["uri"], {})
    posix = tmp_path / "posix"
    (posix / layout.step_dirname(2)).mkdir(parents=True)
    lost = tmp_path / "lost"
    cases = {
        "wrong prefix": ((lost, "--uri", f"s3://{BUCKET}/no-such-run"), "nothing under this prefix"),
        "empty bucket": ((lost, "--uri", "s3://scout-empty"), "nothing under this prefix"),
        "no bucket": ((lost, "--uri", "s3://scout-no-such-bucket/p"), "nothing under this prefix"),
        "foreign prefix": ((lost, "--uri", f"s3://{foreign}"), "a foreign prefix: it holds step-4"),
        "never committed": ((lost, "--uri", f"s3://{dead}"), "attempts that never committed"),
        "another uri": ((bound, "--uri", f"s3://{BUCKET}/other"), f"belongs to {run['uri']}"),
        "posix run": ((posix, "--uri", run["uri"]), "a POSIX run"),
        "not s3": ((lost, "--uri", "/data/ckpt"), "not an object-store URI"),
        "mangled root": (("s3:/" + run["prefix"],), "give the run's ledger_dir as ROOT"),
        "lost binding": ((lost,), "no such directory"),
        "adopt: wrong prefix": (("--adopt", lost, "--uri", f"s3://{BUCKET}/no-such-run"), "no plain DCP step-N/"),
        "adopt: another uri": (("--adopt", bound, "--uri", f"s3://{foreign}"), f"belongs to {run['uri']}"),
    }
    before = {p: _tree(p) for p in (bound, posix)}
    bucket = sorted(fs.find(BUCKET))
    for name, (args, words) in cases.items():
        cmd = ["adopt", *args[1:]] if args[0] == "--adopt" else ["ledger", "rebuild", *args]
        rc, out, err = _main(capsys, *cmd, "--json")
        assert rc == 2 and words in err and err.count("\n") == 1 and out == "", (name, rc, out, err)
    assert not lost.exists() and {p: _tree(p) for p in before} == before and sorted(fs.find(BUCKET)) == bucket


@pytest.mark.scenario
def test_rebuild_without_credentials_or_endpoint_is_bad_input(run, tmp_path):
    """The real command in its own environment: no credentials at all; no endpoint (AWS's own is asked, one
    attempt instead of botocore's retries): exit 2, one line naming the store's error and where the requests
    went, no traceback, nothing created, the bucket unchanged."""
    import subprocess

    from tests.cli_pool import run_cases
    from tests.conftest import CLI, REPO

    lost = tmp_path / "lost"
    bucket = sorted(run["fs"].find(BUCKET))
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    base.update(
        PYTHONPATH=str(REPO),
        AWS_EC2_METADATA_DISABLED="true",
        AWS_MAX_ATTEMPTS="1",
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_CONFIG_FILE=str(tmp_path / "none"),
    )
    envs = {
        "no credentials": ({**base, "AWS_ENDPOINT_URL": run["ep"]}, "NoCredentialsError"),
        "no endpoint": ({**base, **CREDS}, "no endpoint set"),
    }

    def case(env, words):
        def go():
            p = subprocess.run(
                [*CLI, "ledger", "rebuild", str(lost), "--uri", run["uri"]],
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
                check=False,
            )
            assert p.returncode == 2 and "cannot list" in p.stderr and words in p.stderr, (p.returncode, p.stderr)
            assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr and p.stdout == "", p.stderr

        return go

    run_cases({name: case(*v) for name, v in envs.items()})
    assert not lost.exists() and sorted(run["fs"].find(BUCKET)) == bucket


def test_journal_copy_on_the_store(run, tmp_path):
    """bucket_journal: one object per record, never overwritten, read back in name order; merged with the local
    journal each record once, the local file's order first and never re-sorted by the records' clocks; not an attempt prefix (listing and sweep ignore it); a record that is not one is
    skipped. `mirror` writes only for a ledger_dir bound to a store."""
    from scout_ckpt import object_store
    from scout_ckpt.object_store import bucket_journal

    store = _store(run)
    recs = [
        {"kind": "verdict", "step": s, "state": "certified", "time": 1000.0 + s, "manifest_digest": f"d{s}"}
        for s in (3, 1, 2)
    ]
    keys = [bucket_journal.append(store, r) for r in recs]
    assert len(set(keys)) == 3 and all(k.startswith(f"{run['prefix']}/scout-journal/") for k in keys)
    run["fs"].pipe_file(f"{run['prefix']}/scout-journal/00000000000000000001-torn.json", b'{"kind": "verd')
    assert bucket_journal.read(store) == sorted(recs, key=lambda r: r["time"])
    assert store.attempts() == {} and store.committed() == {}
    local = [recs[0], {"kind": "quarantine", "step": 2, "reason": "x", "time": 1001.5}]
    merged = bucket_journal.merge(local, bucket_journal.read(store))
    assert [(r["kind"], r["step"]) for r in merged] == [
        ("verdict", 3),
        ("quarantine", 2),
        ("verdict", 1),
        ("verdict", 2),
    ]
    assert bucket_journal.mirror(tmp_path, recs[0]) is None  # a POSIX root: nothing copied
    object_store.bind(tmp_path, run["uri"], w.options(run["ep"]))
    assert bucket_journal.mirror(tmp_path, {**recs[0], "time": 2000.0}).startswith(f"{run['prefix']}/scout-journal/")
    assert len(bucket_journal.read(store)) == 4


def test_adopt_plain_dcp_save_folders_on_s3(run, tmp_path, capsys, monkeypatch):
    """A user's plain `dcp.save` to S3 (no scout-ckpt, fsspec with the endpoint, one process): folders step-2/ and
    step-4/, step 4 with a NaN weight. `adopt LEDGER_DIR --uri`: step 2 certified, step 4 rejected (the `finite`
    invariant), each copied into a fresh attempt prefix committed by its manifest; the plain folders are left as
    they were. `resume --latest-clean` returns step 2's attempt, whose objects hold exactly
    the state the job hashed when it saved (loaded from that URI). Adopting again skips both (exit 0). Then the
    ledger_dir is lost and rebuilt from the bucket alone."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # what a user of dcp + S3 writes with

    monkeypatch.setenv("AWS_ENDPOINT_URL", run["ep"])
    saved = {}
    for step in (2, 4):
        model = w.make_model(seed=step)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.ones(2, 16)).sum().backward()
        opt.step()
        if step == 4:
            with torch.no_grad():
                model[0].weight[1, 2] = float("nan")
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        saved[step] = w.digest(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(
                state,
                storage_writer=FsspecWriter(f"{run['uri']}/step-{step}", client_kwargs={"endpoint_url": run["ep"]}),
            )
    plain = {h: names for h, names in _attempts(run).items()}
    assert sorted(plain) == ["step-2", "step-4"]

    ledger = tmp_path / "ledger"
    rc, out, err = _main(capsys, "adopt", ledger, "--uri", run["uri"], "--json")
    assert rc == 1 and "1 adopted step(s) not certified; first: step 4 is rejected" in err, (out, err)
    doc = json.loads(out)
    assert [(a["step"], a["state"], a["from"]) for a in doc["adopted"]] == [
        (2, "certified", "step-2"),
        (4, "rejected", "step-4"),
    ], doc
    assert doc["adopted"][1]["reasons"][0]["code"] == "invariant_failed"
    store = _store(run)
    committed = store.committed()
    assert sorted(committed) == [2, 4]
    now = _attempts(run)
    for step, (name,) in committed.items():
        assert name == doc["adopted"][[2, 4].index(step)]["path"]
        assert now[name] == plain[f"step-{step}"] | {layout.MANIFEST_NAME}, now[name]
        assert store.read_manifest(name)[0]["adopted"] is True
    assert {h: now[h] for h in plain} == plain  # the plain folders: untouched
    with open(ledger / "scout-storage.json") as f:
        assert json.loads(f.read())["uri"] == run["uri"]

    rc, out, err = _main(capsys, "resume", ledger, "--latest-clean")
    assert rc == 0 and out.strip() == f"{run['uri']}/{committed[2][0]}", (out, err)
    assert "newer step 4 is rejected" in err
    assert _digest_at(store, committed[2][0], 16) == saved[2]

    rc, out, err = _main(capsys, "adopt", ledger, "--json")
    assert rc == 0 and json.loads(out)["adopted"] == [], (out, err)
    assert [(s["step"], s["reason"]) for s in json.loads(out)["skipped"]] == [(2, "has_manifest"), (4, "has_manifest")]
    assert _attempts(run) == now

    # adopt copies its verdicts to the store itself (bucket_journal): with the ledger_dir lost, `ledger rebuild
    # --uri` certifies step 2 again from the bucket alone, and step 4 stays rejected.
    import shutil

    shutil.rmtree(ledger)
    rc, out, err = _main(capsys, "ledger", "rebuild", ledger, "--uri", run["uri"], "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert [(r["step"], r["state"]) for r in doc["checkpoints"]] == [(2, "certified"), (4, "rejected")], doc
    assert doc["journal"]["local"] == 0 and doc["journal"]["merged"] == 2 and doc["journal"]["store"] >= 2
    rc, out, err = _main(capsys, "resume", ledger, "--latest-clean")
    assert rc == 0 and out.strip() == f"{run['uri']}/{committed[2][0]}", (out, err)


def test_a_rejection_from_a_host_an_hour_slow_outlives_the_certification_after_a_rebuild(run, capsys, monkeypatch):
    """#25 item 4. Steps 2 and 4 certified by a real 2-rank job. A later generation's coordinator, whose clock
    is an hour slow, finds step 4's loaded values wrong (the loader's own rejection, journaled and copied to the
    bucket under a name that embeds its clock, so it sorts before the original certification). The ledger_dir is
    then lost with its node: `ledger rebuild --uri` must keep 4 rejected and `resume` must give 2, judged by the
    job's own digest of what it saved at 2."""
    import shutil
    import time as time_mod

    from scout_ckpt import object_store
    from scout_ckpt.object_store import bucket_journal
    from scout_ckpt.save.loading import LatestCleanLoader

    saved = _save(run, [2, 4])
    store = _store(run)
    object_store.remember(run["ledger"], store)  # journal.append copies each record there, as a job's does
    real = time_mod.time
    monkeypatch.setattr(time_mod, "time", lambda: real() - 3600.0)
    with Ledger.open(run["ledger"]) as led:
        loader = LatestCleanLoader(run["ledger"], 0, 1, None, led, led.run()["id"], True, lambda point, s: None)
        loader._reject_load_mismatch({"step": 4}, ["model.0.weight"])
    monkeypatch.setattr(time_mod, "time", real)
    verdicts = [(r["step"], r["state"]) for r in bucket_journal.read(store) if r["kind"] == "verdict"]
    assert verdicts.index((4, "rejected")) < verdicts.index((4, "certified")), verdicts  # the clock's order
    shutil.rmtree(run["ledger"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", run["ep"])
    rc, out, err = _main(capsys, "ledger", "rebuild", run["ledger"], "--uri", run["uri"], "--json")
    assert rc == 0, err
    rows = {r["step"]: r for r in json.loads(out)["checkpoints"]}
    assert {s: r["state"] for s, r in rows.items()} == {2: "certified", 4: "rejected"}, rows
    assert rows[4]["reasons"][0]["code"] == "load_mismatch", rows[4]
    rc, out, err = _main(capsys, "resume", run["ledger"], "--latest-clean", "--json")
    assert rc == 0, err
    name = json.loads(out)["path"][len(run["uri"]) + 1 :]
    assert _digest_at(store, name, 16) == saved["saved"][2]
