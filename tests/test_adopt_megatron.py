"""`scout-ckpt adopt` of Megatron-Core `iter_NNNNNNN` folders written without scout-ckpt, with and without their
`integrity.json`, and crash consistency of adopt under a real SIGKILL of the CLI.

The folders are real: written by megatron-core 0.16.1's `dist_checkpointing.save` (torch_dist) on 2 gloo ranks
under torchrun by tests/scripts/megatron_plain_job.py, whose integrity.json follows Megatron-LM main's
`save_integrity_manifest` (the script cites the commit) and is written there, independently of scout-ckpt. The
default tier reads the copy kept in tests/data/megatron_plain (2-rank TP=2 saves at iterations 2, 4 and 6, and
the job's own digests in megatron_plain.saved.jsonl): a Megatron job costs some 30 s of CPU here, more than this
tier can spend. Regenerate it with
  python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/megatron_plain_job.py \
      tests/data/megatron_plain --integrity --iters 6 --events tests/data/megatron_plain.saved.jsonl
The scenario at the end writes fresh folders with the installed megatron-core, adopts them, and has Megatron load
the iteration `resume --latest-clean` hands out, judged by the digest the job printed when it saved.

The oracle is what each test did to the folders (a bit flipped after integrity.json was written, a file added or
removed) and the SHA-256 the job wrote; never scout-ckpt's own digests."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from scout_ckpt.integrations import mg_folders  # noqa: F401  registers iter_NNNNNNN (as the CLI does)
from scout_ckpt.ledger import Ledger, journal
from scout_ckpt.ops import adopt_integrity
from scout_ckpt.ops.adopt import HOOK_ENV
from tests.conftest import CLI, REPO, run_cli
from tests.framework_jobs import flip_bit

DATA = REPO / "tests" / "data" / "megatron_plain"
SAVED = {
    r["step"]: r["digest"]
    for r in map(json.loads, (REPO / "tests" / "data" / "megatron_plain.saved.jsonl").read_text().splitlines())
}
TRACKER = mg_folders.TRACKER
INTEGRITY = mg_folders.INTEGRITY


def iter_dir(root: Path, it: int) -> Path:
    return root / f"iter_{it:07d}"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def states(root: Path) -> dict:
    with Ledger.open(root, readonly=True) as led:
        return {r["step"]: r["state"] for r in led.checkpoints()}


@pytest.fixture
def six(tmp_path):
    """The three Megatron saves, and three more made from copies of them (integrity.json names files, not the
    folder, so a copy under another iteration is as Megatron wrote it):
       2 as saved                           -> certified, integrity.json vouches for every file
       4 a bit of rank 1's shard flipped    -> rejected, digest_mismatch naming __1_0.distcp
       6 integrity.json removed (0.16.1)    -> certified on adopt's own digests, as before integrity.json
       8 (= 2) plus a file not listed       -> rejected, unexpected_file
      10 (= 4) a listed shard removed       -> rejected, missing_file
      12 (= 6) integrity.json not JSON      -> certified on adopt's own digests; integrity.json "not used" and why"""
    root = tmp_path / "ck"
    shutil.copytree(DATA, root)
    for src, dst in ((2, 8), (4, 10), (6, 12)):
        shutil.copytree(iter_dir(root, src), iter_dir(root, dst))
    flip_bit(iter_dir(root, 4) / "__1_0.distcp")
    (iter_dir(root, 6) / INTEGRITY).unlink()
    (iter_dir(root, 8) / "notes.txt").write_text("added after the save\n")
    (iter_dir(root, 10) / "__0_1.distcp").unlink()
    (iter_dir(root, 12) / INTEGRITY).write_bytes(b'{"algorithm": "sha256", "files": {')
    return root


