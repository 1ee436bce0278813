"""Real Megatron-Core (0.16.1) `dist_checkpointing` (torch_dist) under real torchrun (2 CPU/gloo ranks) with
scout_ckpt.integrations.megatron, judged by the digests the job computes itself (tests/scripts/mg_job.py: sha256 of
every rank's tensors, written when it saves and after it loads). Tensor-parallel 2 through parallel_state: each
rank's `__R_*.distcp` digested by that rank, the TP-replicated piece compared, the TP shards single-owner; a flipped
bit in an `iter_*` file walked past by the CLI and by the job's own load; a rank SIGKILLed mid-save resumed from
the certified iteration with the state it saved; the tracker never names an uncertified iteration. At TP=1, DP=3
(3 ranks, a scenario) every piece has three data-parallel replicas, compared, and a rank killed mid-save resumes
the certified iteration.

megatron-core is an optional extra (`pip install scout-ckpt[megatron]`; `make test` installs it): a missing
megatron-core fails these tests, never skips them."""

import json
import shutil

# `make test` installs this extra (the Makefile's integration pins): imported unconditionally, so that a
# broken install fails here instead of skipping the integration's tests.
import megatron.core  # noqa: F401,E402
import psutil  # noqa: F401,E402
import pytest

from scout_ckpt.integrations import mg_folders  # noqa: E402
from scout_ckpt.integrations.megatron import latest_clean  # noqa: E402
from scout_ckpt.integrations.mg_evidence import evidence as _evidence  # noqa: E402
from scout_ckpt.ledger import Ledger
from tests import framework_jobs as jobs
from tests.conftest import REPO, run_cli
from tests.framework_jobs import events, flip_bit, states

pytestmark = pytest.mark.slow
SCRIPT = REPO / "tests" / "scripts" / "mg_job.py"
TRACKER = mg_folders.TRACKER


def torchrun(save_dir, events, *extra, restarts=0, ok=True, nproc=2):
    return jobs.torchrun(SCRIPT, save_dir, events, *extra, restarts=restarts, ok=ok, nproc=nproc)


# ---- pure and torch-free pieces -------------------------------------------------------------------------------


def test_tracker_is_replaced_atomically_and_moved_aside_when_nothing_is_certified(tmp_path):
    assert mg_folders.parse_folder("iter_0000012") == 12 and mg_folders.folder_name(7) == "iter_0000007"
    assert mg_folders.parse_folder("iter_12") is None and mg_folders.parse_folder("global_step12") is None
    (tmp_path / TRACKER).write_text("9")  # Megatron-LM's own tracker, no ledger beside it
    assert mg_folders.repoint_tracker(tmp_path) is None
    assert not (tmp_path / TRACKER).exists()
    assert (tmp_path / mg_folders.HIDDEN_TRACKER).read_text() == "9"  # kept, not deleted
    mg_folders.point_tracker(tmp_path, 4)
    assert (tmp_path / TRACKER).read_text() == "4" and mg_folders.read_tracker(tmp_path) == "4"


def test_replicas_from_replica_id_are_compared_and_a_lone_piece_is_single_owner():
    a, b = "a" * 64, "b" * 64
    # two replicas of `b` that differ: detected, not attributed; `w` pieces held once each: single-owner
    two = [
        {"pieces": {"w@(0,)(4,)": a, "b@(0,)(16,)": a}, "nonfinite": []},
        {"pieces": {"w@(4,)(4,)": b, "b@(0,)(16,)": b}, "nonfinite": []},
    ]
    ev = _evidence(two, consensus=True, accept_single_owner=False)
    assert ev["consensus"]["status"] == "inconclusive"
    assert ev["consensus"]["reasons"] == [{"code": "consensus_inconclusive", "ranks": [0, 1], "tensor": "b@(0,)(16,)"}]
    assert ev["single_owner"]["status"] == "missing" and ev["single_owner"]["reasons"][0]["pieces"] == 2
    # three replicas, one differs: that rank is attributed
    three = [
        {"pieces": {"b": a}, "nonfinite": []},
        {"pieces": {"b": b}, "nonfinite": ["b"]},
        {"pieces": {"b": a}, "nonfinite": []},
    ]
    ev = _evidence(three, consensus=True, accept_single_owner=False)
    assert ev["consensus"]["status"] == "fail" and ev["consensus"]["reasons"][0]["ranks"] == [1]
    assert ev["invariants"]["status"] == "fail" and ev["invariants"]["reasons"][0]["ranks"] == [1]
    assert ev["single_owner"]["status"] == "pass"
    # nothing replicated: consensus has nothing to compare (not a pass)
    ev = _evidence(two[:1], consensus=True, accept_single_owner=True)
    assert ev["consensus"]["status"] == "not_applicable" and ev["single_owner"]["status"] == "not_applicable"


