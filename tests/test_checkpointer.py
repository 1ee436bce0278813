"""Real 3-4 rank gloo jobs: round trips, resharding, and SIGKILL at every point of a save."""

import pytest

from scout_ckpt.format.layout import list_step_dirs, list_tmp_dirs
from scout_ckpt.ledger import Ledger
from scout_ckpt.ops.recovery import verify_checkpoint
from scout_ckpt.testing.launch import run_ranks
from tests import workers_ckpt as w
from tests.conftest import run_cli


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_ddp_round_trip_is_bitwise(tmp_path, async_save):
    out = run_ranks(w.save_and_reload, 3, str(tmp_path), async_save, timeout=120)
    for o in out:
        assert o.result["equal"], "reloaded state differs from saved state"
        assert o.result["loaded_step"] == 4
        assert o.result["crc_after"] is True, "a save left torch.save's CRC option off"
    with Ledger.open(tmp_path, readonly=True) as led:
        rows = led.checkpoints()
        assert [(r["step"], r["state"]) for r in rows] == [(3, "certified"), (4, "certified")]
        files = led.files(4)
        # every rank hashed what it wrote; the coordinator also wrote .metadata
        assert {f["path"]: f["rank"] for f in files} == {
            ".metadata": 0,
            "__0_0.distcp": 0,
            "__1_0.distcp": 1,
            "__2_0.distcp": 2,
        }, files
        for r in rows:
            assert verify_checkpoint(tmp_path, led, r["step"])["status"] == "pass"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_fsdp2_round_trip_and_reshard(tmp_path, async_save):
    saved = run_ranks(w.fsdp_save, 4, str(tmp_path), async_save, timeout=120)
    assert saved[0].result["mode"] == "fsdp"
    ref = saved[0].result["full"]
    for world in (4, 2):  # same layout, then resharded onto 2 ranks
        loaded = run_ranks(w.fsdp_load, world, str(tmp_path), timeout=120)
        got = loaded[0].result
        assert got["step"] == 3
        assert sorted(got["full"]) == sorted(ref)
        for k in ref:
            assert got["full"][k].equal(ref[k]), k


POINTS = [
    ("before_write", 1),
    ("during_write", 1),
    ("during_write", 0),
    ("after_write", 2),
    ("before_rename", 0),
    ("after_rename", 0),
]


@pytest.mark.parametrize("point,victim", POINTS, ids=[f"{p}-rank{v}" for p, v in POINTS])
def test_sigkill_during_save_never_leaves_a_bad_checkpoint(tmp_path, point, victim):
    out = run_ranks(w.crash_during_save, 3, str(tmp_path), point, victim, 4, timeout=90, allow_failures=True)
    assert out[victim].exitcode == -9
    # After the crash: the ledger opens, every step-* directory verifies.
    with Ledger.open(tmp_path, readonly=True) as led:
        states = {r["step"]: r["state"] for r in led.checkpoints()}
        assert states[2] == "certified"
        for step in list_step_dirs(tmp_path):
            if states.get(step) == "certified":
                assert verify_checkpoint(tmp_path, led, step)["status"] == "pass"
    step4_dir_exists = 4 in list_step_dirs(tmp_path)
    assert step4_dir_exists == (point == "after_rename")
    # The restarted job settles the interrupted save and resumes from the newest certified step.
    res = run_ranks(w.resume_after_crash, 3, str(tmp_path), timeout=90)
    expected = 4 if point == "after_rename" else 2  # renamed + manifest: completed from the manifest
    assert all(o.result["loaded"] == expected for o in res)
    assert res[0].result["verdict"]["state"] == "certified"
    assert list_tmp_dirs(tmp_path) == []
    with Ledger.open(tmp_path, readonly=True) as led:
        row4 = led.checkpoint(4)
        if point == "after_rename":
            assert row4["state"] == "certified"
        else:
            assert row4["state"] == "rejected"
            assert row4["reasons"][0]["code"] == "save_interrupted"


