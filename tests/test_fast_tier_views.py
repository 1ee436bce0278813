"""The fast tier in the command line: `ls`, `explain`, `report` and `ledger rebuild` on a real local-tier run.

The run (built once, tests/workers_fast_tier_views.py): a user's DDP job on 2 real gloo ranks, each rank its own
"node" (LOCAL_WORLD_SIZE=1) with its own node-local directory, so each rank's file has a peer copy on the other;
local saves at steps 2, 4, 6 and a durable save at 2; then one bit of both copies of rank 1's step-6 file is
flipped and a second incarnation loads (step 6 rejected, event local_rejected; it walks back to local step 4).

Oracles independent of the code under test: what the ranks read back from their own files right after the save
(sha256, path, size), xxhash computed here over the bytes on disk, the bits this test flipped, the files this
test removed. Every command runs as a real CLI subprocess on the real SQLite ledger.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import xxhash

from tests.conftest import run_cli

STEPS = (2, 4, 6)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    from scout_ckpt.testing.launch import run_ranks
    from tests import workers_fast_tier_views as w

    top = tmp_path_factory.mktemp("fast-tier-views")
    out = run_ranks(
        w.local_tier_job, 2, str(top / "run"), str(top / "local"), env={"LOCAL_WORLD_SIZE": "1"}, timeout=240
    )
    seen = {o.rank: o.result for o in out}
    assert all(r["loaded"] == 4 and r["tier"] == "local" for r in seen.values()), seen  # the walk-back happened
    return {"root": top / "run", "base": top / "local", "ranks": seen, "run_id": seen[0]["run_id"]}


def _flat(text: str) -> str:
    """The text without whitespace: rich wraps long lines (paths) at the console's width."""
    return "".join(text.split())


def _xxh(path: Path) -> str:
    return "xxh3_128:" + xxhash.xxh3_128_hexdigest(path.read_bytes())


def _peer(local_run, step: int, owner: int) -> Path:
    return local_run["base"] / f"node-{1 - owner}" / local_run["run_id"] / f"step-{step:08d}" / f"peer-rank-{owner}.pt"


def _db(root: Path) -> bytes:
    return (root / "scout-ledger.db").read_bytes()


