"""The real Hugging Face Trainer under real torchrun (2 CPU/gloo ranks, DDP) with ScoutTrainerCallback:
a healthy run certifies every checkpoint, a flipped bit in the newest model.safetensors sends the resume one folder
back and the resumed run finishes, a rank killed mid-save resumes from the newest certified folder with the loss
curve of the uninterrupted run. The script is examples/integrations/hf_trainer.py (tiny GPT-2 from a config)."""

import json
import os
import shutil
import subprocess
import sys

# `make test` installs transformers and accelerate (the Makefile's integration extras): imported unconditionally,
# so that a broken install fails here instead of skipping the integration's tests.
import accelerate  # noqa: F401
import pytest
import transformers  # noqa: F401

from scout_ckpt.integrations.transformers import latest_clean
from scout_ckpt.ledger import Ledger
from tests.conftest import REPO, run_cli
from tests.torchrun_errors import why_failed

pytestmark = pytest.mark.slow
SCRIPT = REPO / "examples" / "integrations" / "hf_trainer.py"
STEPS, EVERY, LIMIT = 8, 2, 3


def torchrun(out, *extra, restarts=0, cwd=None, ranks=2, limit=LIMIT):
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.5",
        str(SCRIPT),
        str(out),
        "--steps",
        str(STEPS),
        "--save-every",
        str(EVERY),
        *(["--limit", str(limit)] if limit else []),
        *map(str, extra),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=cwd or out.parent)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def losses(path, attempt=None) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if attempt is None or r["attempt"] == attempt}


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    out = base / "out"
    torchrun(out, "--losses", base / "losses.jsonl")
    return out, losses(base / "losses.jsonl")


def test_healthy_run_certifies_every_checkpoint_and_takes_retention_over(healthy):
    out, _ = healthy
    with Ledger.open(out, readonly=True) as led:
        states = {r["step"]: r["state"] for r in led.checkpoints()}
        history = {s: [h["state"] for h in led.certifications(s)] for s in states}
        ev = led.evidence(STEPS)
        files = led.files(STEPS)
        run = led.runs()[-1]
    # save_total_limit=3 taken over: the oldest went after the 4th save, by the callback, after certification
    assert states == {2: "deleted", 4: "certified", 6: "certified", 8: "certified"}
    assert all("certified" in h for h in history.values()), history
    assert sorted(p.name for p in out.iterdir() if p.is_dir() and p.name not in (".leases", "reports")) == [
        "checkpoint-4",
        "checkpoint-6",
        "checkpoint-8",
    ]
    # replay is on by default with replicas: every target of the GPT-2 and its optimizer replayed at each save
    assert run["policy"]["require"] == ["bytes", "invariants", "consensus", "replay"] and run["world_size"] == 2
    assert ev["replay"]["status"] == "pass", ev["replay"]
    assert {t for t, _ in run["policy"]["replay_targets"]} == {"embedding", "block", "head", "optimizer"}
    assert ev["consensus"]["status"] == "pass" and ev["consensus"]["groups"][0]["members"] == [0, 1]
    assert ev["consensus"]["tensors_compared"] > 50  # model, optimizer moments, scheduler, step
    assert ev["invariants"]["status"] == "pass"
    names = {f["path"] for f in files}
    assert {
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "trainer_state.json",
        "rng_state_0.pth",
        "rng_state_1.pth",
    } <= names
    assert {f["rank"] for f in files} == {0, 1}  # the digests were split across the ranks
    m = json.loads((out / "checkpoint-8" / "scout-manifest.json").read_text())
    assert m["verdict"]["state"] == "certified" and m["layout"] == "hf-trainer"
    assert latest_clean(out) == str((out / "checkpoint-8").resolve())


def test_cli_reads_a_trainer_output_dir(healthy, tmp_path):
    out, _ = healthy
    rc, so, _ = run_cli("ls", out, "--json")
    rows = {r["step"]: r for r in json.loads(so)["checkpoints"]}
    assert rc == 0 and rows[8]["path"] == "checkpoint-8" and rows[8]["evidence"]["consensus"] == "pass"
    rc, so, _ = run_cli("explain", out, 8, "--json")
    assert rc == 0 and json.loads(so)["evidence"]["bytes"]["status"] == "pass"
    rc, so, _ = run_cli("report", out, "--json")
    assert rc == 0 and json.loads(so)["events"] == []
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    run_cli("quarantine", copy, 8, "--reason", "operator test", check_rc=0)
    assert latest_clean(copy) == str((copy / "checkpoint-6").resolve())