def test_nonfinite_state_is_rejected_by_the_writing_rank(tmp_path):
    out = run_ranks(w.save_nonfinite, 3, str(tmp_path), timeout=60)
    assert all(o.result["broadcast_ok"] for o in out)
    assert all(o.result["raised"] == [True, True] for o in out)  # LiveStateCorrupt on every rank, by default
    assert all(o.result["reloaded"] == 1 for o in out)
    assert out[0].result["good"]["state"] == "certified"
    bad = out[0].result["bad"]
    assert bad["state"] == "rejected"
    reason = bad["reasons"][0]
    assert reason["code"] == "invariant_failed" and reason["check"] == "finite"
    assert reason["tensors"] == ["model.2.weight"] and len(reason["ranks"]) == 1
    assert out[0].result["big_ok"]["state"] == "certified"
    big = out[0].result["big_bad"]
    assert big["state"] == "rejected"
    finite = [r for r in big["reasons"] if r["code"] == "invariant_failed" and r["check"] == "finite"]
    assert sorted(t for r in finite for t in r["tensors"]) == ["big.a", "big.b", "big.c"], big  # not big.d
    assert all(len(r["ranks"]) == 1 for r in finite)  # each named by the rank that wrote it
    with Ledger.open(tmp_path, readonly=True) as led:
        assert led.latest()["step"] == 3


def test_load_mismatch_rejects_and_walks_back_absent_keys_are_the_callers_error(ckpt_root):
    import json
    import sqlite3

    from scout_ckpt.format.digests import bytes_digest

    tmp_path = ckpt_root  # certified checkpoints at steps 3 and 4 (tests/conftest.py)
    # The caller's state has no place for the saved optimizer moments: a clear error, the checkpoint stays.
    out = run_ranks(w.load_into, 3, str(tmp_path), False, timeout=60)
    assert all(o.result["error"] and "no place in the state" in o.result["error"] for o in out)
    with Ledger.open(tmp_path, readonly=True) as led:
        assert led.checkpoint(4)["state"] == "certified"
    # A recorded signature that does not match what DCP loads (as a resharding or loader bug would produce),
    # with the ledger's manifest digest updated so that the bytes still verify: the loaded values are what differ.
    mpath = tmp_path / "step-00000004" / "scout-manifest.json"
    m = json.loads(mpath.read_text())
    key = next(k for k in m["signatures"] if k.endswith("exp_avg"))
    m["signatures"][key] = m["signatures"][key][:-4] + ("0000" if not m["signatures"][key].endswith("0000") else "1111")
    mpath.write_text(json.dumps(m))
    c = sqlite3.connect(tmp_path / "scout-ledger.db")
    c.execute("UPDATE checkpoints SET manifest_digest=? WHERE step=4", (bytes_digest(mpath.read_bytes()),))
    c.commit()
    c.close()
    out = run_ranks(w.load_into, 3, str(tmp_path), True, timeout=60)
    assert all(o.result == {"step": 3, "error": None} for o in out)  # walked back in the same call
    with Ledger.open(tmp_path, readonly=True) as led:
        row = led.checkpoint(4)
        assert row["state"] == "rejected"
        assert row["reasons"] == [{"code": "load_mismatch", "tensors": [key], "count": 1}]
        assert [e["step"] for e in led.events(("load_mismatch",))] == [4]
        assert led.latest("certified")["step"] == 3
    from scout_ckpt.ledger import journal

    assert any(
        r["step"] == 4 and r.get("state") == "rejected" and r["reasons"][0]["code"] == "load_mismatch"
        for r in journal.read(tmp_path)
    )


def test_fsdp_with_only_finite_is_never_certified(tmp_path):
    """No replicas and only `finite`: nothing vouches for single-owner shards, so fail closed."""
    out = run_ranks(w.fsdp_save_unvouched, 3, str(tmp_path), ["finite"], timeout=120)
    assert out[0].result["state"] == "committed"
    assert out[0].result["reasons"] == [{"code": "consensus_not_applicable", "kind": "consensus"}]


@pytest.mark.slow
def test_retention_with_replay_pending_keeps_latest_clean_advancing(tmp_path):
    """keep=1 and keep=2 used to delete the checkpoints still waiting for replay coverage, so latest clean stopped
    advancing. The oracle: the same deterministic run without retention."""
    out = run_ranks(w.retention_under_replay, 2, str(tmp_path), timeout=400)[0].result
    unlimited = out[None]
    assert unlimited["latest"] is not None and unlimited["latest"] >= 40, unlimited
    for keep in (1, 2):
        got = out[keep]
        assert got["latest"] == unlimited["latest"], (keep, got)
        assert got["errors"] == []
        certified = sorted(s for s, st in got["states"].items() if st == "certified")
        assert certified == sorted(s for s, st in unlimited["states"].items() if st == "certified")[-keep:]
        # Kept: the newest `keep` certified and everything newer still awaiting evidence; nothing else.
        newer = [s for s in got["on_disk"] if s > got["latest"]]
        assert got["on_disk"] == certified + newer
        assert all(got["states"][s] == "committed" for s in newer)


