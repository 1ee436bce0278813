"""ScoutCheckpointManager with TorchTitan 0.3's own model wrapper, optimizer container, LR schedulers and a train
state, on 2 real gloo ranks: save/purge, load(step=-1) skipping a rejected newest step, a rank killed mid-save,
the load-time signature check walking back past a step whose loaded values differ from what was certified, both
async modes committing only after the upload; on 4 ranks (scenario): TorchTitan's own ParallelDims mesh with TP,
consensus over its replica dims."""

import json

import pytest

# `make test` installs torchtitan (the Makefile's integration extras): imported unconditionally, so that a broken
# install fails here instead of skipping the integration's tests.
import torchtitan.components.checkpointer  # noqa: F401

from scout_ckpt.errors import BadOption
from scout_ckpt.ledger import Ledger
from scout_ckpt.testing.launch import run_ranks
from tests import workers_torchtitan as w

pytestmark = pytest.mark.slow


def ranks(root, steps, allow_failures=False, **kw):
    out = run_ranks(w.train, 2, str(root), steps, timeout=400, allow_failures=allow_failures, **kw)
    return [o.result for o in out]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("tt")
    return root, ranks(root, 4, keep=3)


def test_every_save_certified_and_purge_keeps_newest(saved):
    root, (r0, r1) = saved
    assert r0["verdicts"] == r1["verdicts"]
    assert {s: v["state"] for s, v in r0["verdicts"].items()} == {
        1: "certified",
        2: "certified",
        3: "certified",
        4: "certified",
    }
    with Ledger.open(root / "ckpt", readonly=True) as led:
        states = {r["step"]: r["state"] for r in led.checkpoints()}
        ev = led.evidence(4)
        files = led.files(4)
    assert states == {1: "deleted", 2: "certified", 3: "certified", 4: "certified"}
    assert sorted(p.name for p in (root / "ckpt").iterdir() if p.is_dir() and p.name != ".leases") == [
        "step-2",
        "step-3",
        "step-4",
    ]
    assert ev["consensus"]["status"] == "pass" and ev["invariants"]["status"] == "pass"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= {f["path"] for f in files}
    by = {f["path"]: f["rank"] for f in files}
    assert (by["__0_0.distcp"], by["__1_0.distcp"]) == (0, 1)  # each data file hashed by the rank that wrote it
    assert (root / "ckpt" / "step-4" / ".metadata").is_file()  # TorchTitan's own layout: its tools still read it


def test_load_skips_a_rejected_newest_step(saved, tmp_path):
    import shutil

    root = tmp_path / "run"
    shutil.copytree(saved[0], root)
    f = root / "ckpt" / "step-4" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0x01
    f.write_bytes(bytes(data))
    r0, r1 = ranks(root, 5, keep=3)
    assert r0["start"] == r1["start"] == 3  # newest certified whose bytes verify
    assert r0["fingerprints"][3] == saved[1][0]["fingerprints"][3]  # exactly the state saved at step 3
    with Ledger.open(root / "ckpt", readonly=True) as led:
        hist = [h["state"] for h in led.certifications(4)]
        assert "rejected" in hist and led.checkpoint(4)["state"] == "certified"  # re-saved as a new attempt
        assert led.checkpoint(5)["state"] == "certified"
    assert r0["fingerprints"][4] == saved[1][0]["fingerprints"][4]  # the resumed run retraced the same state


def test_rank_killed_mid_save_then_resume_from_newest_certified(tmp_path):
    out = run_ranks(w.train, 2, str(tmp_path), 3, keep=0, kill=(1, 3), timeout=400, allow_failures=True)
    assert any(o.exitcode != 0 for o in out)
    with Ledger.open(tmp_path / "ckpt", readonly=True) as led:
        assert led.checkpoint(3)["state"] == "writing"  # DCP wrote step-3; nothing was certified
    assert (tmp_path / "ckpt" / "step-3" / ".metadata").is_file()  # TorchTitan's own resume would take it
    r0, _ = ranks(tmp_path, 3)
    assert r0["start"] == 2
    with Ledger.open(tmp_path / "ckpt", readonly=True) as led:
        hist = [h for h in led.certifications(3) if h["state"] != "writing"]  # verdicts, not attempt starts
        assert hist[0]["state"] == "rejected" and hist[0]["reasons"][0]["code"] == "save_interrupted"
        assert led.checkpoint(3)["state"] == "certified"


