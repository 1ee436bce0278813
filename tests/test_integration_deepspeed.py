"""Real DeepSpeed (0.19.8) under real torchrun (2 CPU/gloo ranks) with scout_ckpt.integrations.deepspeed: ZeRO-1
and ZeRO-3 training a small model with `engine.save_checkpoint`, judged by the digests the job computes itself
(tests/scripts/ds_job.py: sha256 of every rank's model and optimizer state, written when it saves and after it
loads). A healthy run certifies every tag and `latest` follows; a flipped bit in a rank's optimizer shard is walked
past; a rank SIGKILLed mid-save resumes from the newest certified tag with the state it saved and the same losses;
with the default options, ZeRO-3's partitioned state is never certified and `latest` never names its tags.

DeepSpeed is an optional extra (`pip install scout-ckpt[deepspeed]`; `make test` installs it): a missing DeepSpeed
fails these tests, never skips them."""

import json
import os
import subprocess
import sys

# `make test` installs this extra (the Makefile's integration pins): imported unconditionally, so that a
# broken install fails here instead of skipping the integration's tests.
import deepspeed  # noqa: F401,E402
import pytest

from scout_ckpt.integrations import ds_folders  # noqa: E402
from scout_ckpt.integrations.deepspeed import latest_clean  # noqa: E402
from scout_ckpt.ledger import Ledger
from tests import framework_jobs as jobs
from tests.conftest import REPO, run_cli
from tests.framework_jobs import events, flip_bit, states
from tests.torchrun_errors import why_failed

pytestmark = pytest.mark.slow
SCRIPT = REPO / "tests" / "scripts" / "ds_job.py"


def torchrun(save_dir, events, *extra, restarts=0, ok=True, nproc=2):
    return jobs.torchrun(SCRIPT, save_dir, events, *extra, restarts=restarts, ok=ok, nproc=nproc)