# ---- TP=2: healthy run, per-rank digests, CLI, a flipped bit walked past (default tier: one torchrun) --------


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    base = tmp_path_factory.mktemp("mg2")
    save_dir, ev = base / "ck", base / "events.jsonl"
    p = torchrun(save_dir, ev, "--tp", 2, "--iters", 4, "--save-every", 2, "--accept-single-owner")
    # a job that gives no model= is told at start that replay, on by default where it can run, is off
    assert "replay is off (no model= given to MegatronCheckpointer)" in p.stderr, p.stderr[-2000:]
    return save_dir, ev


# in the CI tier rather than `make test`: the TP=2 job of these two tests (about 35 s) kept `make test` within 15 minutes
@pytest.mark.scenario
@pytest.mark.scenario_ci
def test_tp2_healthy_run_certifies_every_iteration_each_rank_digesting_its_own_files(tp2):
    save_dir, ev = tp2
    assert [(r["step"], r["verdict"], r["tracker"]) for r in events(ev, "saved")] == [
        (2, "certified", "2"),
        (4, "certified", "4"),
    ]
    assert states(save_dir) == {2: "certified", 4: "certified"}
    with Ledger.open(save_dir, readonly=True) as led:
        e4, files, run = led.evidence(4), led.files(4), led.runs()[-1]
    assert run["policy"]["require"] == ["bytes", "invariants", "consensus", "single_owner"]
    assert run["topology"]["tensor_parallel"] == 2 and run["topology"]["data_parallel"] == 1
    by_rank = {f["path"]: f["rank"] for f in files}
    # every __R_*.distcp digested by rank R (the writer); rank 0 the files rank 0 wrote
    distcp = {p: r for p, r in by_rank.items() if p.endswith(".distcp")}
    assert distcp and all(r == int(p.split("_")[2]) for p, r in distcp.items()) and set(distcp.values()) == {0, 1}
    assert {p for p, r in by_rank.items() if not p.endswith(".distcp")} == {".metadata", "common.pt", "metadata.json"}
    assert by_rank[".metadata"] == 0
    # `b` is replicated over TP (replica_id (0, tp_rank, 0)): compared; `w`'s two TP shards have no replica
    assert e4["consensus"]["status"] == "pass" and e4["consensus"]["tensors_compared"] == 1
    assert e4["consensus"]["groups"] == [{"members": [0, 1]}]
    assert e4["single_owner"]["status"] == "not_applicable" and e4["single_owner"]["reasons"][0]["keys"] == ["w"]
    m = json.loads((save_dir / "iter_0000004" / "scout-manifest.json").read_text())
    assert m["verdict"]["state"] == "certified" and m["layout"] == "megatron" and m["iteration"] == 4
    assert (save_dir / TRACKER).read_text() == "4" and latest_clean(save_dir) == 4


@pytest.mark.scenario
@pytest.mark.scenario_ci
def test_tp2_cli_reads_iter_folders_and_walks_past_a_flipped_bit(tp2, tmp_path):
    save_dir = tmp_path / "ck"
    shutil.copytree(tp2[0], save_dir)
    rc, so, se = run_cli("ls", save_dir, "--json")
    rows = {r["step"]: r for r in json.loads(so)["checkpoints"]}
    assert rc == 0 and rows[4]["path"] == "iter_0000004" and rows[4]["state"] == "certified", so + se
    rc, so, se = run_cli("certify", save_dir, "--json")
    assert rc == 0, so + se
    bad = sorted((save_dir / "iter_0000004").glob("__1_*.distcp"))[0]  # rank 1's own shard
    flip_bit(bad)
    rc, so, se = run_cli("resume", save_dir, "--latest-clean", "--json")
    assert rc == 0 and json.loads(so)["step"] == 2 and json.loads(so)["path"].endswith("iter_0000002"), so + se
    with Ledger.open(save_dir, readonly=True) as led:
        row = led.checkpoint(4)
    assert row["state"] == "rejected" and row["reasons"][0]["code"] == "digest_mismatch"
    assert row["reasons"][0]["file"] == bad.name
    assert latest_clean(save_dir) == 2
    # the command that rejected the iteration moved the tracker at once (Megatron-LM's `--load` reads it)
    assert (save_dir / TRACKER).read_text() == "2" and f"{TRACKER} now names 2" in se, se
    rc, so, se = run_cli("quarantine", save_dir, 2, "--reason", "suspect host")
    assert rc == 0 and not (save_dir / TRACKER).exists(), so + se  # nothing certified left: moved aside
    assert (save_dir / mg_folders.HIDDEN_TRACKER).read_text() == "2"