def test_async_commits_only_after_the_upload_completed(tmp_path):
    r0, r1 = ranks(tmp_path, 3, async_mode="async")
    # each save() returns after the dispatch; the save of step N is committed when the next save (or close)
    # has waited for its upload
    assert [r0["verdicts"][s].get("step") for s in (1, 2, 3)] == [None, 1, 2]
    assert r0["final"] == r1["final"] == {"step": 3, "state": "certified", "reasons": []}
    with Ledger.open(tmp_path / "ckpt", readonly=True) as led:
        assert {r["step"]: r["state"] for r in led.checkpoints()} == {1: "certified", 2: "certified", 3: "certified"}
    r0, _ = ranks(tmp_path, 3)
    assert r0["start"] == 3


def test_load_verifies_the_loaded_values_and_walks_back_past_a_mismatch(tmp_path):
    # step 3's weight changed between its evidence and its write: bytes self-consistent, certified at save
    first = ranks(tmp_path, 3, corrupt_write=3)
    assert first[0]["verdicts"][3]["state"] == "certified"
    r0, r1 = ranks(tmp_path, 3)
    assert r0["start"] == r1["start"] == 2
    assert r0["load"]["skipped"][0]["step"] == 3 and r0["load"]["skipped"][0]["code"] == "load_mismatch"
    assert r0["load"]["signatures"] is True
    assert r0["fingerprints"][2] == first[0]["fingerprints"][2]  # exactly the state the job saw at step 2
    with Ledger.open(tmp_path / "ckpt", readonly=True) as led:
        hist = [h for h in led.certifications(3) if h["state"] == "rejected"]
        events = [e for e in led.events() if e["kind"] == "load_mismatch"]
        assert led.checkpoint(3)["state"] == "certified"  # re-saved by the resumed run, a new attempt
    assert hist[0]["reasons"][0]["code"] == "load_mismatch" and "0.weight" in hist[0]["reasons"][0]["tensors"]
    assert events and events[0]["step"] == 3


@pytest.mark.scenario  # DCP's PROCESS-mode async starts a saver process per rank: slow on 2 cores
def test_async_with_pinned_mem_commits_only_after_the_upload_on_cpu(tmp_path):
    # TorchTitan's pinned-memory stager asserts without an accelerator; the manager sets a CPU stager (module doc)
    r0, r1 = ranks(tmp_path, 3, async_mode="async_with_pinned_mem")
    assert [r0["verdicts"][s].get("step") for s in (1, 2, 3)] == [None, 1, 2]
    assert r0["final"] == r1["final"] == {"step": 3, "state": "certified", "reasons": []}
    r0, _ = ranks(tmp_path, 3)
    assert r0["start"] == 3 and r0["fingerprints"][3] is not None