def test_bookkeeping_errors_after_the_rename_never_fail_the_save(tmp_path):
    out = run_ranks(w.bookkeeping_errors, 2, str(tmp_path), env={"SCOUT_CKPT_BUSY_TIMEOUT": "1"}, timeout=180)
    for o in out:
        assert {s: v["state"] for s, v in o.result["verdicts"].items()} == {
            1: "certified",
            2: "certified",
            3: "certified",
            4: "certified",
            5: "certified",
        }
        assert o.result["refused"].startswith("SaveRefused") and "quarantined" in o.result["refused"]
    with Ledger.open(tmp_path, readonly=True) as led:
        states = {r["step"]: r["state"] for r in led.checkpoints()}
        # step 3's ledger commit was retried at the next save; the quarantine stood and retention kept it
        assert states == {1: "deleted", 2: "deleted", 3: "certified", 4: "quarantined", 5: "certified"}
        errors = {(e["step"], e["detail"]["what"]) for e in led.events(("bookkeeping_error",))}
        assert errors == {(2, "retention"), (3, "ledger_commit")}
    assert sorted(list_step_dirs(tmp_path)) == [3, 4, 5]


def test_second_process_on_the_same_root_leaves_a_live_save_intact(tmp_path):
    import threading
    import time

    root, signals = tmp_path / "run", tmp_path / "signals"
    signals.mkdir()
    result = {}
    job = threading.Thread(
        target=lambda: result.update(out=run_ranks(w.paused_save, 2, str(root), str(signals), timeout=400))
    )
    job.start()
    try:
        deadline = time.monotonic() + 300
        while len(list(signals.glob("paused-*"))) < 2 and time.monotonic() < deadline and job.is_alive():
            time.sleep(0.1)
        (tmp,) = list_tmp_dirs(root)
        before = sorted(p.name for p in tmp.iterdir())
        loaded = run_ranks(w.open_and_load, 1, str(root), timeout=120)[0].result
        assert loaded == 1  # step 2 is still being written
        assert tmp.is_dir() and sorted(p.name for p in tmp.iterdir()) == before
        with Ledger.open(root, readonly=True) as led:
            assert led.checkpoint(2)["state"] == "writing"
    finally:
        (signals / "go").touch()
        job.join(400)
    assert [v["state"] for v in result["out"][0].result] == ["certified", "certified"]
    assert list_tmp_dirs(root) == []
    with Ledger.open(root, readonly=True) as led:
        assert led.checkpoint(2)["state"] == "certified"


def test_staging_cache_reuses_its_copy_only_for_the_same_layout():
    """Async saves stage into one host copy kept between saves (storage.StagingCache): each staging holds the
    current values, scalars are taken fresh, and a change of layout (shape, dtype, keys) gets a new copy instead of
    a silent broadcast or conversion by copy_."""
    import torch

    from scout_ckpt.save.storage import StagingCache

    cache = StagingCache()
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 1, "extra": [torch.ones(2), None]}
    a = cache.stage(state)
    assert a["model"]["w"].equal(state["model"]["w"]) and a["step"] == 1
    assert a["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()  # a copy, not a view
    state["model"]["w"].add_(1)
    state["step"] = 2
    b = cache.stage(state)
    assert b["model"]["w"].data_ptr() == a["model"]["w"].data_ptr()  # the same buffer, refilled
    assert b["model"]["w"].equal(state["model"]["w"]) and b["step"] == 2
    for changed in (
        {"model": {"w": torch.zeros(1)}, "step": 3, "extra": [torch.ones(2), None]},
        {"model": {"w": torch.zeros(2, 3, dtype=torch.float64)}, "step": 3, "extra": [torch.ones(2), None]},
        {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}, "step": 3, "extra": [torch.ones(2), None]},
    ):
        c = cache.stage(changed)
        assert c["model"].keys() == changed["model"].keys()
        for k, v in changed["model"].items():
            got = c["model"][k]
            assert got.dtype == v.dtype and got.shape == v.shape and got.equal(v)


