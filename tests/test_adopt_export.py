"""Adopting plain DCP folders written by a real 2-rank dcp.save, and exporting certified weights to safetensors."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from scout_ckpt.errors import BadInput, NotClean
from scout_ckpt.format.dcp_files import load_metadata
from scout_ckpt.format.layout import MANIFEST_NAME
from scout_ckpt.ledger import Ledger
from scout_ckpt.ops.adopt import adopt
from scout_ckpt.ops.export import export
from scout_ckpt.testing.launch import run_ranks
from tests.workers_invariants import plain_dcp_save

STEPS = [10, 20]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    out = run_ranks(plain_dcp_save, 2, str(root), STEPS, start_method="spawn", timeout=90)
    return root, out[0].result


@pytest.fixture
def plain(pristine, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(pristine[0], root)
    return root, pristine[1]


def test_adopt_certifies_plain_dcp_folders(plain):
    root, _ = plain
    result = adopt(root)
    assert [(a["step"], a["state"]) for a in result["adopted"]] == [(10, "certified"), (20, "certified")]
    with Ledger.open(root, readonly=True) as ledger:
        rows = ledger.checkpoints()
        assert [(r["step"], r["state"], r["path"]) for r in rows] == [
            (10, "certified", "step-10"),
            (20, "certified", "step-20"),
        ]
        paths = {f["path"] for f in ledger.files(10)}
        assert paths == {".metadata", "__0_0.distcp", "__1_0.distcp"}
        assert ledger.evidence(10)["invariants"]["status"] == "pass"
        assert ledger.run(result["run_id"])["topology"] == {"mode": "adopted"}
    manifest = json.loads((root / "step-20" / MANIFEST_NAME).read_text())
    assert manifest["format"] == "scout-manifest/1" and manifest["adopted"] is True
    assert manifest["step"] == 20 and manifest["invariants"] == [{"check": "finite", "params": "*"}]
    assert set(manifest["evidence"]) == {"bytes", "structure", "invariants", "source_digests"}
    assert manifest["evidence"]["source_digests"]["status"] == "missing"  # recorded, not required by the policy
    again = adopt(root)  # idempotent: folders with a manifest are left alone
    assert again["adopted"] == [] and [s["step"] for s in again["skipped"]] == STEPS


def test_adopted_without_source_digests_is_shown_as_such_and_refused_under_require_source_digests(plain):
    """A bit flipped before adoption (no integrity.json): adopt's own digests vouch for the folder as found, so the
    step is certified; `ls` and `resume` say "adopted", and `--require source_digests` does not hand it out."""
    from tests.conftest import run_cli

    root, saved = plain
    shard = saved[20]["layers.0.weight"][8:].contiguous()  # rank 1's rows, as the oracle saved them
    f = root / "step-20" / "__1_0.distcp"
    data = bytearray(f.read_bytes())
    at = bytes(data).find(shard.numpy().tobytes())
    assert at >= 0
    data[at] ^= 0x01  # the lowest mantissa bit of one weight: still finite, a different number
    f.write_bytes(bytes(data))
    assert [(a["step"], a["state"]) for a in adopt(root)["adopted"]] == [(10, "certified"), (20, "certified")]
    rc, so, se = run_cli("ls", root, "--json")
    rows = {r["step"]: r for r in json.loads(so)["checkpoints"]}
    assert rc == 0 and rows[20]["evidence_level"] == "adopted" and rows[20]["state"] == "certified", so + se
    rc, so, se = run_cli("ls", root)
    assert rc == 0 and "certified (adopted)" in so, so + se
    rc, so, se = run_cli("resume", root, "--latest-clean")
    assert rc == 0 and so.strip().endswith("step-20") and "step 20 is adopted" in se, so + se
    rc, so, se = run_cli("resume", root, "--latest-clean", "--json")
    assert rc == 0 and json.loads(so)["evidence_level"] == "adopted", so + se
    rc, so, se = run_cli("resume", root, "--latest-clean", "--require", "source_digests", "--json")
    out = json.loads(so)
    assert rc == 1 and out["step"] is None, so + se
    # the step adopt certified does hold other numbers than the job saved (the job's own tensors are the oracle)
    import torch.distributed.checkpoint as dcp

    back = {"model": {"layers.0.weight": torch.empty(16, 8)}}
    dcp.load(back, checkpoint_id=str(root / "step-20"), no_dist=True)
    assert not torch.equal(back["model"]["layers.0.weight"], saved[20]["layers.0.weight"])


def test_adopt_rejects_truncated_and_missing_files(plain):
    root, _ = plain
    victim = root / "step-10" / "__1_0.distcp"
    os.truncate(victim, victim.stat().st_size // 2)
    os.unlink(root / "step-20" / "__0_0.distcp")
    result = {a["step"]: a for a in adopt(root)["adopted"]}
    assert result[10]["state"] == "rejected"
    assert {"code": "truncated_file", "file": "__1_0.distcp"}.items() <= result[10]["reasons"][0].items()
    assert result[20]["state"] == "rejected"
    assert result[20]["reasons"][0]["code"] == "missing_file"


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_adopt_refuses_a_metadata_pickle_that_runs_code(plain, tmp_path):
    root, _ = plain
    marker = tmp_path / "pwned"
    (root / "step-20" / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    with pytest.raises(BadInput, match=r"refusing to unpickle posix\.system from \.metadata"):
        load_metadata(root / "step-20")
    result = {a["step"]: a for a in adopt(root)["adopted"]}
    assert not marker.exists()
    assert result[10]["state"] == "certified"
    assert result[20]["state"] == "rejected"
    reason = result[20]["reasons"][0]
    assert reason["code"] == "bad_metadata" and "posix.system" in reason["detail"]


def test_adopt_bad_input(tmp_path):
    with pytest.raises(BadInput, match="no such directory"):
        adopt(tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(BadInput, match="not a directory"):
        adopt(tmp_path / "f")
    with pytest.raises(BadInput, match="no step-N checkpoint folders"):
        adopt(tmp_path)
    (tmp_path / "step-1").mkdir()
    with pytest.raises(BadInput, match="unknown invariant check"):
        adopt(tmp_path, invariant_specs=["bogus"])


def test_export_round_trips_bitwise_with_provenance(plain, tmp_path):
    root, saved = plain
    adopt(root)
    out = tmp_path / "model.safetensors"
    info = export(root, 20, out)
    assert info["prefix"] == "model." and info["tensors"] == 3 and not info["forced"]
    loaded = load_file(str(out))
    assert set(loaded) == set(saved[20])
    for name, tensor in saved[20].items():
        assert torch.equal(loaded[name], tensor), name
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    with Ledger.open(root, readonly=True) as ledger:
        row = ledger.checkpoint(20)
        files = {f["path"]: f["digest"] for f in ledger.files(20)}
    assert meta["scout.step"] == "20" and meta["scout.run_id"] == row["run_id"]
    assert meta["scout.manifest_digest"] == row["manifest_digest"]
    assert json.loads(meta["scout.files"]) == files
    assert export(root, None, tmp_path / "latest.safetensors")["step"] == 20  # newest certified


def test_export_sharded_with_index(plain, tmp_path):
    root, saved = plain
    adopt(root)
    info = export(root, 10, tmp_path / "model.safetensors", max_shard_bytes=300)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 3 and shards[0] == "model-00001-of-00003.safetensors"
    assert index["metadata"]["total_size"] == info["bytes"] == sum(t.numel() * 4 for t in saved[10].values())
    merged = {}
    for shard in shards:
        merged.update(load_file(str(tmp_path / shard)))
    assert set(merged) == set(index["weight_map"]) == set(saved[10])
    assert all(torch.equal(merged[k], v) for k, v in saved[10].items())


def test_export_refuses_non_certified_and_tampered(plain, tmp_path):
    root, saved = plain
    # randn weights are not on the unit sphere: adopted but rejected by the invariant
    adopt(root, invariant_specs=["finite", "frobenius_sphere:radius=1.0:params=layers.*.weight"])
    with Ledger.open(root, readonly=True) as ledger:
        assert ledger.checkpoint(10)["state"] == "rejected"
        assert ledger.checkpoint(10)["reasons"][0]["code"] == "invariant_failed"
    out = tmp_path / "m.safetensors"
    with pytest.raises(NotClean, match="step 10 is rejected"):
        export(root, 10, out)
    assert not out.exists()
    assert export(root, 10, out, force=True)["forced"] is True
    assert torch.equal(load_file(str(out))["head.bias"], saved[10]["head.bias"])
    # a byte changed on disk after the digests were recorded: refused even with force
    data = root / "step-10" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(NotClean, match="does not match its recorded digest"):
        export(root, 10, tmp_path / "m2.safetensors", force=True)