@pytest.mark.scenario
@pytest.mark.scenario_ci
def test_torchtitan_mesh_with_tp_consensus_over_its_replica_dims(tmp_path):
    out = run_ranks(w.train_tp, 4, str(tmp_path), timeout=600)
    res = [o.result for o in out]
    a, b = res[0]["a"], res[0]["b"]
    # (a) dp_replicate 2 x tp 2: the TP shards are compared across dp_replicate, plain state across the world
    assert a["topology"]["mesh_dim_names"] == ["dp_replicate", "tp"]
    assert a["topology"]["replica_groups"] == [[0, 2], [1, 3]]
    assert ["dp_replicate"] in a["topology"]["compare_dims"] and a["topology"]["problems"] == []
    assert a["verdicts"][1]["state"] == "certified"
    # rank 3 flipped a bit of its TP shard: its replica (rank 1) disagrees; two peers detect, cannot blame
    assert a["verdicts"][2]["state"] == "rejected"
    codes = [r["code"] for r in a["verdicts"][2]["reasons"]]
    assert "consensus_attributed" not in codes, a["verdicts"][2]
    pair = [r for r in a["verdicts"][2]["reasons"] if r["code"] == "consensus_inconclusive"]
    assert pair and pair[0]["ranks"] == [1, 3], a["verdicts"][2]
    with Ledger.open(tmp_path / "a" / "ckpt", readonly=True) as led:
        ev1 = led.evidence(1)
    assert ev1["consensus"]["status"] == "pass"
    assert {tuple(g["members"]) for g in ev1["consensus"]["groups"]} >= {(0, 2), (1, 3)}
    # a fresh model loads the newest certified step, values verified against the signatures of the save
    assert [r["a"]["start"] for r in res] == [1, 1, 1, 1]
    assert all(r["a"]["load"]["signatures"] for r in res)
    assert [r["a"]["after_load"] for r in res] == [r["a"]["fingerprints"][1] for r in res]
    # (b) dp_shard 2 x tp 2: parameters sharded on both dims have no replica; the rowwise bias (replicated on tp)
    # is compared across tp, plain state across the world
    assert b["topology"]["mesh_dim_names"] == ["dp_shard", "tp"] and b["topology"]["problems"] == []
    assert ["tp"] in b["topology"]["compare_dims"]
    with Ledger.open(tmp_path / "b" / "ckpt", readonly=True) as led:
        ev = led.evidence(1)
    groups = {tuple(g["members"]) for g in ev["consensus"]["groups"]}
    assert {(0, 1), (2, 3)} <= groups
    # every piece compared agreed, and the pieces sharded on both dims have no replica anywhere: not_applicable
    assert ev["consensus"]["status"] == "not_applicable", ev["consensus"]
    # FSDP over TP's dim 0 is a _StridedShard: a shard dim for consensus; the single-owner shards are vouched for
    # by the shard evidence (foreach AdamW), so the save is certified at its commit
    assert b["placements"]["0.weight"] == ["_StridedShard", "Shard"]
    assert {"shard_replay", "at_rest"} <= set(b["policy"]["require"]) and b["verdict"]["state"] == "certified"
    assert ev["shard_replay"]["status"] == ev["at_rest"]["status"] == "pass"
    unsigned = json.loads((tmp_path / "b" / "ckpt" / "step-1" / "scout-manifest.json").read_text())
    assert {"0.weight", "0.bias"} <= set(unsigned["load_check_unsigned"])  # strided: byte digests vouch at load