def test_zip_crc_is_off_only_while_writers_write_and_torch_load_never_checked_it():
    """The POSIX writer turns torch.save's per-record CRC32 off while DCP writes (storage._without_zip_crc): torch
    computes it at about 1 GB/s and never checks it, while the file digests, computed as the bytes are written,
    are checked before every load. The option is thread-local: other threads keep computing it."""
    import io
    import threading

    import torch

    from scout_ckpt.save.storage import _without_zip_crc

    t = torch.arange(1000, dtype=torch.float32)
    buf = io.BytesIO()
    torch.save(t, buf)
    raw = bytearray(buf.getvalue())
    raw[raw.find(t[500].numpy().tobytes())] ^= 1
    # why the CRC is no evidence: a record with a flipped bit loads silently
    assert not torch.load(io.BytesIO(bytes(raw))).equal(t)
    assert torch.serialization.get_crc32_options() is True
    seen = []
    with _without_zip_crc():
        assert torch.serialization.get_crc32_options() is False
        th = threading.Thread(target=lambda: seen.append(torch.serialization.get_crc32_options()))
        th.start()
        th.join()
        buf = io.BytesIO()
        torch.save(t, buf)
    assert seen == [True]  # another thread's torch.save is untouched
    assert torch.serialization.get_crc32_options() is True  # and this thread's setting is back
    assert torch.load(io.BytesIO(buf.getvalue())).equal(t)  # written without the CRC, loads as before


def test_a_failed_async_save_is_settled_when_it_fails(tmp_path):
    out = run_ranks(w.async_save_fails, 2, str(tmp_path), timeout=120)
    for o in out:
        assert "injected write failure at step 2 on rank 1" in (o.result["error"] or ""), o.result
    r = out[0].result
    assert r["row"]["state"] == "rejected" and r["row"]["reasons"][0]["code"] == "commit_failed", r["row"]
    assert r["temps"] == []  # its temp dir went with it, before the next start
    assert r["states"] == {1: "certified", 2: "rejected", 3: "certified"}, r["states"]


def test_two_checkpointers_in_one_process_share_its_observer_and_both_certify(tmp_path):
    """A teacher and a student (two models, two ROOTs) in one process with the defaults: the second Checkpointer
    shares the observer the first started (one per process: it wraps the process's collectives), and every save
    of both is certified."""
    out = run_ranks(w.two_checkpointers, 2, str(tmp_path), timeout=300)
    for o in out:
        assert o.result["shared"], o.result
        assert o.result["verdicts"] == [("certified", "certified")] * 2, o.result


def test_one_rank_with_the_defaults_certifies_on_bytes_and_says_what_it_cannot_check(tmp_path):
    """One process (a single-GPU job): no replica to compare, no peer to replay on. Its saves are certified on their
    bytes and finite checks, resumed bit for bit (the values the job held when it saved), consensus recorded
    not_applicable, and `resume --require consensus` refuses them (the gap is the user's to accept)."""
    out = run_ranks(w.save_and_reload, 1, str(tmp_path), False, timeout=120)[0].result
    assert [v["state"] for v in out["verdicts"]] == ["certified", "certified"]
    assert out["loaded_step"] == 4 and out["equal"] is True
    with Ledger.open(tmp_path, readonly=True) as led:
        assert led.evidence(4)["consensus"]["status"] == "not_applicable"
    assert run_cli("resume", str(tmp_path), "--latest-clean", "--require", "consensus")[0] == 1
    assert run_cli("resume", str(tmp_path), "--latest-clean")[1].strip().endswith("step-00000004")


def test_a_sweep_that_fails_beside_the_write_publishes_nothing_and_the_next_save_works(tmp_path):
    """The replay sweep of a sync save runs beside DCP's write; when it fails, every rank raises its error after the
    write, the attempt is rejected (`commit_failed`) and its temp dir removed at once, and the next save certifies."""
    out = run_ranks(w.sweep_fails_beside_the_write, 2, str(tmp_path), timeout=180)
    assert [o.result["failed"] for o in out] == ["sweep broke at 1", "sweep broke at 1"]
    assert [o.result["second"] for o in out] == ["certified", "certified"]
    assert list(list_step_dirs(tmp_path)) == [2]
    assert list_tmp_dirs(tmp_path) == []
    with Ledger.open(tmp_path, readonly=True) as led:
        first = led.checkpoint(1)
    assert first["state"] == "rejected"
    assert [r["code"] for r in first["reasons"]] == ["commit_failed"]
    assert "sweep broke at 1" in first["reasons"][0]["detail"]