@pytest.mark.scenario
def test_tp2_a_quarantined_iteration_is_saved_anew_by_a_run_resumed_before_it(tp2, tmp_path):
    """#39, as for DeepSpeed's tags: iteration 4 quarantined, the restart loads iteration 2 (the tracker, moved by
    the quarantine), saves iteration 4 again and it is certified; the quarantined folder is kept beside it.
    Judged by the jobs' own state digests."""
    save_dir = tmp_path / "ck"
    shutil.copytree(tp2[0], save_dir)
    first = {r["step"]: r["digest"] for r in events(tp2[1], "saved")}
    rc, _, se = run_cli("quarantine", save_dir, 4, "--reason", "suspect host")
    assert rc == 0 and (save_dir / TRACKER).read_text() == "2", se
    ev = tmp_path / "events.jsonl"
    torchrun(save_dir, ev, "--tp", 2, "--iters", 4, "--save-every", 2, "--accept-single-owner")
    assert [(r["step"], r["digest"]) for r in events(ev, "resumed")] == [(2, first[2])]
    saved = events(ev, "saved")
    assert [(r["step"], r["verdict"], r["digest"]) for r in saved] == [(4, "certified", first[4])]
    with Ledger.open(save_dir, readonly=True) as led:
        assert led.checkpoint(4)["state"] == "certified" and led.checkpoint(4)["path"] == "iter_0000004"
        aside = [e for e in led.events() if e["kind"] == "quarantine_set_aside"][0]["detail"]["path"]
    assert aside.startswith("iter_0000004.scout-quarantined-") and any((save_dir / aside).glob("*.distcp"))
    assert (save_dir / TRACKER).read_text() == "4"


# ---- scenarios: kill mid-save, the job's own walk-back, default options at TP=2, async, replicas disagree ---


@pytest.mark.scenario
def test_rank_killed_mid_save_resumes_exactly_from_the_certified_iteration(tmp_path):
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    # rank 1 SIGKILLs itself after the files of iteration 4 are written, before the finalize; torchrun restarts
    torchrun(save_dir, ev, "--iters", 6, "--save-every", 2, "--crash-at", 4, restarts=1)
    first = {r["step"]: r for r in events(ev, "saved", attempt=0)}
    assert list(first) == [2] and first[2]["tracker"] == "2"
    assert [(r["step"], r["digest"]) for r in events(ev, "resumed", attempt=1)] == [(2, first[2]["digest"])]
    with Ledger.open(save_dir, readonly=True) as led:
        hist4 = [h for h in led.certifications(4) if h["state"] != "writing"]
    assert hist4[0]["state"] == "rejected" and hist4[0]["reasons"][0]["code"] == "save_interrupted"
    assert states(save_dir) == {2: "certified", 4: "certified", 6: "certified"}
    assert (save_dir / TRACKER).read_text() == "6"
    # a run without the crash reaches the same final state (the resume lost nothing)
    ref_dir, ref_ev = tmp_path / "ref", tmp_path / "ref.jsonl"
    torchrun(ref_dir, ref_ev, "--iters", 6, "--save-every", 2)
    assert events(ref_ev, "final")[0]["digest"] == events(ev, "final", attempt=1)[0]["digest"]