@pytest.mark.scenario  # 3 manager runs with replay and shard evidence on 2 ranks: about 40 s on 2 loaded cores
@pytest.mark.scenario_ci
def test_fsdp_on_torchtitans_mesh_gets_replay_and_shard_evidence(tmp_path):
    out = run_ranks(w.train_fsdp, 2, str(tmp_path), arms=("healthy", "resumed", "fault"), timeout=600)
    res = [o.result for o in out]
    h, f = res[0]["healthy"], res[0]["fault"]
    assert h["mode"] == "fsdp" and h["engines"] == [True, True]
    assert {"shard_replay", "at_rest", "replay", "consensus"} <= set(h["policy"]["require"])
    assert h["policy"]["allow_not_applicable"] == ["consensus"]  # single-owner shards: shard evidence vouches
    # healthy: every save certified at its commit (the verdict the sync save returned), on every rank alike
    assert [x["healthy"]["verdicts"] for x in res] == [
        {2: {"step": 2, "state": "certified", "reasons": []}, 4: {"step": 4, "state": "certified", "reasons": []}}
    ] * 2
    with Ledger.open(tmp_path / "healthy" / "ckpt", readonly=True) as led:
        ev = led.evidence(4)
    assert all(ev[k]["status"] == "pass" for k in ("shard_replay", "at_rest", "replay", "bytes", "invariants"))
    # resumed by a fresh manager from the newest certified step: exactly the shards the job held at step 4
    # (judged by the job's own fingerprints, not by scout-ckpt); its async saves certified
    assert [x["resumed"]["start"] for x in res] == [4, 4]
    assert [x["resumed"]["fingerprints"][4] for x in res] == [x["healthy"]["fingerprints"][4] for x in res]
    # async: the save of step 6 is committed when the save of step 8 waits for its upload, step 8's at close
    assert [x["resumed"]["final"] for x in res] == [{"step": 8, "state": "certified", "reasons": []}] * 2
    with Ledger.open(tmp_path / "healthy" / "ckpt", readonly=True) as led:
        assert {row["step"]: row["state"] for row in led.checkpoints()} == {s: "certified" for s in (2, 4, 6, 8)}
        ev = led.evidence(8)
    assert all(ev[k]["status"] == "pass" for k in ("shard_replay", "at_rest", "replay"))
    # faults: rank 0 flipped a bit of its head shard after step 2 (at rest), rank 1's AdamW update of one element
    # is one ulp off from step 3: each save rejected, naming the rank and the element
    assert f["verdicts"][2]["state"] == "rejected" and f["verdicts"][4]["state"] == "rejected"
    at_rest = [x for x in f["verdicts"][2]["reasons"] if x["code"] == "at_rest_changed"]
    assert at_rest and at_rest[0]["ranks"] == [0] and "head.weight" in str(at_rest[0])
    upd = [x for x in f["verdicts"][4]["reasons"] if x["code"] == "shard_update_mismatch"]
    assert upd and all(x["ranks"] == [1] for x in upd) and upd[0]["where"] == ["blocks.0.fc1.weight[5]:param"]
    with Ledger.open(tmp_path / "fault" / "ckpt", readonly=True) as led:
        sdc = [
            e for e in led.events() if e["kind"] == "sdc" and (e.get("detail") or {}).get("source") == "shard_replay"
        ]
        assert {r["step"]: r["state"] for r in led.checkpoints()} == {2: "rejected", 4: "rejected"}
    assert sdc and sdc[0]["ranks"] == [1] and sdc[0]["step"] == 3


def test_enabled_by_configuration_alone_through_torchtitans_override():
    from dataclasses import dataclass, field

    from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager
    from torchtitan.config.configurable import Configurable
    from torchtitan.config.override import OverrideConfig, apply_overrides

    from scout_ckpt.integrations.torchtitan import ScoutCheckpointManager

    @dataclass(kw_only=True, slots=True)
    class Root(Configurable.Config):  # stands for Trainer.Config, whose import needs triton (docs/pytorch-facts.md)
        checkpoint: BaseCheckpointManager.Config = field(
            default_factory=lambda: CheckpointManager.Config(enable=True, folder="ck", interval=7, keep_latest_k=2)
        )

    root = Root()
    target = "scout_ckpt.integrations.torchtitan.scout_checkpoint"
    apply_overrides(
        OverrideConfig(imports=[(target, {"invariants": ["finite", "frobenius_sphere:params=w:radius=1"]})]), root
    )
    cfg = root.checkpoint
    assert type(cfg) is ScoutCheckpointManager.Config and cfg._owner is ScoutCheckpointManager
    assert (cfg.enable, cfg.folder, cfg.interval, cfg.keep_latest_k) == (True, "ck", 7, 2)
    assert cfg.invariants[1].startswith("frobenius_sphere")
    # the override's JSON gives a group as a table: the Config converts it, the one place a dict is read
    from scout_ckpt.options import ReplayOptions, ShardEvidenceOptions

    root = Root()
    apply_overrides(
        OverrideConfig(imports=[(target, {"replay": {"interval": 5}, "shard_evidence": {"cycle": 4}})]), root
    )
    assert root.checkpoint.replay == ReplayOptions(interval=5)
    assert root.checkpoint.shard_evidence == ShardEvidenceOptions(cycle=4)
    assert (ScoutCheckpointManager.Config().replay, ScoutCheckpointManager.Config().shard_evidence) == (True, True)
    with pytest.raises(BadOption, match="replay: unknown option 'intervall'"):
        apply_overrides(OverrideConfig(imports=[(target, {"replay": {"intervall": 5}})]), Root())