def test_cli_resume_and_certify_on_a_trainer_output_dir(healthy, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(healthy[0], copy)
    rc, so, se = run_cli("resume", copy, "--latest-clean")
    assert (rc, so.strip()) == (0, str((copy / "checkpoint-8").resolve())), se
    rc, so, se = run_cli("certify", copy, "--json")
    assert rc == 0 and json.loads(so)["certified"], so + se


def test_cli_gc_export_and_rebuild_on_a_trainer_output_dir(healthy, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(healthy[0], copy)
    rc, so, se = run_cli("gc", copy, "--keep", "1", "--json")
    assert rc == 0 and json.loads(so)["delete"] == [4, 6], so + se
    rc, so, se = run_cli("export", copy, "--latest-clean", "--out", tmp_path / "w.safetensors", "--json")
    assert rc == 0 and json.loads(so)["step"] == 8, so + se
    rc, so, se = run_cli("ledger", "rebuild", copy, "--json")
    assert rc == 0 and [r["state"] for r in json.loads(so)["checkpoints"]] == ["certified"], so + se


@pytest.mark.scenario
def test_bit_flip_in_newest_model_resumes_from_previous_and_finishes(healthy, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(healthy[0], out)
    f = out / "checkpoint-8" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x04
    f.write_bytes(bytes(data))
    assert latest_clean(out) == str((out / "checkpoint-6").resolve())
    with Ledger.open(out, readonly=True) as led:
        row = led.checkpoint(8)
    assert row["state"] == "rejected" and row["reasons"][0]["code"] == "digest_mismatch"
    assert row["reasons"][0]["file"] == "model.safetensors"
    p = torchrun(out, "--losses", tmp_path / "losses.jsonl")
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {
        "resumed_from": str((out / "checkpoint-6").resolve()),
        "global_step": STEPS,
        "observer_attached": "counted",
    }
    after = losses(tmp_path / "losses.jsonl")
    assert sorted(after) == [7, 8]
    assert after == pytest.approx({s: healthy[1][s] for s in after}, rel=1e-6, abs=0)
    with Ledger.open(out, readonly=True) as led:
        assert led.checkpoint(8)["state"] == "certified"  # the re-save is a new attempt; the old one's history kept
        verdicts = [h["state"] for h in led.certifications(8) if h["state"] != "writing"]  # not attempt starts
        assert verdicts[-2:] == ["rejected", "certified"]


@pytest.mark.scenario
def test_a_quarantined_newest_folder_is_passed_over_by_the_trainers_own_resume(healthy, tmp_path):
    """#39 item 2 for the Trainer: `resume_from_checkpoint=True` loads transformers' get_last_checkpoint (the
    highest checkpoint-N). After `scout-ckpt quarantine` of the newest step, that choice is the newest certified
    folder (transformers' own function is the oracle), the quarantined bytes are kept and still found by the
    ledger, and the Trainer's own resume loads step 6: its first loss is the uninterrupted run's loss at step 7."""
    from transformers.trainer_utils import get_last_checkpoint

    out = tmp_path / "out"
    shutil.copytree(healthy[0], out)
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-8")
    rc, _, err = run_cli("quarantine", out, 8, "--reason", "operator test")
    assert rc == 0, err
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-6")
    with Ledger.open(out, readonly=True) as led:
        row = led.checkpoint(8)
    assert row["state"] == "quarantined" and row["path"] != "checkpoint-8"
    assert (out / row["path"] / "model.safetensors").is_file()  # nothing deleted: the ledger's row follows it
    assert f"moved to {row['path']}" in err
    rc, so, _ = run_cli("explain", out, 8, "--json")
    assert json.loads(so)["state"] == "quarantined"
    rc, so, _ = run_cli("ls", out, "--json")
    assert {r["step"]: r["path"] for r in json.loads(so)["checkpoints"]}[8] == row["path"]
    lf = tmp_path / "losses.jsonl"
    p = torchrun(out, "--losses", lf, "--trainer-resume", "--steps", STEPS - 1)
    assert json.loads(p.stdout.strip().splitlines()[-1])["resumed_from"] == str(out / "checkpoint-6")
    after = losses(lf)
    assert sorted(after) == [7]
    assert after == pytest.approx({7: healthy[1][7]}, rel=1e-6, abs=0)


def test_a_lost_ledger_resumes_from_the_newest_certified_folder_and_is_rebuilt(healthy, tmp_path):
    """#25 item 8 for the Trainer: scout-ledger.db deleted between runs. latest_clean answers from the manifests
    and the journal (not None, which would retrain from step 0 and overwrite checkpoint-N), the callback's start
    rebuilds the ledger, and the resumed run's losses are the uninterrupted run's."""
    out = tmp_path / "out"
    shutil.copytree(healthy[0], out)
    for name in ("scout-ledger.db", "scout-ledger.db-wal", "scout-ledger.db-shm"):
        if (out / name).exists():
            (out / name).unlink()
    assert latest_clean(out) == str((out / "checkpoint-8").resolve())
    p = torchrun(out, "--losses", tmp_path / "losses.jsonl", "--steps", STEPS + 2)
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {
        "resumed_from": str((out / "checkpoint-8").resolve()),
        "global_step": STEPS + 2,
        "observer_attached": "counted",
    }
    assert "ledger rebuilt" in p.stderr, why_failed(p.stderr)
    with Ledger.open(out, readonly=True) as led:
        states = {r["step"]: r["state"] for r in led.checkpoints()}
    assert states == {4: "deleted", 6: "certified", 8: "certified", 10: "certified"}, states  # limit 3
    assert sorted(losses(tmp_path / "losses.jsonl")) == [9, 10]


@pytest.mark.scenario
@pytest.mark.scenario_ci  # the CI tier's Hugging Face Trainer kill
def test_rank_killed_mid_save_resumes_from_newest_certified_with_the_same_losses(healthy, tmp_path):
    out = tmp_path / "out"
    lf = tmp_path / "losses.jsonl"
    # rank 1 dies in on_save of step 6: the Trainer wrote checkpoint-6 (its own resume would take it), scout-ckpt
    # had not certified it; torchrun restarts both ranks
    p = torchrun(out, "--losses", lf, "--kill-rank", 1, "--kill-step", 6, restarts=1)
    assert json.loads(p.stdout.strip().splitlines()[-1])["resumed_from"] == str((out / "checkpoint-4").resolve())
    with Ledger.open(out, readonly=True) as led:
        hist6 = [h for h in led.certifications(6) if h["state"] != "writing"]  # verdicts, not attempt starts
        assert led.checkpoint(6)["state"] == "certified" and led.checkpoint(8)["state"] == "certified"
    assert hist6[0]["state"] == "rejected" and hist6[0]["reasons"][0]["code"] == "save_interrupted"
    resumed = losses(lf, attempt=1)
    assert sorted(resumed) == [5, 6, 7, 8]
    # the same curve as the uninterrupted run (observed bitwise equal here; DDP's bucket rebuild may change the
    # summation order of the first step after a restart, docs/pytorch-facts.md, hence a relative tolerance)
    assert resumed == pytest.approx({s: healthy[1][s] for s in resumed}, rel=1e-6, abs=0)
    assert losses(lf, attempt=0) == pytest.approx({s: healthy[1][s] for s in losses(lf, attempt=0)}, rel=1e-6)


def test_a_resume_from_an_uncertified_folder_says_how_to_switch(tmp_path, caplog):
    """resume_from_checkpoint=True takes the newest checkpoint-N folder: when that one is not certified, the
    callback says so and how to switch (in the log and as a ledger event). In-process, no Trainer run."""
    import logging

    from scout_ckpt.integrations.transformers import ScoutTrainerCallback

    with Ledger.open(tmp_path, create=True) as led:
        led.begin_run("r1", world_size=1, topology={}, policy={"require": ["bytes"]})
        led.record_writing(8, "r1", "r1-1", "checkpoint-8")  # a save that never finished
        cb = ScoutTrainerCallback()
        with caplog.at_level(logging.WARNING, logger="scout_ckpt.transformers"):
            cb._check_resume(led, 0, "r2")  # a fresh start: nothing to say
            assert caplog.text == ""
            cb._check_resume(led, 8, "r2")  # Trainer state says it resumed at step 8
            cb._check_resume(led, 12, "r2")  # a folder the ledger never saw
        events = [e for e in led.events() if e["kind"] == "uncertified_resume"]
    text = caplog.text
    assert "resumed from checkpoint-8, which is writing" in text and "unknown to the ledger" in text
    assert "trainer.train(resume_from_checkpoint=latest_clean(args.output_dir))" in text
    assert "from scout_ckpt.integrations.transformers import latest_clean" in text
    assert f"scout-ckpt resume {tmp_path} --latest-clean" in text
    assert [e["step"] for e in events] == [8, 12]


def _sdc_run(tmp_path, ranks: int):
    """The example with rank 1's transformer.h.1 computing wrongly from step 3 (every call), no option changed:
    (its final JSON line, {step: (state, reasons)} from the ledger)."""
    out = tmp_path / "out"
    p = torchrun(out, "--sdc-rank", 1, "--sdc-step", 3, "--no-resume", ranks=ranks, limit=None)
    final = json.loads(p.stdout.strip().splitlines()[-1])
    with Ledger.open(out, readonly=True) as led:
        rows = {r["step"]: (r["state"], r["reasons"]) for r in led.checkpoints()}
    return out, final, rows


def test_an_sdc_on_one_rank_is_never_certified_with_the_defaults_2_ranks(tmp_path):
    """2 ranks: DDP averages the faulty rank's gradient into both replicas, which then agree (consensus passes);
    replay, on by default, sees the replays of transformer.h.1 disagree from the first save after the fault (two
    peers detect without naming: inconclusive), so no step >= 3 is certified and `resume --latest-clean` gives
    checkpoint-2, saved before the fault. The observer watched DDP's wrapper (the callbacks get the bare model)."""
    out, final, rows = _sdc_run(tmp_path, 2)
    assert final["observer_attached"] == "counted", final
    assert rows[2][0] == "certified"
    for step in (4, 6, 8):
        state, reasons = rows[step]
        assert state != "certified", (step, rows)
        assert any(
            r["code"] in ("replay_sdc", "replay_inconclusive") and r.get("target") == "transformer.h.1" for r in reasons
        ), (step, reasons)
    rc, so, _ = run_cli("resume", out, "--latest-clean")
    assert rc == 0 and so.strip().endswith("checkpoint-2")


@pytest.mark.scenario
def test_an_sdc_on_one_rank_is_attributed_with_the_defaults_3_ranks(tmp_path):
    """3 ranks: the same fault is attributed to rank 1 by strict majority at checkpoint-4, every later checkpoint
    is rejected, and the resume goes to checkpoint-2."""
    out, final, rows = _sdc_run(tmp_path, 3)
    assert final["observer_attached"] == "counted", final
    assert rows[2][0] == "certified"
    for step in (4, 6, 8):
        state, reasons = rows[step]
        assert state == "rejected", (step, rows)
        assert {(r.get("target"), tuple(r.get("ranks") or ())) for r in reasons if r["code"] == "replay_sdc"} == {
            ("transformer.h.1", (1,))
        }, (step, reasons)
    rc, so, _ = run_cli("resume", out, "--latest-clean")
    assert rc == 0 and so.strip().endswith("checkpoint-2")


@pytest.mark.scenario
def test_a_hung_rank_is_named_by_the_callbacks_observer_and_the_restart_finishes(tmp_path):
    """2 ranks: rank 1 blocks forever before step 5's forward (the job's own fault.json says when). The callback's
    observer watches DDP's wrapper, names rank 1 from the collective sequence (no majority with two), and with
    action "abort" ends the generation; torchrun's restart resumes from checkpoint-4 and finishes. No crash is
    blamed on the other rank."""
    out = tmp_path / "out"
    observer = json.dumps({"stall_s": 3, "action": "abort"})
    p = torchrun(out, "--hang-rank", 1, "--hang-step", 5, "--observer", observer, restarts=1, limit=None)
    final = json.loads(p.stdout.strip().splitlines()[-1])
    assert final["resumed_from"] == str((out / "checkpoint-4").resolve()) and final["global_step"] == STEPS, final
    did = json.loads((out / "fault.json").read_text())
    assert did["rank"] == 1 and did["step"] == 5
    rc, so, err = run_cli("report", out, "--json")
    assert rc == 0, err
    events = json.loads(so)["events"]
    assert [e["ranks"] for e in events if e["kind"] == "hang"] == [[1]], events
    assert not [e for e in events if e["kind"] == "crash"], events


@pytest.mark.scenario
def test_a_finished_trainer_job_exits_cleanly_every_time(tmp_path):
    """The example calls no destroy_process_group (as HF users' scripts do not): the callback releases its own
    side groups at train end, so no gloo group of scout-ckpt's is left to static destruction, where gloo aborted
    the process ("terminate called without an active exception") in about one run of four and torchrun reported
    the finished job failed. Six runs in a row, each must exit 0 with no abort on either rank."""
    for i in range(6):
        out = tmp_path / f"run{i}"
        p = torchrun(out)
        assert "terminate called" not in p.stderr, (i, why_failed(p.stderr))
        with Ledger.open(out, readonly=True) as led:
            assert {r["step"]: r["state"] for r in led.checkpoints() if r["state"] != "deleted"} == {
                s: "certified" for s in range(STEPS - (LIMIT - 1) * EVERY, STEPS + 1, EVERY)
            }