@pytest.mark.scenario
def test_dp3_replicas_compared_and_a_rank_killed_mid_save_resumes_the_certified_iteration(tmp_path):
    """TP=1, DP=3: every piece has three data-parallel replicas (default options: nothing single-owner)."""
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    # rank 1 SIGKILLs itself after the files of iteration 4 are written, before the finalize; torchrun restarts
    torchrun(save_dir, ev, "--iters", 6, "--save-every", 2, "--crash-at", 4, restarts=1, nproc=3)
    first = {r["step"]: r for r in events(ev, "saved", attempt=0)}
    assert [(s, r["verdict"], r["tracker"]) for s, r in first.items()] == [(2, "certified", "2")]
    assert len(first[2]["digest"].split(":")) == 3  # the job's digest joins 3 ranks' own
    assert [(r["step"], r["digest"]) for r in events(ev, "resumed", attempt=1)] == [(2, first[2]["digest"])]
    with Ledger.open(save_dir, readonly=True) as led:
        e2, run = led.evidence(2), led.runs()[-1]
        hist4 = [h for h in led.certifications(4) if h["state"] != "writing"]
    assert run["topology"]["data_parallel"] == 3 and run["topology"]["tensor_parallel"] == 1
    assert e2["consensus"]["status"] == "pass" and e2["consensus"]["tensors_compared"] == 2  # w and b
    assert e2["consensus"]["groups"] == [{"members": [0, 1, 2]}] and e2["single_owner"]["status"] == "pass"
    assert hist4[0]["state"] == "rejected" and hist4[0]["reasons"][0]["code"] == "save_interrupted"
    assert states(save_dir) == {2: "certified", 4: "certified", 6: "certified"}
    assert (save_dir / TRACKER).read_text() == "6"
    ref_dir, ref_ev = tmp_path / "ref", tmp_path / "ref.jsonl"  # the same job at 3 ranks, never killed
    torchrun(ref_dir, ref_ev, "--iters", 6, "--save-every", 2, nproc=3)
    assert events(ref_ev, "final")[0]["digest"] == events(ev, "final", attempt=1)[0]["digest"]


@pytest.mark.scenario
def test_flipped_bit_in_the_newest_iteration_is_walked_past_by_the_jobs_load(tmp_path):
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    torchrun(save_dir, ev, "--iters", 4, "--save-every", 2, "--drop-in")  # integrations.megatron.save
    saved = {r["step"]: r for r in events(ev, "saved")}
    assert [(s, r["verdict"], r["tracker"]) for s, r in saved.items()] == [(2, "certified", "2"), (4, "certified", "4")]
    flip_bit(sorted((save_dir / "iter_0000004").glob("*.distcp"))[0])
    ev2 = tmp_path / "events2.jsonl"
    torchrun(save_dir, ev2, "--iters", 6, "--save-every", 2)
    assert [(r["step"], r["digest"]) for r in events(ev2, "resumed")] == [(2, saved[2]["digest"])]
    assert events(ev2, "saved")[0]["step"] == 4 and events(ev2, "saved")[0]["digest"] == saved[4]["digest"]
    with Ledger.open(save_dir, readonly=True) as led:
        verdicts4 = [h["state"] for h in led.certifications(4) if h["state"] != "writing"]
    assert verdicts4[-2:] == ["rejected", "certified"]  # rejected by the walk-back, then saved again
    assert states(save_dir) == {2: "certified", 4: "certified", 6: "certified"}


@pytest.mark.scenario
def test_tp2_default_options_never_certify_shards_and_the_tracker_never_names_them(tmp_path):
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    torchrun(save_dir, ev, "--tp", 2, "--iters", 4, "--save-every", 2)
    assert [(r["step"], r["verdict"], r["tracker"]) for r in events(ev, "saved")] == [
        (2, "committed", None),
        (4, "committed", None),
    ]
    with Ledger.open(save_dir, readonly=True) as led:
        row = led.checkpoint(4)
    assert [r["code"] for r in row["reasons"]] == ["single_owner"]
    assert latest_clean(save_dir) is None

    def names():  # SQLite's -wal/-shm sidecars come and go with connections: not data
        return sorted(p.name for p in save_dir.iterdir() if not p.name.endswith(("-wal", "-shm")))

    before = names()
    p = torchrun(save_dir, ev, "--tp", 2, "--iters", 4, "--save-every", 2, ok=False)
    assert "does not start from iteration 0 over them" in p.stderr and "iter_0000004" in p.stderr
    assert names() == before and states(save_dir) == {2: "committed", 4: "committed"}
    assert p.stderr.count("scout-ckpt: StartRefused: ") == 1 and "raise StartRefused" not in p.stderr
    # the advice followed: accept_single_owner=True re-judges the saved iterations under that policy and resumes
    # from the newest with the state the job saved (its own digest)
    ev2 = tmp_path / "events2.jsonl"
    torchrun(save_dir, ev2, "--tp", 2, "--iters", 6, "--save-every", 2, "--accept-single-owner")
    saved4 = events(ev, "saved")[-1]
    assert [(r["step"], r["digest"]) for r in events(ev2, "resumed")] == [(4, saved4["digest"])]
    assert states(save_dir) == {2: "certified", 4: "certified", 6: "certified"}
    with Ledger.open(save_dir, readonly=True) as led:
        hist4 = [(h["state"], h["source"]) for h in led.certifications(4) if h["state"] != "writing"]
    assert hist4 == [("committed", "save"), ("certified", "rejudge")]
    assert (save_dir / TRACKER).read_text() == "6"