def test_the_kept_folders_are_what_megatron_wrote_and_its_integrity_json_lists_them():
    """The test data itself: torch_dist folders, integrity.json's SHA-256 of every other file (hashed here)."""
    for it in (2, 4, 6):
        d = iter_dir(DATA, it)
        assert json.loads((d / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
        listing = json.loads((d / INTEGRITY).read_text())
        assert listing["algorithm"] == "sha256"
        assert listing["files"] == {p.name: sha256(p) for p in sorted(d.iterdir()) if p.name != INTEGRITY}
        assert {".metadata", "common.pt", "__0_0.distcp", "__1_0.distcp"} <= set(listing["files"])
    assert (DATA / TRACKER).read_text() == "6" and sorted(SAVED) == [2, 4, 6]


def test_megatrons_metadata_with_its_cached_save_plans_is_read_by_the_restricted_unpickler():
    """megatron-core's torch_dist writer pickles every rank's local SavePlan into `.metadata` (all_local_plans):
    read through the stand-ins (dcp_meta), never the real pickle; the folder passes the structure check."""
    from scout_ckpt.format import dcp_meta
    from scout_ckpt.format.dcp_files import check_structure, load_metadata

    md = load_metadata(iter_dir(DATA, 2))
    assert [type(p) for p in md.all_local_plans] == [dcp_meta.SavePlan] * 2  # one per rank
    items = [i for p in md.all_local_plans for i in p.items]
    assert {i.index.fqn for i in items} == {"w", "b"} and all(type(i) is dcp_meta.WriteItem for i in items)
    assert {i.type for i in items} <= set(dcp_meta.WriteItemType)
    assert check_structure(iter_dir(DATA, 2))["status"] == "pass"


def test_adopt_checks_every_file_against_integrity_json_and_explain_names_what_vouched(six):
    root = six
    tracker = (root / TRACKER).read_bytes()
    rc, so, se = run_cli("adopt", root, "--json")
    assert rc == 1, so + se  # some folders are not certified
    out = {a["step"]: a for a in json.loads(so)["adopted"]}
    assert {s: a["state"] for s, a in out.items()} == {
        2: "certified",
        4: "rejected",
        6: "certified",
        8: "rejected",
        10: "rejected",
        12: "certified",
    }
    assert all(a["path"] == f"iter_{s:07d}" for s, a in out.items())
    assert [(r["code"], r["file"], r["evidence"]) for r in out[4]["reasons"]] == [
        ("digest_mismatch", "__1_0.distcp", INTEGRITY)
    ]
    assert [(r["code"], r["file"]) for r in out[8]["reasons"]] == [("unexpected_file", "notes.txt")]
    assert ("missing_file", "__0_1.distcp", INTEGRITY) in [
        (r["code"], r.get("file"), r.get("evidence")) for r in out[10]["reasons"]
    ]
    assert "Traceback" not in se and se.count("\n") == 1  # one line: the first step not certified

    with Ledger.open(root, readonly=True) as led:
        ev = {s: led.evidence(s) for s in out}
        run = led.runs()[-1]
    assert ev[2]["integrity"]["status"] == "pass" and ev[2]["integrity"]["listed"] == 6
    assert "integrity" not in ev[6] and ev[6]["bytes"]["status"] == "pass"  # as before integrity.json
    assert ev[12]["integrity"]["status"] == "not_applicable" and ev[12]["integrity"]["used"] is False
    assert ev[12]["integrity"]["reasons"][0]["code"] == "integrity_not_used"
    assert run["policy"]["require"] == ["bytes", "structure", "invariants"]
    m = json.loads((iter_dir(root, 2) / "scout-manifest.json").read_text())
    assert m["layout"] == "megatron" and m["iteration"] == 2 and m["adopted"] is True
    assert {f["path"] for f in m["files"]} == set(json.loads((iter_dir(DATA, 2) / INTEGRITY).read_text())["files"]) | {
        INTEGRITY
    }

    rc, text, _ = run_cli("explain", root, 2)
    assert (
        rc == 0 and "vouched for by: integrity.json: SHA-256 of 6 file(s) written at save, every file matched" in text
    ), text
    rc, text, _ = run_cli("explain", root, 12)
    assert rc == 0 and "not used: integrity.json: not JSON" in text, text
    assert ev[6]["bytes"]["vouched_by"].startswith("adopt's own digests")

    # certify re-checks bytes and invariants of the DCP folders; the rejected ones stay rejected
    rc, so, se = run_cli("certify", root, "--json")
    assert rc == 1, so + se
    assert states(root) == {s: a["state"] for s, a in out.items()}
    rc, so, se = run_cli("resume", root, "--latest-clean", "--json")
    assert rc == 0 and json.loads(so)["step"] == 12 and json.loads(so)["path"].endswith("iter_0000012"), so + se
    assert (root / TRACKER).read_bytes() == tracker  # adopt leaves Megatron-LM's tracker alone
    assert mg_folders.latest_clean_iteration(root) == 12


@pytest.mark.parametrize(
    "content, why",
    [
        (b"\xff\xfe garbage", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"algorithm": "md5", "files": {"a": "00"}}', "algorithm md5 is not sha256"),
        (b'{"algorithm": "sha256"}', 'no "files" object'),
        (b'{"algorithm": "sha256", "files": {}}', "it lists no files"),
        (b'{"files": {"a": "abc"}}', "the digest of a is not a SHA-256 hex string"),
        (b'{"files": {"../a": "' + b"0" * 64 + b'"}}', "a file name that is not a plain relative path"),
        (b'{"files": {"integrity.json": "' + b"0" * 64 + b'"}}', "it lists itself"),
        (b'{"files": {"a": {"nested": 1}}}', "the digest of a is not a SHA-256 hex string"),
    ],
)
def test_an_unusable_integrity_json_is_not_evidence_and_says_why(tmp_path, content, why):
    (tmp_path / INTEGRITY).write_bytes(content)
    listing = adopt_integrity.read_listing(tmp_path, INTEGRITY)
    assert not listing.usable and listing.present and listing.why.startswith(why), listing
    ev = adopt_integrity.integrity_evidence(listing, None)
    assert ev["status"] == "not_applicable" and ev["not_used"] == f"{INTEGRITY}: {listing.why}"


def test_integrity_json_reading_follows_megatron_and_refuses_what_is_not_a_file(tmp_path):
    a = tmp_path / "a"
    a.write_bytes(b"x")
    # Megatron's verifier reads a missing algorithm as sha256; digests compared case-insensitively
    (tmp_path / INTEGRITY).write_text(json.dumps({"files": {"a": sha256(a).upper()}}))
    listing = adopt_integrity.read_listing(tmp_path, INTEGRITY)
    assert listing.usable and listing.files == {"a": sha256(a)}
    assert adopt_integrity.compare(listing, {"a": sha256(a)}) == ("pass", [])
    status, reasons = adopt_integrity.compare(listing, {"b": sha256(a)})
    assert status == "fail" and [(r["code"], r["file"]) for r in reasons] == [
        ("missing_file", "a"),
        ("unexpected_file", "b"),
    ]
    assert not adopt_integrity.read_listing(tmp_path / "nowhere", INTEGRITY).present
    (tmp_path / INTEGRITY).unlink()
    os.mkfifo(tmp_path / INTEGRITY)  # a FIFO would block a reader for ever
    assert adopt_integrity.read_listing(tmp_path, INTEGRITY).why == f"{INTEGRITY} is not a regular file"
    (tmp_path / INTEGRITY).unlink()
    os.symlink(tmp_path.parent, tmp_path / INTEGRITY)
    assert "outside" in adopt_integrity.read_listing(tmp_path, INTEGRITY).why


# ---- crash consistency: a real SIGKILL of the CLI between the steps of an adopt ----------------------------------


def adopt_killed(root: Path, hook: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), HOOK_ENV: hook}
    return subprocess.run([*CLI, "adopt", str(root)], capture_output=True, text=True, env=env, timeout=300)


def two(tmp_path, bad: bool = True) -> tuple[Path, dict]:
    """iter 2 as saved (healthy) and, with `bad`, iter 4 flipped after its integrity.json; Megatron's tracker;
    the oracle of a finished adopt."""
    root = tmp_path / "ck"
    root.mkdir(parents=True)
    (root / TRACKER).write_text("4")
    for it in (2, 4) if bad else (2,):
        shutil.copytree(iter_dir(DATA, it), iter_dir(root, it))
    if bad:
        flip_bit(iter_dir(root, 4) / "__0_0.distcp")
    return root, ({2: "certified", 4: "rejected"} if bad else {2: "certified"})


def assert_old_or_new(root: Path, oracle: dict) -> None:
    """After a kill: no `writing` row; every row is its folder's manifest's attempt (nothing half-recorded); only
    a healthy folder is ever certified, by the ledger, by `resume --latest-clean` (the library call behind the
    command), and by the manifests + journal view that `ls`/`resume` fall back on without a ledger."""
    from scout_ckpt.errors import NoCleanCheckpoint, NotFound
    from scout_ckpt.ops import disk_view, recovery

    rows = []
    if (root / "scout-ledger.db").exists():
        with Ledger.open(root, readonly=True) as led:
            rows = led.checkpoints()
    assert not [r for r in rows if r["state"] == "writing"], rows
    for r in rows:
        m = json.loads((root / r["path"] / "scout-manifest.json").read_text())
        assert m["attempt"] == r["attempt"] and r["state"] == oracle[r["step"]], (r, m["attempt"])
    for latest in (recovery.latest_clean, disk_view.latest_clean):
        try:
            step = latest(root)["step"]
        except (NotFound, NoCleanCheckpoint):
            step = None
        assert step is None or oracle[step] == "certified", (latest, step)


def assert_finished(root: Path, oracle: dict) -> None:
    from scout_ckpt.ops import recovery

    assert states(root) == oracle
    records = journal.read(root)
    with Ledger.open(root, readonly=True) as led:
        for r in led.checkpoints():  # the journal holds each verdict, for a ledger rebuilt from it later
            assert journal.standing(records, r["step"], r["manifest_digest"])["state"] == r["state"]
    assert recovery.latest_clean(root)["step"] == max(s for s, v in oracle.items() if v == "certified")


def test_adopt_killed_after_writing_a_manifest_is_finished_by_the_next_adopt(tmp_path):
    root, oracle = two(tmp_path, bad=False)
    tracker = (root / TRACKER).read_bytes()
    p = adopt_killed(root, "kill:manifest:2")  # manifest of iter 2 written, nothing in the ledger yet
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    assert (iter_dir(root, 2) / "scout-manifest.json").exists()
    assert_old_or_new(root, oracle)
    assert states(root) == {}  # the old state: nothing adopted
    torn = iter_dir(root, 2) / ".scout-manifest.json.tmp-4194303"  # as a kill inside the write
    torn.write_bytes(b'{"format": "scout-man')  # of a manifest leaves it
    rc, so, se = run_cli("adopt", root, "--json")
    assert rc == 0, so + se
    out = json.loads(so)
    assert [(f["step"], f["state"], f["finished"]) for f in out["finished"]] == [(2, "certified", "recorded")]
    assert out["adopted"] == out["finished"] and not torn.exists()
    assert_finished(root, oracle)
    assert (root / TRACKER).read_bytes() == tracker


@pytest.mark.scenario
def test_adopt_killed_at_every_point_and_at_random_times_leaves_old_or_new_state(tmp_path):
    # one ROOT killed at each point in turn, each run resuming what the last one left
    root, oracle = two(tmp_path)
    for hook in (
        "kill:judged:2",
        "kill:manifest:2",
        "legacy",
        "kill:ledger:2",
        "kill:judged:4",
        "kill:manifest:4",
        "kill:journal:4",
    ):
        if hook == "legacy":  # what adopt left before it recorded in one transaction: a `writing` row of the
            # manifest's attempt that nobody owns (Ledger.record_writing without an owner, as it was called)
            m = json.loads((iter_dir(root, 2) / "scout-manifest.json").read_text())
            with Ledger.open(root) as led:
                led.record_writing(2, m["run_id"], m["attempt"], "iter_0000002", source="adopt")
            continue
        p = adopt_killed(root, hook)
        assert p.returncode == -signal.SIGKILL, (hook, p.stdout + p.stderr)
        assert_old_or_new(root, oracle)
    rc, so, se = run_cli("adopt", root, "--json")
    assert rc == 1 and "Traceback" not in se, so + se
    assert_finished(root, oracle)
    rc, so, _ = run_cli("adopt", root, "--json")  # nothing left to do
    assert rc == 0 and json.loads(so)["adopted"] == [] and json.loads(so)["finished"] == [], so

    # kills at random times while an adopt pauses between its steps; each time the invariant, then finished
    rng = random.Random(20261202)
    for attempt in range(6):
        root, oracle = two(tmp_path / f"r{attempt}")
        env = {**os.environ, "PYTHONPATH": str(REPO), HOOK_ENV: "pause:0.05"}
        for _ in range(2):  # two kills on the same ROOT, then an adopt that is left to finish
            p = subprocess.Popen(
                [*CLI, "adopt", str(root)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
            )
            p.stderr.readline()  # its first line (the first point reached, or a warning): under way
            time.sleep(rng.uniform(0, 0.4))
            p.send_signal(signal.SIGKILL)
            p.communicate(timeout=60)
            assert_old_or_new(root, oracle)
        # this adopt exits 1 when it records the flipped iteration's verdict itself, 0 when a killed one already had
        recorded = states(root) if (root / "scout-ledger.db").exists() else {}
        rc, so, se = run_cli("adopt", root, "--json")
        assert "Traceback" not in se, so + se
        assert rc == (0 if recorded.get(4) == "rejected" else 1), (recorded, so + se)
        assert_finished(root, oracle)


# ---- a fresh Megatron job: adopt, then Megatron loads what `resume --latest-clean` hands out --------------------


@pytest.mark.scenario
def test_fresh_megatron_folders_adopted_and_the_certified_iteration_loads_as_saved(tmp_path):
    from tests import framework_jobs as jobs

    save_dir, ev = tmp_path / "ck", tmp_path / "events.jsonl"
    script = REPO / "tests" / "scripts" / "megatron_plain_job.py"
    jobs.torchrun(script, save_dir, ev, "--integrity", "--iters", 4)
    saved = {r["step"]: r["digest"] for r in jobs.events(ev, "saved")}
    assert sorted(saved) == [2, 4]
    # the same files as the kept data, and integrity.json right about them
    for it in (2, 4):
        d = iter_dir(save_dir, it)
        assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in iter_dir(DATA, it).iterdir())
        listing = json.loads((d / INTEGRITY).read_text())["files"]
        assert listing == {p.name: sha256(p) for p in d.iterdir() if p.name != INTEGRITY}
    flip_bit(iter_dir(save_dir, 4) / "__1_0.distcp")
    rc, so, se = run_cli("adopt", save_dir, "--json")
    assert rc == 1 and {a["step"]: a["state"] for a in json.loads(so)["adopted"]} == {2: "certified", 4: "rejected"}, (
        so + se
    )
    rc, so, se = run_cli("resume", save_dir, "--latest-clean", "--json")
    assert rc == 0 and json.loads(so)["step"] == 2, so + se
    ev2 = tmp_path / "loaded.jsonl"
    jobs.torchrun(script, save_dir, ev2, "--load", json.loads(so)["path"])
    assert [(r["step"], r["digest"]) for r in jobs.events(ev2, "loaded")] == [(2, saved[2])]
