"""Evidence per node on an object-store root: a save of several nodes keeps one ledger row per node there too.

Each node's aggregator writes its node manifest (`scout-node-NNNNN.json`) as an object of the save attempt, and
every byte check that reads an attempt (certify, resume's verification, the job's load verification, `ledger
rebuild` from the bucket, export's fetch) reads the per-rank rows through it, as on a filesystem root. Against a
real S3-compatible server (moto's, tests/test_s3.py's fixtures); digests of the objects are recomputed here with
xxhash, and a resumed state is judged by the digest the job printed at its save."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import xxhash

from scout_ckpt.format import layout
from scout_ckpt.format import node_manifest as fm
from scout_ckpt.format.layout import DCP_METADATA
from scout_ckpt.ledger import Ledger
from scout_ckpt.save.node_manifest import node_rows, write_node
from scout_ckpt.testing.launch import run_ranks
from tests import workers_s3_nodes as wn
from tests.test_s3 import CREDS, _cli, _store, endpoint, run  # noqa: F401 - fixtures: the moto server, a fresh prefix

NODES = ["scout-node-00000.json", "scout-node-00001.json"]


def _digest(data: bytes) -> str:  # independent of scout_ckpt.format.digests
    return "xxh3_128:" + xxhash.xxh3_128_hexdigest(data)


def _flip(s3run, key: str, offset: int) -> None:
    data = bytearray(s3run["fs"].cat_file(key))
    data[offset] ^= 0x01  # one byte, same size
    s3run["fs"].pipe_file(key, bytes(data))


def _two_node_attempt(s3run, store, name: str, step: int = 3) -> list[dict]:
    """Ranks 0-3 on nodes 0 and 1 each uploaded `__R_0.distcp`, rank 0 `.metadata`; each aggregator wrote its
    node manifest through the store (the save's own path: ObjectStore.write_object). Returns the top file list."""
    reports = []
    for r in range(4):
        data = bytes([r]) * (100 + r)
        s3run["fs"].pipe_file(store.key(name, f"__{r}_0.distcp"), data)
        reports.append({"rank": r, "files": [{"path": f"__{r}_0.distcp", "size": len(data), "digest": _digest(data)}]})
    meta = b"dcp metadata"
    s3run["fs"].pipe_file(store.key(name, DCP_METADATA), meta)
    top = [{"path": DCP_METADATA, "size": len(meta), "digest": _digest(meta), "rank": 0}]
    for node in (0, 1):
        s = write_node(
            lambda rel, data: store.write_object(name, rel, data),
            node,
            3,
            "n",
            2 * node,
            reports[2 * node : 2 * node + 2],
        )
        assert s[-1] is None, s
        top += node_rows(s)[0]["files"]
    return top


def _held(s3run, store, name: str) -> int:
    """Bytes of an attempt's objects but its manifest, summed from the store's own listing."""
    sizes = s3run["fs"].du(store.key(name), total=False)
    return sum(size for key, size in sizes.items() if not key.endswith("/" + layout.MANIFEST_NAME))


def _codes(ev) -> set[tuple]:
    return {(r["code"], r.get("file"), r.get("rank")) for r in ev["reasons"]}


def test_an_attempt_s_node_manifest_objects_carry_its_ranks_rows_for_every_check(run, tmp_path):  # noqa: F811
    store = _store(run)
    name = layout.attempt_dirname(3, "n")
    top = _two_node_attempt(run, store, name)
    assert [(f["path"], f["rank"]) for f in top] == [(DCP_METADATA, 0), (NODES[0], 0), (NODES[1], 2)]
    doc = json.loads(run["fs"].cat_file(store.key(name, NODES[1])))
    assert [(f["path"], f["rank"]) for f in doc["files"]] == [("__2_0.distcp", 2), ("__3_0.distcp", 3)]
    assert fm.stored_bytes(top) == _held(run, store, name)
    ev = store.verify(name, top)
    assert (ev["status"], ev["files_checked"]) == ("pass", 7), ev  # .metadata, 2 node manifests, 4 shards
    assert store.fetch(name, top, tmp_path / "copy") == []  # export's local copy holds the shards too
    assert (tmp_path / "copy" / "__3_0.distcp").read_bytes() == bytes([3]) * 103
    with pytest.raises(FileExistsError):  # an attempt's object is created once, never overwritten
        store.write_object(name, NODES[0], b"{}")

    _flip(run, store.key(name, "__3_0.distcp"), 50)
    assert _codes(store.verify(name, top)) == {("digest_mismatch", "__3_0.distcp", 3)}
    assert [(r["code"], r["file"]) for r in store.fetch(name, top, tmp_path / "copy2")] == [
        ("digest_mismatch", "__3_0.distcp")
    ]


def test_an_altered_or_missing_node_manifest_object_fails_the_check(run):  # noqa: F811
    store = _store(run)
    name = layout.attempt_dirname(3, "n")
    top = _two_node_attempt(run, store, name)
    _flip(run, store.key(name, NODES[1]), 10)
    ev = store.verify(name, top)
    assert ev["status"] == "fail"
    # the node manifest fails itself; its node's shards, vouched for by nothing now, are unexpected
    assert _codes(ev) == {
        ("digest_mismatch", NODES[1], 2),
        ("unexpected_file", "__2_0.distcp", None),
        ("unexpected_file", "__3_0.distcp", None),
    }, ev
    run["fs"].rm_file(store.key(name, NODES[1]))
    assert ("missing_file", NODES[1], 2) in _codes(store.verify(name, top))


def test_settling_a_lost_commit_reads_its_node_manifest_objects(run):  # noqa: F811
    """A save whose coordinator died after the manifest and before the ledger's commit: the next start settles
    the `writing` row from the manifest, verifying through the node manifests (one row per node recorded); a
    save whose node manifest object changed is rejected with it named."""
    from pathlib import Path

    from scout_ckpt import object_store, policy
    from scout_ckpt.format import manifest
    from scout_ckpt.ops.settle import settle_writing
    from tests.test_integration_folders import _dead_owner
    from tests.workers_s3 import options

    store = _store(run)
    ledger_dir = Path(run["ledger"])
    ledger_dir.mkdir(parents=True)
    object_store.bind(ledger_dir, run["uri"], options(run["ep"]))
    object_store.remember(ledger_dir, store)
    with Ledger.open(ledger_dir, create=True) as led:
        for step, attempt in ((3, "n"), (5, "m")):
            name = layout.attempt_dirname(step, attempt)
            led.record_writing(step, "r", attempt, name, owner=_dead_owner())
            top = _two_node_attempt(run, store, name, step)
            m = manifest.build(
                step=step,
                run_id="r",
                attempt=attempt,
                world_size=4,
                topology={},
                policy={"require": ["bytes"], "allow_not_applicable": []},
                files=top,
                evidence={"bytes": policy.evidence(policy.PASS)},
                verdict={"state": "certified", "reasons": []},
            )
            store.publish_manifest(name, manifest.encode(m))
        _flip(run, store.key(layout.attempt_dirname(5, "m"), NODES[1]), 10)
        settled = settle_writing(led, ledger_dir, source="startup", store=store)
        assert {s["step"]: (s["after"], s["why"]) for s in settled} == {
            3: ("certified", "completed_from_manifest"),
            5: ("rejected", "save_interrupted"),
        }
        assert [(f["path"], f["rank"]) for f in led.files(3)] == [(DCP_METADATA, 0), (NODES[0], 0), (NODES[1], 2)]
        assert led.checkpoint(3)["bytes"] == _held(run, store, layout.attempt_dirname(3, "n"))
        assert ("digest_mismatch", NODES[1]) in {(r["code"], r.get("file")) for r in led.checkpoint(5)["reasons"]}


def test_a_node_manifest_that_cannot_be_read_now_is_could_not_check_not_damage():
    def unreachable(rel: str) -> bytes:
        raise TimeoutError(errno.ETIMEDOUT, "connect timed out")

    top = [{"path": NODES[0], "size": 10, "digest": "xxh3_128:00", "rank": 0}]
    files, reasons, unchecked = fm.expand(None, top, read=unreachable)
    assert (files, reasons) == (top, [])
    assert [(u["code"], u["errno"], u["file"]) for u in unchecked] == [("could_not_check", "ETIMEDOUT", NODES[0])]


# ---- a real job: 4 gloo ranks laid out as two torchrun nodes, on s3:// ---------------------------------------


def _rows(ledger_dir) -> dict:
    with Ledger.open(ledger_dir, readonly=True) as led:
        return {
            r["step"]: (
                r["state"],
                r["path"],
                r["bytes"],
                [(f["path"], f["size"], f["digest"], f["rank"]) for f in led.files(r["step"])],
            )
            for r in led.checkpoints()
        }


@pytest.mark.scenario
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_two_nodes_on_s3_save_a_row_per_node_and_every_byte_check_reads_through_it(run, async_save):  # noqa: F811
    store = _store(run)
    out = run_ranks(wn.save_on_two_nodes, 4, run["uri"], run["ledger"], run["ep"], async_save, timeout=300, env=CREDS)
    saved = out[0].result["saved"]
    for o in out:
        if not async_save:  # an async save's verdict comes later: the ledger's states below
            assert o.result["verdicts"] == {2: "certified", 4: "certified"}, o.result
        assert o.result["saved"] == saved  # replicated (DDP) state: one digest per step across the ranks
    rows = _rows(run["ledger"])
    assert {s: r[0] for s, r in rows.items()} == {2: "certified", 4: "certified"}
    assert {s: [(p, r) for p, _, _, r in r_[3]] for s, r_ in rows.items()} == {
        s: [(DCP_METADATA, 0), (NODES[0], 0), (NODES[1], 2)] for s in (2, 4)
    }
    (a4,) = store.committed()[4]
    node1 = json.loads(run["fs"].cat_file(store.key(a4, NODES[1])))
    assert [(f["path"], f["rank"]) for f in node1["files"]] == [("__2_0.distcp", 2), ("__3_0.distcp", 3)]
    top, _ = store.read_manifest(a4)
    assert top["evidence"]["bytes"]["files"] == 5  # four shards and .metadata, counted through the node rows
    assert rows[4][2] == _held(run, store, a4)

    _cli(run, "certify", run["ledger"], "--all", "--json", check_rc=0)
    # export reads the shards its node manifests list: step 4's weights as the job held them (its own digest).
    # In process, as tests/test_s3.py does (the CLI is this call on the bound store).
    from safetensors.torch import load_file

    from scout_ckpt.ops.export import export
    from tests.workers_s3 import digest

    dest = os.path.join(os.path.dirname(run["ledger"]), "export")
    os.mkdir(dest)
    export(run["ledger"], 4, f"{dest}/m.safetensors")
    assert digest(load_file(f"{dest}/m.safetensors")) == out[0].result["models"][4]
    # the ledger rebuilt from the bucket alone: the same rows, one per node
    shutil.rmtree(run["ledger"])
    _cli(run, "ledger", "rebuild", run["ledger"], "--uri", run["uri"], "--json", check_rc=0)
    assert _rows(run["ledger"]) == rows

    # a flipped bit in rank 3's object: certify names the object and the rank; resume and the job walk back
    _flip(run, store.key(a4, "__3_0.distcp"), 200)
    rc, stdout, _ = _cli(run, "certify", run["ledger"], "--step", "4", "--json")
    assert rc == 1
    reasons = [r for s in json.loads(stdout)["results"] for r in s["reasons"]]
    assert ("digest_mismatch", "__3_0.distcp", 3) in {(r["code"], r.get("file"), r.get("rank")) for r in reasons}
    rc, stdout, err = _cli(run, "resume", run["ledger"], "--latest-clean", "--json")
    assert rc == 0, err
    assert json.loads(stdout)["step"] == 2
    out = run_ranks(wn.load_on_two_nodes, 4, run["uri"], run["ledger"], run["ep"], timeout=300, env=CREDS)
    assert [(o.result["step"], o.result["digest"]) for o in out] == [(2, saved[2])] * 4

    # a flipped byte in a node manifest object fails the step that holds it
    (a2,) = store.committed()[2]
    _flip(run, store.key(a2, NODES[0]), 20)
    rc, stdout, _ = _cli(run, "certify", run["ledger"], "--step", "2", "--json")
    assert rc == 1
    reasons = [r for s in json.loads(stdout)["results"] for r in s["reasons"]]
    assert ("digest_mismatch", NODES[0]) in {(r["code"], r.get("file")) for r in reasons}