@pytest.mark.scenario
def test_async_save_is_certified_in_the_async_requests_finalize(tmp_path):
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    torchrun(save_dir, ev, "--iters", 4, "--save-every", 2, "--async-save")
    assert [(r["step"], r["verdict"], r["tracker"]) for r in events(ev, "saved")] == [
        (2, "certified", "2"),
        (4, "certified", "4"),
    ]
    ev2 = tmp_path / "events2.jsonl"
    torchrun(save_dir, ev2, "--iters", 4, "--save-every", 2)
    assert events(ev2, "resumed")[0]["digest"] == events(ev, "saved")[-1]["digest"]  # a sync job loads it


@pytest.mark.scenario
@pytest.mark.scenario_ci  # the CI tier's Megatron-Core scenario: one 2-rank job
def test_replicas_that_disagree_reject_the_iteration_and_end_the_generation(tmp_path):
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    torchrun(save_dir, ev, "--iters", 4, "--save-every", 2, "--diverge-at", 4, ok=False)
    assert [(r["step"], r["verdict"]) for r in events(ev, "live_fault")] == [(4, "rejected")]
    assert "consensus_inconclusive" in events(ev, "live_fault")[0]["codes"]
    assert states(save_dir) == {2: "certified", 4: "rejected"}
    assert (save_dir / TRACKER).read_text() == "2"


@pytest.mark.scenario
def test_tp2_gptmodel_sharded_state_dict_is_certified_and_resumed_exactly(tmp_path):
    """A real GPTModel's sharded_state_dict() (built on CPU; updated without a forward, which needs CUDA)."""
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    torchrun(save_dir, ev, "--gpt", "--tp", 2, "--iters", 2, "--save-every", 2, "--accept-single-owner")
    saved = events(ev, "saved")
    assert [(r["step"], r["verdict"]) for r in saved] == [(2, "certified")]
    with Ledger.open(save_dir, readonly=True) as led:
        e2 = led.evidence(2)
    # the layer norms and the row-parallel biases are replicated over TP (compared); the column/row-parallel
    # weights and the vocab-parallel embedding are split (single-owner)
    assert e2["consensus"]["status"] == "pass" and e2["consensus"]["tensors_compared"] >= 4
    assert {"embedding.word_embeddings.weight", "output_layer.weight"} <= set(e2["single_owner"]["reasons"][0]["keys"])
    ev2 = tmp_path / "events2.jsonl"
    torchrun(save_dir, ev2, "--gpt", "--tp", 2, "--iters", 4, "--save-every", 2, "--accept-single-owner")
    assert [(r["step"], r["digest"]) for r in events(ev2, "resumed")] == [(2, saved[0]["digest"])]
    ref_dir, ref_ev = tmp_path / "ref", tmp_path / "ref.jsonl"
    torchrun(ref_dir, ref_ev, "--gpt", "--tp", 2, "--iters", 4, "--save-every", 2, "--accept-single-owner")
    assert events(ref_ev, "final")[0]["digest"] == events(ev2, "final")[0]["digest"]


@pytest.mark.scenario
def test_tp2_gptmodel_layer_norm_replicas_that_disagree_are_caught(tmp_path):
    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    torchrun(
        save_dir,
        ev,
        "--gpt",
        "--tp",
        2,
        "--iters",
        2,
        "--save-every",
        2,
        "--accept-single-owner",
        "--diverge-at",
        2,
        ok=False,
    )
    assert [(r["step"], r["verdict"]) for r in events(ev, "live_fault")] == [(2, "rejected")]
    with Ledger.open(save_dir, readonly=True) as led:
        reasons = led.checkpoint(2)["reasons"]
    assert [(r["code"], r["tensor"]) for r in reasons] == [
        ("consensus_inconclusive", "decoder.final_layernorm.weight@(0,)(16,)")
    ]
    assert not (save_dir / TRACKER).exists()