def _run_failing(tmp_path, save_dir, ev, *args, nproc=2) -> subprocess.CompletedProcess:
    """The job under torchrun when it is expected to end on an error: the completed process, stderr included."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += [str(SCRIPT), str(save_dir), "--events", str(ev), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)


# ---- torch-free pieces ----------------------------------------------------------------------------------------


def test_latest_is_replaced_atomically_and_moved_aside_when_nothing_is_certified(tmp_path):
    assert ds_folders.parse_folder("global_step12") == 12 and ds_folders.parse_folder("global_step") is None
    assert ds_folders.parse_folder("checkpoint-12") is None and ds_folders.folder_name(7) == "global_step7"
    (tmp_path / "latest").write_text("global_step9")  # DeepSpeed's own pointer, no ledger beside it
    assert ds_folders.repoint_latest(tmp_path) is None
    assert not (tmp_path / "latest").exists()
    assert (tmp_path / ds_folders.HIDDEN_LATEST).read_text() == "global_step9"  # kept, not deleted
    ds_folders.point_latest(tmp_path, "global_step4")
    assert (tmp_path / "latest").read_bytes() == b"global_step4"  # as DeepSpeed writes it: no newline
    assert ds_folders.read_latest(tmp_path) == "global_step4"


# ---- ZeRO-1: healthy run, CLI, a corrupted shard walked past (default tier: one torchrun) -------------------


@pytest.fixture(scope="module")
def zero1(tmp_path_factory):
    base = tmp_path_factory.mktemp("ds1")
    save_dir, ev = base / "ck", base / "events.jsonl"
    torchrun(
        save_dir,
        ev,
        "--stage",
        1,
        "--steps",
        6,
        "--save-every",
        2,
        "--accept-single-owner",
        "--export",
        base / "export",
    )
    return save_dir, ev


def test_zero1_healthy_run_certifies_every_tag_and_latest_follows(zero1):
    save_dir, ev = zero1
    saved = events(ev, "saved")
    assert [(r["step"], r["verdict"], r["latest"]) for r in saved] == [
        (2, "certified", "global_step2"),
        (4, "certified", "global_step4"),
        (6, "certified", "global_step6"),
    ]
    assert states(save_dir) == {2: "certified", 4: "certified", 6: "certified"}
    with Ledger.open(save_dir, readonly=True) as led:
        e6, files, run = led.evidence(6), led.files(6), led.runs()[-1]
    # replay on by default (ZeRO-1, 2 ranks): required, not_applicable only for a job that never steps
    assert run["policy"]["require"] == ["bytes", "invariants", "consensus", "zero_partitions", "replay"]
    assert run["policy"]["zero_stage"] == 1 and run["policy"]["allow_not_applicable"] == ["zero_partitions", "replay"]
    assert e6["replay"]["status"] == "pass"
    # every file of the tag digested by the rank that wrote it: rank 0 the model states and its optimizer shard
    assert {f["path"]: f["rank"] for f in files} == {
        "mp_rank_00_model_states.pt": 0,
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": 0,
        "zero_pp_rank_1_mp_rank_00_optim_states.pt": 1,
    }
    assert e6["consensus"]["status"] == "pass" and e6["consensus"]["groups"][0]["members"] == [0, 1]
    assert e6["consensus"]["tensors_compared"] >= 4  # the model's 4 tensors, replicated at ZeRO-1
    assert e6["invariants"]["status"] == "pass"
    assert e6["zero_partitions"]["status"] == "not_applicable" and e6["zero_partitions"]["accepted"] is True
    assert e6["zero_partitions"]["reasons"][0]["code"] == "zero_single_owner"
    m = json.loads((save_dir / "global_step6" / "scout-manifest.json").read_text())
    assert m["verdict"]["state"] == "certified" and m["layout"] == "deepspeed" and m["tag"] == "global_step6"
    assert (save_dir / "latest").read_text() == "global_step6" and latest_clean(save_dir) == "global_step6"
    # save_16bit_model (create/save/commit with tag global_step6, into another directory) passed through: the
    # export is written, the certified tag of the same step untouched
    assert (save_dir.parent / "export" / "pytorch_model.bin").is_file()
    assert sorted(p.name for p in (save_dir / "global_step6").iterdir()) == [
        "mp_rank_00_model_states.pt",
        "scout-manifest.json",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]


def test_zero1_cli_reads_a_deepspeed_save_dir_and_walks_past_a_corrupted_shard(zero1, tmp_path):
    import shutil

    save_dir = tmp_path / "ck"
    shutil.copytree(zero1[0], save_dir)
    rc, so, se = run_cli("ls", save_dir, "--json")
    rows = {r["step"]: r for r in json.loads(so)["checkpoints"]}
    assert rc == 0 and rows[6]["path"] == "global_step6" and rows[6]["state"] == "certified", so + se
    rc, so, se = run_cli("certify", save_dir, "--json")
    assert rc == 0, so + se
    flip_bit(save_dir / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    rc, so, se = run_cli("resume", save_dir, "--latest-clean", "--json")
    assert rc == 0 and json.loads(so)["step"] == 4 and json.loads(so)["path"].endswith("global_step4"), so + se
    with Ledger.open(save_dir, readonly=True) as led:
        row = led.checkpoint(6)
    assert row["state"] == "rejected" and row["reasons"][0]["code"] == "digest_mismatch"
    assert row["reasons"][0]["file"] == "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert latest_clean(save_dir) == "global_step4"
    # the command that rejected the tag moved `latest` at once (DeepSpeed's own loader and zero_to_fp32.py read it)
    assert (save_dir / "latest").read_text() == "global_step4"
    assert "latest now names global_step4" in se, se
    # so does an operator's quarantine, and a certify that finds nothing newer leaves it where it is
    rc, so, se = run_cli("quarantine", save_dir, 4, "--reason", "suspect host")
    assert rc == 0 and (save_dir / "latest").read_text() == "global_step2", so + se
    rc, so, se = run_cli("certify", save_dir, "--json")
    assert (save_dir / "latest").read_text() == "global_step2" and "latest" not in se, so + se
    # with nothing certified left, `latest` is moved aside (kept), so that load_checkpoint starts fresh
    rc, so, se = run_cli("quarantine", save_dir, 2, "--reason", "suspect host")
    assert rc == 0 and not (save_dir / "latest").exists(), so + se
    assert (save_dir / ds_folders.HIDDEN_LATEST).read_text() == "global_step2"


@pytest.mark.scenario
def test_zero1_a_quarantined_tag_is_saved_anew_by_a_run_resumed_before_it(zero1, tmp_path):
    """#39: the operator quarantines global_step6; the restarted run resumes from step 4 (DeepSpeed's own
    `latest`, moved by the quarantine), trains to step 6 again and saves tag global_step6: the new lineage's save
    succeeds and is certified, the quarantined bytes are kept beside it with their verdict in the ledger's history,
    and the next restart resumes from the new step 6. Judged by the jobs' own state digests."""
    import shutil

    save_dir = tmp_path / "ck"
    shutil.copytree(zero1[0], save_dir)
    first = {r["step"]: r["digest"] for r in events(zero1[1], "saved")}
    rc, _, se = run_cli("quarantine", save_dir, 6, "--reason", "suspect host")
    assert rc == 0 and (save_dir / "latest").read_text() == "global_step4", se
    ev = tmp_path / "events.jsonl"
    torchrun(save_dir, ev, "--stage", 1, "--steps", 6, "--save-every", 2, "--accept-single-owner")
    assert [(r["step"], r["digest"]) for r in events(ev, "resumed")] == [(4, first[4])]
    saved = events(ev, "saved")
    assert [(r["step"], r["verdict"], r["latest"]) for r in saved] == [(6, "certified", "global_step6")]
    assert saved[0]["digest"] == first[6]  # the same training from step 4: the same state (an exact resume)
    with Ledger.open(save_dir, readonly=True) as led:
        row, history = led.checkpoint(6), led.certifications(6, all_outcomes=True)
        kept = [e for e in led.events() if e["kind"] == "quarantine_set_aside"]
    assert row["state"] == "certified" and row["path"] == "global_step6"
    assert "quarantined" in [h["state"] for h in history]  # the operator's verdict stays in the step's history
    aside = kept[0]["detail"]["path"]
    assert aside.startswith("global_step6.scout-quarantined-")
    assert (save_dir / aside / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()  # the quarantined bytes kept
    ev2 = tmp_path / "events2.jsonl"
    torchrun(save_dir, ev2, "--stage", 1, "--steps", 8, "--save-every", 2, "--accept-single-owner")
    assert [(r["step"], r["digest"]) for r in events(ev2, "resumed")] == [(6, saved[0]["digest"])]
    assert [(r["step"], r["verdict"]) for r in events(ev2, "saved")] == [(8, "certified")]


# ---- ZeRO-1: a rank killed mid-save, resumed exactly (the CI tier's DeepSpeed kill) -------------------------


def _zero1_killed_mid_save(tmp_path, nproc):
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    # rank 1 SIGKILLs itself after writing its optimizer shard of step 4; torchrun restarts every rank
    torchrun(
        save_dir,
        ev,
        "--stage",
        1,
        "--steps",
        6,
        "--save-every",
        2,
        "--accept-single-owner",
        "--crash-at",
        4,
        restarts=1,
        nproc=nproc,
    )
    first = {r["step"]: r for r in events(ev, "saved", attempt=0)}
    assert list(first) == [2] and first[2]["latest"] == "global_step2"
    resumed = events(ev, "resumed", attempt=1)
    assert [(r["step"], r["digest"]) for r in resumed] == [(2, first[2]["digest"])]  # the state it saved, exactly
    loss0 = {r["step"]: r["loss"] for r in events(ev, "step", attempt=0)}
    loss1 = {r["step"]: r["loss"] for r in events(ev, "step", attempt=1)}
    assert sorted(loss1) == [3, 4, 5, 6] and all(loss1[s] == loss0[s] for s in (3, 4))  # bitwise the same curve
    with Ledger.open(save_dir, readonly=True) as led:
        hist4 = [h for h in led.certifications(4) if h["state"] != "writing"]
    assert hist4[0]["state"] == "rejected" and hist4[0]["reasons"][0]["code"] == "save_interrupted"
    assert states(save_dir) == {2: "certified", 4: "certified", 6: "certified"}
    assert (save_dir / "latest").read_text() == "global_step6"


@pytest.mark.scenario
@pytest.mark.scenario_ci  # the CI tier's DeepSpeed kill
def test_zero1_rank_killed_mid_save_resumes_exactly_from_newest_certified(tmp_path):
    _zero1_killed_mid_save(tmp_path, 2)


@pytest.mark.scenario
def test_zero1_on_three_ranks_killed_mid_save_resumes_exactly_from_newest_certified(tmp_path):
    _zero1_killed_mid_save(tmp_path, 3)


# ---- ZeRO-3 ---------------------------------------------------------------------------------------------------


@pytest.mark.scenario
def test_zero3_default_options_never_certify_partitions_and_latest_never_names_them(tmp_path):
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    torchrun(save_dir, ev, "--stage", 3, "--steps", 4, "--save-every", 2)
    assert [(r["step"], r["verdict"], r["latest"]) for r in events(ev, "saved")] == [
        (2, "committed", None),
        (4, "committed", None),
    ]
    with Ledger.open(save_dir, readonly=True) as led:
        row, e4, files = led.checkpoint(4), led.evidence(4), led.files(4)
    # what is certified at ZeRO-3: the bytes (each rank's own files) and the finite check; what is not: the
    # partitioned parameters and optimizer state, named in the reason
    assert e4["bytes"]["status"] == "pass" and e4["invariants"]["status"] == "pass"
    assert {f["path"]: f["rank"] for f in files} == {
        f"zero_pp_rank_{r}_mp_rank_00_{k}_states.pt": r for r in (0, 1) for k in ("model", "optim")
    }
    codes = [r["code"] for r in row["reasons"]]
    assert codes == ["zero_single_owner"] and row["reasons"][0]["stage"] == 3
    assert any(s.startswith("module: parameters") for s in row["reasons"][0]["state"])
    assert not (save_dir / "latest").exists() and latest_clean(save_dir) is None
    rc, so, _ = run_cli("resume", save_dir, "--latest-clean", "--json")
    assert rc == 1 and json.loads(so)["step"] is None

    # the job restarted with the same options: it refuses to train from step 0 over the saved tags, and names
    # them and the option; nothing is written
    def names():  # SQLite's -wal/-shm sidecars come and go with the readers' connections: not data
        return sorted(p.name for p in save_dir.iterdir() if not p.name.endswith(("-wal", "-shm")))

    before = names()
    p = torchrun(save_dir, ev, "--stage", 3, "--steps", 4, "--save-every", 2, ok=False)
    assert "does not start from step 0 over them" in p.stderr and "global_step4" in p.stderr, why_failed(p.stderr)
    assert "accept_single_owner=True" in p.stderr
    assert names() == before and states(save_dir) == {2: "committed", 4: "committed"}
    # the refusal is one line from rank 0, not a traceback per rank
    assert p.stderr.count("scout-ckpt: StartRefused: ") == 1, p.stderr[-3000:]
    assert "raise StartRefused" not in p.stderr, p.stderr[-3000:]
    # plain `explain` says what --json holds: why the tag is not certified, and which state no replica vouches for
    rc, so, se = run_cli("explain", save_dir, 4)
    assert rc == 1 and "ZeRO stage 3 partitions this state" in so and "module: parameters" in so, so + se
    # the advice followed: the same job with accept_single_owner=True re-judges the saved tags under its own
    # policy and resumes from the newest with the state it saved (the job's own digest)
    ev2 = tmp_path / "events2.jsonl"
    torchrun(save_dir, ev2, "--stage", 3, "--steps", 6, "--save-every", 2, "--accept-single-owner", "--no-close")
    # a job that never called close() left no SQLite sidecars in the save_dir: the ledger was closed at exit
    assert not [p.name for p in save_dir.iterdir() if p.name.endswith(("-wal", "-shm"))]
    saved4 = events(ev, "saved")[-1]
    assert [(r["step"], r["digest"]) for r in events(ev2, "resumed")] == [(4, saved4["digest"])]
    assert [(r["step"], r["verdict"]) for r in events(ev2, "saved")] == [(6, "certified")]
    assert states(save_dir) == {2: "certified", 4: "certified", 6: "certified"}
    with Ledger.open(save_dir, readonly=True) as led:
        hist4, e4, last_run = (
            [h for h in led.certifications(4) if h["state"] != "writing"],
            led.evidence(4),
            led.runs()[-1],
        )
    assert [(h["state"], h["source"]) for h in hist4] == [("committed", "save"), ("certified", "rejudge")]
    assert e4["zero_partitions"]["status"] == "not_applicable" and e4["zero_partitions"]["was"] == "missing"
    assert e4["zero_partitions"]["rejudged_by"] == last_run["id"] and last_run["policy"]["accept_single_owner"]
    assert (save_dir / "latest").read_text() == "global_step6"


@pytest.mark.scenario
def test_zero3_killed_resumed_exactly_then_a_corrupted_shard_walked_past_on_restart(tmp_path):
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    torchrun(
        save_dir,
        ev,
        "--stage",
        3,
        "--steps",
        6,
        "--save-every",
        2,
        "--accept-single-owner",
        "--crash-at",
        4,
        restarts=1,
    )
    saved = {(r["attempt"], r["step"]): r for r in events(ev, "saved")}
    assert sorted(saved) == [(0, 2), (1, 4), (1, 6)]
    assert [(r["step"], r["digest"]) for r in events(ev, "resumed")] == [(2, saved[0, 2]["digest"])]
    assert states(save_dir) == {2: "certified", 4: "certified", 6: "certified"}
    # a flipped bit in rank 1's parameter partition of the newest tag: the next start walks past it
    flip_bit(save_dir / "global_step6" / "zero_pp_rank_1_mp_rank_00_model_states.pt")
    ev2 = tmp_path / "events2.jsonl"
    torchrun(save_dir, ev2, "--stage", 3, "--steps", 8, "--save-every", 2, "--accept-single-owner")
    assert [(r["step"], r["digest"]) for r in events(ev2, "resumed")] == [(4, saved[1, 4]["digest"])]
    loss1 = {r["step"]: r["loss"] for r in events(ev, "step", attempt=1)}
    loss2 = {r["step"]: r["loss"] for r in events(ev2, "step")}
    assert sorted(loss2) == [5, 6, 7, 8] and all(loss2[s] == loss1[s] for s in (5, 6))
    with Ledger.open(save_dir, readonly=True) as led:
        verdicts6 = [h for h in led.certifications(6) if h["state"] != "writing"]
    assert [h["state"] for h in verdicts6][-2:] == ["rejected", "certified"]  # rejected, then re-saved
    assert any(r["code"] == "digest_mismatch" for r in verdicts6[-2]["reasons"])
    assert states(save_dir) == {2: "certified", 4: "certified", 6: "certified", 8: "certified"}
    assert (save_dir / "latest").read_text() == "global_step8"


# ---- ZeRO-0: everything replicated; ZeRO-1: replicas that disagree ------------------------------------------


@pytest.mark.scenario
def test_zero0_default_options_compare_model_and_optimizer_and_certify(tmp_path):
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    torchrun(save_dir, ev, "--stage", 0, "--steps", 4, "--save-every", 2)
    assert [(r["step"], r["verdict"], r["latest"]) for r in events(ev, "saved")] == [
        (2, "certified", "global_step2"),
        (4, "certified", "global_step4"),
    ]
    with Ledger.open(save_dir, readonly=True) as led:
        e4, files = led.evidence(4), led.files(4)
    assert [f["path"] for f in files] == ["mp_rank_00_model_states.pt"]
    assert e4["consensus"]["status"] == "pass" and e4["zero_partitions"]["status"] == "pass"
    assert e4["consensus"]["tensors_compared"] >= 4 + 8  # the model's 4 tensors and Adam's 2 moments of each


@pytest.mark.scenario
def test_zero1_replicas_that_disagree_reject_the_tag_and_end_the_generation(tmp_path):
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    p = _run_failing(
        tmp_path,
        save_dir,
        ev,
        *"--stage 1 --steps 4 --save-every 2 --accept-single-owner --diverge-at 4".split(),
        nproc="2",
    )
    assert p.returncode != 0 and "LiveStateCorrupt" in p.stderr, why_failed(p.stderr)
    assert [(r["step"], r["verdict"]) for r in events(ev, "live_fault")] == [(4, "rejected")]
    assert "consensus_inconclusive" in events(ev, "live_fault")[0]["codes"]  # two replicas detect, never attribute
    assert states(save_dir) == {2: "certified", 4: "rejected"}
    assert (save_dir / "latest").read_text() == "global_step2"


@pytest.mark.scenario
def test_zero1_nan_in_a_single_owner_partition_is_caught_by_its_writer(tmp_path):
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    p = _run_failing(
        tmp_path,
        save_dir,
        ev,
        *"--stage 1 --steps 4 --save-every 2 --accept-single-owner --nan-at 4".split(),
        nproc="2",
    )
    assert p.returncode != 0 and "LiveStateCorrupt" in p.stderr, why_failed(p.stderr)
    assert [(r["step"], r["codes"]) for r in events(ev, "live_fault")] == [(4, ["invariant_failed"])]
    with Ledger.open(save_dir, readonly=True) as led:
        row, e4 = led.checkpoint(4), led.evidence(4)
    assert row["state"] == "rejected" and e4["consensus"]["status"] == "pass"  # no replica holds the moments
    bad = row["reasons"][0]
    assert bad["code"] == "invariant_failed" and bad["ranks"] == [1]
    assert bad["tensors"] == [
        "zero_pp_rank_1_mp_rank_00_optim_states.pt:optimizer_state_dict.base_optimizer_state.state.0.exp_avg"
    ]
    assert (save_dir / "latest").read_text() == "global_step2"


# ---- replay: an SDC that consensus cannot see (every replica averages it in) --------------------------------


def _sdc_events(save_dir):
    with Ledger.open(save_dir, readonly=True) as led:
        return [e for e in led.events() if e["kind"] == "sdc"]


@pytest.mark.scenario
@pytest.mark.parametrize("nproc", [2, 3])
def test_zero1_sdc_in_one_ranks_forward_is_never_certified_with_the_defaults(tmp_path, nproc):
    """Rank 1's first layer computes one channel off by 1e-3 from step 3 on. Its gradient is averaged into every
    replica, so the replicas agree (consensus passes); replay (on by default) must keep every step >= 3 from being
    certified and end the generation; at 3 ranks it names rank 1. Judged by where the fault was placed."""
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    p = _run_failing(
        tmp_path,
        save_dir,
        ev,
        *"--stage 1 --steps 6 --save-every 2 --accept-single-owner --sdc-rank 1 --sdc-from 3".split(),
        nproc=str(nproc),
    )
    assert p.returncode != 0 and "LiveStateCorrupt" in p.stderr, why_failed(p.stderr)
    assert states(save_dir) == {2: "certified", 4: "rejected"}
    assert (save_dir / "latest").read_text() == "global_step2"
    with Ledger.open(save_dir, readonly=True) as led:
        e4 = led.evidence(4)
    assert e4["consensus"]["status"] == "pass"  # the replicas agree on the poisoned state: consensus is blind
    assert e4["replay"]["status"] == ("fail" if nproc == 3 else "inconclusive")
    if nproc == 3:
        assert {tuple(e["ranks"]) for e in _sdc_events(save_dir)} == {(1,)}


@pytest.mark.scenario
def test_zero1_healthy_run_with_replay_certifies_every_tag_with_replay_evidence(tmp_path):
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    torchrun(save_dir, ev, "--stage", 1, "--steps", 6, "--save-every", 2, "--accept-single-owner", nproc=3)
    assert [(r["step"], r["verdict"]) for r in events(ev, "saved")] == [
        (2, "certified"),
        (4, "certified"),
        (6, "certified"),
    ]
    with Ledger.open(save_dir, readonly=True) as led:
        ev6 = led.evidence(6)
    assert ev6["replay"]["status"] == "pass"
    assert set(ev6["replay"]["coverage"]) >= {"0", "2"}  # both Linear layers of the job's Sequential
    assert _sdc_events(save_dir) == []
