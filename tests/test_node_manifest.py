"""Evidence per node: node manifests in the checkpoint, one ledger row per node, every byte check through them.

The fast tests build a checkpoint directory by hand (files of known bytes, node manifests written by the code
under test, digests recomputed here with xxhash); the scenario runs a real 4-rank gloo job laid out as two
torchrun nodes of two ranks and judges the resumed state by the state each rank held at its save."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import xxhash

from scout_ckpt.format import node_manifest as fm
from scout_ckpt.format.layout import DCP_METADATA
from scout_ckpt.format.verify import verify_files
from scout_ckpt.save.node_manifest import node_rows, plan, summary, wire, write_node


def _digest(data: bytes) -> str:  # independent of scout_ckpt.format.digests
    return "xxh3_128:" + xxhash.xxh3_128_hexdigest(data)


def _flip(path: Path, offset: int = 0) -> None:
    b = bytearray(path.read_bytes())
    b[offset] ^= 0x01
    path.write_bytes(bytes(b))


def _two_node_dir(d: Path) -> list[dict]:
    """Ranks 0-3 on nodes 0 and 1 each wrote `__R_0.distcp`; rank 0 also `.metadata`. Returns the top-level
    file list a save records: `.metadata` and one row per node."""
    d.mkdir()
    reports = []
    for r in range(4):
        data = bytes([r]) * (100 + r)
        (d / f"__{r}_0.distcp").write_bytes(data)
        reports.append({"rank": r, "files": [{"path": f"__{r}_0.distcp", "size": len(data), "digest": _digest(data)}]})
    meta = b"dcp metadata"
    (d / DCP_METADATA).write_bytes(meta)
    reports[0]["files"].append({"path": DCP_METADATA, "size": len(meta), "digest": _digest(meta)})
    top = [{"path": DCP_METADATA, "size": len(meta), "digest": _digest(meta), "rank": 0}]
    for node in (0, 1):
        s = write_node(d, node, 7, "a1", 2 * node, reports[2 * node : 2 * node + 2])
        assert s[-1] is None, s
        top += node_rows(s)[0]["files"]
    return top


def test_a_node_manifest_is_one_row_holding_its_ranks_rows(tmp_path):
    top = _two_node_dir(tmp_path / "s")
    assert [(f["path"], f["rank"]) for f in top] == [
        (DCP_METADATA, 0),
        ("scout-node-00000.json", 0),
        ("scout-node-00001.json", 2),
    ]
    for f in top[1:]:
        data = (tmp_path / "s" / f["path"]).read_bytes()
        assert f["digest"] == _digest(data)
        assert f["size"] == len(data)
    doc = json.loads((tmp_path / "s" / "scout-node-00001.json").read_bytes())
    assert [(x["path"], x["rank"]) for x in doc["files"]] == [("__2_0.distcp", 2), ("__3_0.distcp", 3)]
    assert fm.totals(top) == (5, 100 + 101 + 102 + 103 + len(b"dcp metadata"))
    ev = verify_files(tmp_path / "s", top)
    assert ev["status"] == "pass", ev
    assert ev["files_checked"] == 7  # .metadata, two node manifests, four shards


def test_a_flipped_bit_in_a_rank_file_fails_with_its_rank(tmp_path):
    top = _two_node_dir(tmp_path / "s")
    _flip(tmp_path / "s" / "__3_0.distcp", 50)
    ev = verify_files(tmp_path / "s", top)
    assert ev["status"] == "fail"
    assert [(r["code"], r["file"], r["rank"]) for r in ev["reasons"]] == [("digest_mismatch", "__3_0.distcp", 3)]


def test_a_flipped_bit_in_a_node_manifest_fails_it_and_its_node_is_unvouched(tmp_path):
    top = _two_node_dir(tmp_path / "s")
    path = tmp_path / "s" / "scout-node-00001.json"
    data = bytearray(path.read_bytes())
    i = data.index(b'"size":102')  # rank 2's size: still a valid JSON document after the flip
    data[i + 9] ^= 0x01  # "102" -> "103"
    path.write_bytes(bytes(data))
    ev = verify_files(tmp_path / "s", top)
    assert ev["status"] == "fail"
    assert {(r["code"], r["file"]) for r in ev["reasons"]} == {
        ("digest_mismatch", "scout-node-00001.json"),
        ("unexpected_file", "__2_0.distcp"),  # its rows are not read from a manifest that does not match
        ("unexpected_file", "__3_0.distcp"),
    }


def test_a_missing_node_manifest_and_a_missing_shard_both_fail(tmp_path):
    top = _two_node_dir(tmp_path / "s")
    os.remove(tmp_path / "s" / "scout-node-00000.json")
    ev = verify_files(tmp_path / "s", top)
    assert ("missing_file", "scout-node-00000.json") in {(r["code"], r["file"]) for r in ev["reasons"]}
    top = _two_node_dir(tmp_path / "t")
    os.remove(tmp_path / "t" / "__2_0.distcp")
    ev = verify_files(tmp_path / "t", top, expect_complete=False)  # a loading rank's share: no listing
    assert [(r["code"], r["file"], r["rank"]) for r in ev["reasons"]] == [("missing_file", "__2_0.distcp", 2)]


def test_a_recorded_node_manifest_that_lists_a_file_twice_or_escapes_fails(tmp_path):
    top = _two_node_dir(tmp_path / "s")
    for rows, code in (
        ([{"path": "__0_0.distcp", "size": 100, "digest": "x"}], "file_listed_twice"),
        ([{"path": "../evil", "size": 1, "digest": "x"}], "bad_node_manifest"),
    ):
        doc = {"format": fm.FORMAT, "node": 1, "ranks": [2, 3], "files": rows}
        data = fm.encode(doc)
        (tmp_path / "s" / "scout-node-00001.json").write_bytes(data)
        forged = top[:2] + [{**top[2], "size": len(data), "digest": _digest(data)}]  # as if recorded so
        ev = verify_files(tmp_path / "s", forged)
        assert ev["status"] == "fail"
        assert code in {r["code"] for r in ev["reasons"]}


def test_a_node_that_could_not_write_its_manifest_says_so_in_its_summary(tmp_path):
    s = write_node(tmp_path / "absent", 3, 7, "a", 6, [{"rank": 6, "files": [], "finite_bad": ["w"]}])
    rows = node_rows(s)
    assert rows[0]["error"].startswith("node 3: FileNotFoundError")
    assert rows[0]["rank"] == 6


def test_plan_reads_torchrun_s_node_and_is_none_on_one_node():
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "2"}
    p = plan(17, 32, env)
    assert (p.node, p.leader, p.members) == (2, 16, tuple(range(16, 24)))
    assert plan(1, 8, {**env, "LOCAL_WORLD_SIZE": "8"}) is None  # one node of 8: the flat gather
    assert plan(1, 8, {}) is None  # not under torchrun


def test_a_summary_is_small_and_names_failing_ranks():
    row = {"size": 2500, "digest": "xxh3_128:" + "f" * 32, "files": 8, "bytes": 8 * 50_000_000}
    s = summary(12_499, 99_992, 8, row, {}, None)
    assert len(wire(s)) < 160  # 12,500 nodes x 8 B length + this < 2 MB at the coordinator
    rows = node_rows(summary(1, 8, 8, row, {"9": ["w"]}, None))
    assert [(r["rank"], r["finite_bad"]) for r in rows] == [(8, []), (9, ["w"])]


# ---- a real job: 4 gloo ranks laid out as two torchrun nodes ------------------------------------------------


@pytest.mark.scenario
@pytest.mark.parametrize(
    "async_save", [pytest.param(False, marks=pytest.mark.scenario_ci, id="sync"), pytest.param(True, id="async")]
)
def test_two_nodes_save_a_row_per_node_and_every_byte_check_reads_through_it(tmp_path, async_save):
    import torch

    from scout_ckpt.ledger import Ledger
    from scout_ckpt.testing.launch import run_ranks
    from tests import workers_pernode as wp
    from tests.conftest import run_cli

    root = tmp_path / "run"
    out = run_ranks(wp.save_on_two_nodes, 4, str(root), async_save, timeout=300)
    for o in out:
        if not async_save:  # an async save's verdict comes later: the ledger's states below
            assert [v["state"] for v in o.result["verdicts"]] == ["certified", "certified"], o.result["verdicts"]
        assert o.result["loaded_step"] == 4
        saved, loaded = o.result["saved"], o.result["loaded"]
        assert sorted(saved) == sorted(loaded)
        assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    with Ledger.open(root, readonly=True) as led:
        assert {r["step"]: r["state"] for r in led.checkpoints()} == {2: "certified", 4: "certified"}
        assert {f["path"]: f["rank"] for f in led.files(4)} == {
            DCP_METADATA: 0,
            "scout-node-00000.json": 0,
            "scout-node-00001.json": 2,
        }
    node1 = json.loads((root / "step-00000004" / "scout-node-00001.json").read_bytes())
    assert [(f["path"], f["rank"]) for f in node1["files"]] == [("__2_0.distcp", 2), ("__3_0.distcp", 3)]
    top = json.loads((root / "step-00000004" / "scout-manifest.json").read_bytes())
    assert top["evidence"]["bytes"]["files"] == 5  # four shards and .metadata, counted through the node rows

    run_cli("certify", root, "--all", "--json", check_rc=0)
    # export reads the shards the node manifests list: step 4's weights as rank 0 held them at its save
    from safetensors.torch import load_file

    from scout_ckpt.ops.export import export

    export(root, 4, tmp_path / "m.safetensors")
    weights = load_file(tmp_path / "m.safetensors")
    held = out[0].result["saved"]
    assert sorted(weights) == sorted(k[len("model.") :] for k in held if k.startswith("model."))
    assert all(torch.equal(v, held["model." + k]) for k, v in weights.items())
    # a flipped bit in rank 3's shard: certify names the file and the rank, resume walks back
    _flip(root / "step-00000004" / "__3_0.distcp", 200)
    rc, stdout, _ = run_cli("certify", root, "--step", "4", "--json")
    assert rc == 1
    reasons = [r for s in json.loads(stdout)["results"] for r in s["reasons"]]
    assert ("digest_mismatch", "__3_0.distcp", 3) in {(r["code"], r.get("file"), r.get("rank")) for r in reasons}
    rc, stdout, _ = run_cli("resume", root, "--latest-clean", "--json")
    assert rc == 0 and json.loads(stdout)["step"] == 2
    # the ledger rebuilt from the manifests: still a row per node, and step 2 verifies through them
    shutil.move(root / "scout-ledger.db", tmp_path / "old.db")
    for extra in root.glob("scout-ledger.db-*"):
        extra.unlink()
    run_cli("ledger", "rebuild", root, check_rc=0)
    with Ledger.open(root, readonly=True) as led:
        assert sorted(f["path"] for f in led.files(2)) == [
            DCP_METADATA,
            "scout-node-00000.json",
            "scout-node-00001.json",
        ]
    run_cli("certify", root, "--step", "2", "--json", check_rc=0)
    # a flipped bit in a node manifest fails the step that holds it
    _flip(root / "step-00000002" / "scout-node-00000.json", 20)
    rc, stdout, _ = run_cli("certify", root, "--step", "2", "--json")
    assert rc == 1
    reasons = [r for s in json.loads(stdout)["results"] for r in s["reasons"]]
    assert ("digest_mismatch", "scout-node-00000.json") in {(r["code"], r.get("file")) for r in reasons}


@pytest.mark.scenario
def test_the_coordinator_hears_every_node_of_uneven_sizes_and_a_node_that_could_not_write(tmp_path):
    """Six gloo ranks as nodes of 3, 2 and 1: two aggregators reach the coordinator in whatever order they
    arrive; then the same with node 1's node manifest unwritable."""
    from scout_ckpt.testing.launch import run_ranks
    from tests import workers_pernode as wp

    out = run_ranks(wp.gather_three_nodes, 6, str(tmp_path), timeout=240)
    assert [o.result is None for o in out] == [False, True, True, True, True, True]
    rows = out[0].result
    assert [(r["rank"], [f["path"] for f in r["files"]], r["finite_bad"]) for r in rows] == [
        (0, [DCP_METADATA, "scout-node-00000.json"], []),
        (3, ["scout-node-00001.json"], []),
        (4, [], ["w"]),  # rank 4's failed finite check, named by its own rank
        (5, ["scout-node-00002.json"], []),
    ]
    for node, ranks in ((0, [0, 1, 2]), (1, [3, 4]), (2, [5])):
        doc = json.loads((tmp_path / fm.name(node)).read_bytes())
        assert [f["rank"] for f in doc["files"]] == ranks
        assert [f["path"] for f in doc["files"]] == [f"__{r}_0.distcp" for r in ranks]
    (tmp_path / "again").mkdir()
    out = run_ranks(wp.gather_three_nodes, 6, str(tmp_path / "again"), 1, timeout=240)
    errors = [r for r in out[0].result if r.get("error")]
    assert [(r["rank"], r["error"].split(":")[0]) for r in errors] == [(3, "node 1")]