def test_ls_lists_local_steps_beside_durable_ones_with_where_each_copy_lives(local_run):
    root, ranks = local_run["root"], local_run["ranks"]
    rc, out, err = run_cli("ls", root, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["source"] == "ledger" and doc["fallback"] is None, err
    # the durable rows are unchanged (the same keys), tagged with their tier
    assert [(r["step"], r["state"], r["tier"]) for r in doc["checkpoints"]] == [(2, "certified", "durable")]
    assert {"step", "state", "path", "bytes", "evidence", "reasons"} <= set(doc["checkpoints"][0])
    local = {r["step"]: r for r in doc["local"]}
    assert {s: r["state"] for s, r in local.items()} == {2: "certified", 4: "certified", 6: "rejected"}
    assert all(r["tier"] == "local" for r in local.values())
    for step in (2, 4):
        files = {f["rank"]: f for f in local[step]["files"]}
        copies = {c["rank"]: c for c in local[step]["copies"]}
        for rank, seen in ranks.items():
            own = Path(seen["own"][step]["path"])
            assert Path(files[rank]["path"]) == own and files[rank]["host"] == seen["host"]
            assert files[rank]["digest"] == _xxh(own) and files[rank]["size"] == own.stat().st_size
            # the peer copy is on the other "node", holds the owner's bytes, and is recorded as verified
            peer = _peer(local_run, step, rank)
            assert Path(copies[rank]["path"]) == peer and copies[rank]["holder"] == 1 - rank
            assert copies[rank]["verified"] is True
            assert hashlib.sha256(peer.read_bytes()).hexdigest() == seen["own"][step]["sha256"]
    assert local[6]["reasons"][0]["code"] == "digest_mismatch"

    rc, out, _ = run_cli("ls", root)
    assert rc == 0
    lines = [line.split() for line in out.splitlines()]
    assert ["2", "durable", "certified"] in [x[:3] for x in lines]
    assert {(x[0], x[2]) for x in lines if x[1:2] == ["local"]} == {
        ("2", "certified"),
        ("4", "certified"),
        ("6", "rejected"),
    }
    flat = _flat(out)
    base = local_run["base"]
    assert _flat("Local step 4 (certified, saved 20") in flat
    assert (
        _flat(
            f"{local_run['run_id']}/step-00000004 in each node's local directory: rank 0 on {ranks[0]['host']} "
            f"in {base / 'node-0'}, its copy held by rank 1 on {ranks[1]['host']} in {base / 'node-1'} "
            f"(verified at save); rank 1 on {ranks[1]['host']} in {base / 'node-1'}, its copy held by rank 0 on "
            f"{ranks[0]['host']} in {base / 'node-0'} (verified at save)."
        )
        in flat
    )


def test_explain_says_what_a_local_save_showed_and_both_tiers_when_both_hold_the_step(local_run):
    root, ranks = local_run["root"], local_run["ranks"]
    rc, out, err = run_cli("explain", root, "4")
    assert rc == 0, err
    flat = _flat(out)
    assert _flat("Local tier: step 4 is certified.") in flat
    for rank, seen in ranks.items():  # each rank's digest, as xxhash computes it over the file on disk
        assert _flat(f"rank {rank} {_xxh(Path(seen['own'][4]['path']))}") in flat
    assert _flat("Consensus: pass") in flat and _flat("every rank's state was finite") in flat
    assert _flat(f"rank 0 on host {ranks[0]['host']} holds a copy at {_peer(local_run, 4, 1)}, verified") in flat
    assert "Both tiers" not in out

    rc, out, err = run_cli("explain", root, "2", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["tiers"] == ["durable", "local"] and doc["tier"] == "durable", err
    assert doc["state"] == "certified" and doc["path"] == "step-00000002" and "bytes" in doc["evidence"]
    assert doc["local"]["state"] == "certified" and doc["local"]["peer_copies"]["ranks_without_verified_copy"] == []

    rc, out, err = run_cli("explain", root, "6")
    assert rc == 1 and err.strip().splitlines() == [
        "scout-ckpt: step 6 is rejected in the local tier: digest_mismatch[ranks 1]"
    ], err
    assert _flat("a restart re-verified the step and rejected it (local_rejected)") in _flat(out)

    before = _db(root)
    rc, out, err = run_cli("explain", root, "5")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "neither tier" in err, err
    assert _db(root) == before


def test_resume_names_certified_local_steps_newer_than_its_durable_answer(local_run):
    rc, out, err = run_cli("resume", local_run["root"], "--latest-clean", "--json")
    doc = json.loads(out)
    assert rc == 0 and (doc["step"], doc["tier"]) == (2, "durable"), err
    # local step 4 is what the job's second incarnation loaded (local step 6 was rejected at that restart)
    assert [r["step"] for r in doc["local_newer"]] == [local_run["ranks"][0]["loaded"]] == [4]
    assert "newer local step(s) 4 certified in the fast tier" in err


def test_report_counts_local_saves_and_rejections(local_run):
    rc, out, err = run_cli("report", local_run["root"], "--json")
    doc = json.loads(out)
    assert rc == 0, err
    local = doc["local"]
    assert (local["saves"], local["rejected"], local["rejected_at_restart"]) == (3, 1, 1), local
    assert [(s["step"], s["state"]) for s in local["steps"]] == [(2, "certified"), (4, "certified"), (6, "rejected")]
    assert doc["summary"].get("local_rejected") == 1
    rc, out, _ = run_cli("report", local_run["root"])
    assert rc == 0 and _flat(
        "Local tier: 3 step(s) saved (2 certified, 1 rejected); 1 now rejected; 1 rejection(s) "
        "when a restart re-verified the files"
    ) in _flat(out)


def _copy(local_run, tmp_path) -> tuple[Path, Path]:
    root, base = tmp_path / "run", tmp_path / "local"
    shutil.copytree(local_run["root"], root)
    shutil.copytree(local_run["base"], base)
    return root, base


def _local_states(result: dict) -> dict[int, tuple[str, list[str]]]:
    return {r["step"]: (r["state"], [x["code"] for x in r["reasons"]]) for r in result["local"]["rows"]}


def test_ledger_rebuild_restores_local_rows_and_never_certifies_what_it_could_not_check(local_run, tmp_path):
    root, base = _copy(local_run, tmp_path)
    run = local_run["run_id"]
    nodes = [str(base / "node-0"), str(base / "node-1")]

    # bad input: one line, exit 2, nothing written (no .bak, the ledger byte for byte)
    before = _db(root)
    rc, out, err = run_cli("ledger", "rebuild", root, "--local-dir", base / "nope")
    assert (
        rc == 2
        and out == ""
        and err.strip().splitlines() == [f"scout-ckpt: error: --local-dir {base / 'nope'}: no such directory"]
    ), err
    assert _db(root) == before and not list(root.glob("scout-ledger.db.bak*"))

    # only node 0's directory, from which rank 1's copy of step 4 is gone: step 4 cannot be checked (exit 1)
    (base / "node-0" / run / "step-00000004" / "peer-rank-1.pt").unlink()
    rc, out, err = run_cli("ledger", "rebuild", root, "--local-dir", nodes[0], "--json")
    res = json.loads(out)
    assert rc == 1 and "could not check local step(s) 4" in err, err
    assert _local_states(res) == {
        2: ("certified", []),
        4: ("committed", ["could_not_check"]),
        6: ("rejected", ["digest_mismatch"]),
    }
    # both directories: every rank's file of step 4 is found again and matches its digest: certified again
    rc, out, err = run_cli("ledger", "rebuild", root, "--local-dir", nodes[0], "--local-dir", nodes[1], "--json")
    assert rc == 0 and _local_states(json.loads(out))[4] == ("certified", []), err

    # one bit of both copies of rank 0's step-2 file: the rebuild finds every copy bad and rejects the local step
    for p in (
        base / "node-0" / run / "step-00000002" / "rank-0.pt",
        base / "node-1" / run / "step-00000002" / "peer-rank-0.pt",
    ):
        data = bytearray(p.read_bytes())
        data[len(data) // 3] ^= 0x01
        p.write_bytes(bytes(data))
    rc, out, err = run_cli("ledger", "rebuild", root, "--local-dir", nodes[0], "--local-dir", nodes[1], "--json")
    res = json.loads(out)
    assert rc == 0 and _local_states(res)[2] == ("rejected", ["digest_mismatch"]), err
    assert res["checkpoints"] == [{"step": 2, "state": "certified", "reasons": []}]  # the durable tier is apart

    # the ledger lost: what is on disk is listed, never certified (no record of the save's digests survives)
    for p in root.glob("scout-ledger.db*"):
        p.unlink()
    rc, out, err = run_cli("ledger", "rebuild", root, "--local-dir", nodes[0], "--local-dir", nodes[1], "--json")
    res = json.loads(out)
    assert rc == 0, err
    assert _local_states(res) == {s: ("committed", ["unverified_after_rebuild"]) for s in STEPS}
    rc, out, _ = run_cli("ls", root, "--json")
    local = {r["step"]: r for r in json.loads(out)["local"]}
    assert {s: r["state"] for s, r in local.items()} == {s: "committed" for s in STEPS}
    assert sorted(Path(f["path"]).name for f in local[4]["files"]) == ["rank-0.pt", "rank-1.pt"]
    assert all(f["digest"] is None for f in local[4]["files"]) and all(
        c["verified"] is None for c in local[4]["copies"]
    )


# ---- end to end (scenario): two torchrun agents as two nodes, the ledger rebuilt from one node's directory ------


@pytest.mark.scenario
def test_rebuilt_local_rows_are_what_a_restarted_job_loads_and_a_lost_ledger_certifies_none(tmp_path):
    """Two agents (tests/test_fast_tier.py's run_agents), 2 workers each, each agent its own local dir; local saves
    every 2 steps (kept: 8 and 10), durable at 6. With the ring's peer copies, node 0's directory alone holds every
    rank's file (its own ranks' and node 1's copies): a rebuild that sees only it re-checks every rank and keeps
    local 8 and 10 certified, and the restarted job loads local step 10 with the digest it printed when it saved
    it. With the ledger lost, the rebuild lists the local steps but certifies none: the next restart takes durable
    step 6, again judged by the job's own digest."""
    from tests.test_fast_tier import _dirs, _ok, job_lines, loads_by_run, run_agents, saved_digests

    root, dirs = tmp_path / "run", _dirs(tmp_path)
    first = run_agents(root, dirs, "--steps", "10", "--save-every", "6", "--local-every", "2")
    _ok(first)
    lines = job_lines(first)
    saved = saved_digests(lines)
    durable = {(e["rank"], e["step"]): e["digest"] for e in lines if e["event"] == "saved"}

    rc, out, err = run_cli("ledger", "rebuild", root, "--local-dir", dirs[0], "--json")
    res = json.loads(out)
    assert rc == 0, err
    assert {s: st for s, (st, _) in _local_states(res).items() if st != "deleted"} == {
        8: "certified",
        10: "certified",
    }, res["local"]
    second = run_agents(root, dirs, "--steps", "11", "--save-every", "6", "--local-every", "2")
    _ok(second)
    loads = loads_by_run(job_lines(second))[0]
    assert sorted(loads) == [0, 1, 2, 3]
    for rank, e in loads.items():
        assert (e["step"], e["tier"]) == (10, "local"), e
        assert e["digest"] == saved[(rank, 10)], (rank, e)

    for p in root.glob("scout-ledger.db*"):
        p.unlink()
    rc, out, err = run_cli("ledger", "rebuild", root, "--local-dir", dirs[0], "--local-dir", dirs[1], "--json")
    res = json.loads(out)
    assert rc == 0, err
    assert {st for st, _ in _local_states(res).values()} == {"committed"}, res["local"]
    third = run_agents(root, dirs, "--steps", "7", "--save-every", "6", "--local-every", "2")
    _ok(third)
    loads = loads_by_run(job_lines(third))[0]
    for rank, e in loads.items():
        assert (e["step"], e["tier"]) == (6, "durable"), e
        assert e["digest"] == durable[(rank, 6)], (rank, e)
