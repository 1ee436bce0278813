"""The real `scout-ckpt` command line, in subprocesses, against real checkpoints."""

import json
import os
import sqlite3
import subprocess
import sys

import pytest

from scout_ckpt.format.layout import LEDGER_NAME, MANIFEST_NAME
from tests.cli_pool import copy_root, run_cases
from tests.conftest import REPO, ledger_write_lock, run_cli


def _files(root, step):
    d = root / f"step-{step:08d}"
    return sorted(p for p in d.iterdir() if p.name != MANIFEST_NAME)


def _snapshot(root):
    """Bytes of every file under root except SQLite's -wal/-shm side files, to prove nothing was modified."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.name.endswith(("-wal", "-shm")):
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


def _ledger_rows(root):
    c = sqlite3.connect(f"file:{root / LEDGER_NAME}?mode=ro", uri=True)
    try:
        return c.execute("SELECT step, state, reasons FROM checkpoints ORDER BY step").fetchall()
    finally:
        c.close()


def test_ls_json_shape(ckpt_root):
    rc, out, err = run_cli("ls", ckpt_root, "--json")
    assert rc == 0 and err == ""
    doc = json.loads(out)
    rows = doc["checkpoints"]
    assert [r["step"] for r in rows] == [3, 4]
    for r in rows:
        assert {"step", "state", "path", "bytes", "evidence", "reasons"} <= set(r)
        assert r["state"] == "certified" and r["evidence"]["bytes"] == "pass" and r["bytes"] > 0


def test_resume_plain_prints_the_path_alone(ckpt_root):
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean")
    assert rc == 0 and out == f"{(ckpt_root / 'step-00000004').resolve()}\n"
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    doc = json.loads(out)
    assert doc["step"] == 4 and doc["verified"] is True and doc["state"] == "certified"


def test_damaged_file_is_caught_and_skipped(ckpt_root, tmp_path):
    """Each damage (bitflip, truncate, delete) of each kind of file (the metadata, a shard) of step 4: certify
    rejects it naming the file, resume walks back to step 3. Six cases, each on its own copy of the run,
    concurrently."""

    def case(damage, which):
        root = copy_root(ckpt_root, tmp_path / f"{damage}-{which}")
        files = _files(root, 4)
        target = next(f for f in files if (f.name == ".metadata") == (which == "metadata"))
        if damage == "bitflip":
            data = bytearray(target.read_bytes())
            data[len(data) // 2] ^= 0x10
            target.write_bytes(bytes(data))
        elif damage == "truncate":
            target.write_bytes(target.read_bytes()[:-1])
        else:
            target.unlink()
        code = {"bitflip": "digest_mismatch", "truncate": "truncated_file", "delete": "missing_file"}[damage]
        rc, out, _ = run_cli("certify", root, "--step", 4, "--json")
        assert rc == 1
        res = json.loads(out)["results"][0]
        assert res["state"] == "rejected" and res["reasons"][0]["code"] == code
        assert res["reasons"][0]["file"] == target.name
        rc, out, _ = run_cli("resume", root, "--latest-clean", "--json")
        assert rc == 0 and json.loads(out)["step"] == 3
        if (damage, which) == ("bitflip", "shard"):  # the older step is untouched (once: a certify costs seconds)
            rc, _, _ = run_cli("certify", root, "--step", 3)
            assert rc == 0

    run_cases(
        {
            f"{d} {w}": (lambda d=d, w=w: case(d, w))
            for d in ("bitflip", "truncate", "delete")
            for w in ("metadata", "shard")
        }
    )


def test_resume_walks_back_and_records_the_failure(ckpt_root):
    f = _files(ckpt_root, 4)[0]
    data = bytearray(f.read_bytes())
    data[0] ^= 1
    f.write_bytes(bytes(data))
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["step"] == 3 and doc["skipped"][0]["step"] == 4
    rows = dict((s, st) for s, st, _ in _ledger_rows(ckpt_root))
    assert rows[4] == "rejected"


def test_resume_none_left_exits_1(ckpt_root):
    for step in (3, 4):
        _files(ckpt_root, step)[0].unlink()
    rc, out, err = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert rc == 1
    doc = json.loads(out)
    assert doc["step"] is None and doc["reasons"]
    rc, out, err = run_cli("resume", ckpt_root, "--latest-clean")
    lines = err.strip().splitlines()
    # one line per step walked past (already rejected by the --json call above: newer, not certified), then why
    assert rc == 1 and out == "" and "no certified checkpoint" in lines[-1] and len(lines) == 1


def test_resume_says_on_stderr_which_steps_it_walked_past_and_why(ckpt_root):
    f = _files(ckpt_root, 4)[0]
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 4
    f.write_bytes(bytes(data))
    rc, out, err = run_cli("resume", ckpt_root, "--latest-clean")
    assert rc == 0 and out == f"{(ckpt_root / 'step-00000003').resolve()}\n"  # stdout: the path alone
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"scout-ckpt: skipped step 4: digest_mismatch({f.name})")
    rc, out, err = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    doc = json.loads(out)
    assert doc["step"] == 3 and doc["newer"] == [
        {"step": 4, "state": "rejected", "reasons": doc["newer"][0]["reasons"]}
    ]
    assert doc["newer"][0]["reasons"][0]["code"] == "digest_mismatch"
    assert err.strip().startswith(f"scout-ckpt: newer step 4 is rejected: digest_mismatch({f.name})")


def test_ls_and_explain_say_when_evidence_was_last_checked(ckpt_root):
    rc, out, _ = run_cli("ls", ckpt_root, "--json")
    rows = {r["step"]: r for r in json.loads(out)["checkpoints"]}
    # the template run saved step 4 and loaded it back (the load re-verified its bytes)
    assert rows[4]["checked"]["bytes"]["by"] == "load"
    assert rows[4]["checked"]["bytes"]["at"] > 0
    run_cli("resume", ckpt_root, "--latest-clean", check_rc=0)
    rc, out, _ = run_cli("ls", ckpt_root)
    assert rc == 0 and "bytes checked" in out and "resume" in out and "certify ROOT` re-checks" in out
    run_cli("certify", ckpt_root, "--step", 3, check_rc=0)
    rc, out, _ = run_cli("explain", ckpt_root, 3)
    assert rc == 0 and "checked by certify" in out


def test_no_verify_skips_hashing(ckpt_root):
    _files(ckpt_root, 4)[0].write_bytes(b"garbage")
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--no-verify", "--json")
    assert rc == 0 and json.loads(out)["verified"] is False and json.loads(out)["step"] == 4


def test_explain(ckpt_root):
    rc, out, _ = run_cli("explain", ckpt_root, 4, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["step"] == 4 and doc["state"] == "certified"
    assert set(doc["evidence"]) >= {"bytes", "consensus", "replay", "invariants"}
    assert doc["evidence"]["bytes"]["status"] == "pass"


def test_quarantine_is_never_resumed(ckpt_root):
    rc, _, _ = run_cli("quarantine", ckpt_root, 4, "--reason", "loss spike")
    assert rc == 0
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert json.loads(out)["step"] == 3
    rc, out, _ = run_cli("certify", ckpt_root, "--step", 4, "--json")
    assert rc == 1 and json.loads(out)["results"][0]["state"] == "quarantined"


def test_gc_keeps_newest_certified_and_deletes_rejected_first(ckpt_root):
    # Make step 4 (the newest) rejected: step 3 is then the newest certified and must survive keep=1.
    _files(ckpt_root, 4)[0].write_bytes(b"x")
    run_cli("certify", ckpt_root, "--step", 4)
    rc, out, _ = run_cli("gc", ckpt_root, "--keep", 1, "--dry-run", "--json")
    plan = json.loads(out)
    assert rc == 0 and plan["delete"] == [4] and plan["protected"] == 3
    assert (ckpt_root / "step-00000004").exists()
    rc, out, _ = run_cli("gc", ckpt_root, "--keep", 1, "--json")
    assert rc == 0 and not (ckpt_root / "step-00000004").exists() and (ckpt_root / "step-00000003").exists()
    rows = dict((s, st) for s, st, _ in _ledger_rows(ckpt_root))
    assert rows == {3: "certified", 4: "deleted"}


def test_ledger_rebuild_from_manifests(ckpt_root):
    # certify journals its verdicts beside the data: that record is what lets a rebuild certify again
    from scout_ckpt.ops.certify import certify

    assert all(r["state"] == "certified" for r in certify(ckpt_root))
    before = [(s, st) for s, st, _ in _ledger_rows(ckpt_root)]
    (ckpt_root / LEDGER_NAME).unlink()
    # a ledger lost beside checkpoints is no empty run: ls answers from the manifests and names the remedy
    rc, out, err = run_cli("ls", ckpt_root, "--json")
    assert rc == 0 and json.loads(out)["source"] == "manifests" and "scout-ckpt ledger rebuild" in err
    rc, out, _ = run_cli("ledger", "rebuild", ckpt_root, "--json")
    assert rc == 0
    assert [(s, st) for s, st, _ in _ledger_rows(ckpt_root)] == before
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert json.loads(out)["step"] == 4


def test_rebuild_marks_a_damaged_checkpoint(ckpt_root):
    _files(ckpt_root, 4)[0].write_bytes(b"x")
    rc, out, _ = run_cli("ledger", "rebuild", ckpt_root, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["backup"]
    assert {r["step"]: r["state"] for r in doc["checkpoints"]} == {3: "certified", 4: "rejected"}
    assert doc["changes"] == [{"step": 4, "before": "certified", "after": "rejected", "why": "truncated_file"}]


def test_ledger_rebuild_no_verify_hashes_nothing_and_certifies_nothing(ckpt_root):
    """--no-verify: the manifests are taken in without re-hashing, so bytes evidence is `missing` and no step is
    certified, not even one whose data is damaged and not rejected either (nothing read it); a later `certify`
    hashes and decides."""
    f = _files(ckpt_root, 4)[0]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, other bytes: only hashing can tell
    f.write_bytes(bytes(data))
    rc, out, err = run_cli("ledger", "rebuild", ckpt_root, "--no-verify", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["skipped"] == [] and doc["backup"], (rc, err)
    assert doc["checkpoints"] == [
        {"step": 3, "state": "committed", "reasons": [{"code": "bytes_unverified"}]},
        {"step": 4, "state": "committed", "reasons": [{"code": "bytes_unverified"}]},
    ]
    assert [(c["step"], c["why"]) for c in doc["changes"]] == [(3, "bytes_unverified"), (4, "bytes_unverified")]
    rows = {c["step"]: c for c in json.loads(run_cli("ls", ckpt_root, "--json")[1])["checkpoints"]}
    assert rows[3]["evidence"]["bytes"] == rows[4]["evidence"]["bytes"] == "missing"
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert rc == 1 and json.loads(out)["step"] is None  # nothing certified to resume from
    rc, out, _ = run_cli("certify", ckpt_root, "--all", "--json")
    got = {r["step"]: r for r in json.loads(out)["results"]}
    assert rc == 1 and got[3]["state"] == "certified"
    assert got[4]["state"] == "rejected" and got[4]["reasons"][0]["code"] == "digest_mismatch"


# ---- bad input: one line on stderr, exit 2, nothing modified --------------------------------------------------


def _assert_bad(args, needle, root=None):
    snap = _snapshot(root) if root else None
    rc, out, err = run_cli(*args)
    assert rc == 2, (rc, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err, err
    if root:
        assert _snapshot(root) == snap


def _assert_bad_each(ckpt_root, cases: list[tuple[list, str]]) -> None:
    """`_assert_bad` for each (args, needle), each on its own copy of the run ("{root}" in args: the copy),
    concurrently."""

    def case(i, args, needle):
        root = copy_root(ckpt_root, ckpt_root.parent / f"bad{i}")
        _assert_bad([root if a == "{root}" else a for a in args], needle, root=root)

    run_cases(
        {
            " ".join(map(str, args)): (lambda i=i, a=args, n=needle: case(i, a, n))
            for i, (args, needle) in enumerate(cases)
        }
    )


MISSING_ROOT_CMDS = [
    ["ls"],
    ["explain", "{root}", "3"],
    ["certify"],
    ["resume", "--latest-clean"],
    ["gc", "--keep", "1"],
    ["quarantine", "{root}", "3", "--reason", "x"],
]


def test_missing_root(tmp_path):
    root = tmp_path / "missing"

    def case(cmd):
        args = [a.format(root=root) for a in cmd]
        if "{root}" not in cmd:
            args.insert(1, str(root))
        _assert_bad(args, "no such directory")

    run_cases({cmd[0]: (lambda c=cmd: case(c)) for cmd in MISSING_ROOT_CMDS})


def test_root_is_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    _assert_bad(["ls", f], "not a directory")


def test_foreign_directory(tmp_path):
    (tmp_path / "step-100").mkdir()
    _assert_bad(["resume", tmp_path, "--latest-clean"], "no scout-ckpt ledger", root=tmp_path)


def test_ledger_not_sqlite(ckpt_root):
    (ckpt_root / LEDGER_NAME).write_bytes(b"\0garbage" * 1000)
    for ext in ("-wal", "-shm"):
        p = ckpt_root / (LEDGER_NAME + ext)
        if p.exists():
            p.unlink()
    # readers fall back to the manifests and the journal (tests/test_ledger_shared_fs.py); writers refuse
    rc, out, err = run_cli("ls", ckpt_root, "--json")
    assert rc == 0 and json.loads(out)["source"] == "manifests" and "not a readable scout-ckpt ledger" in err
    _assert_bad(["certify", ckpt_root], "not a readable scout-ckpt ledger", root=ckpt_root)


def test_newer_schema(ckpt_root):
    c = sqlite3.connect(ckpt_root / LEDGER_NAME)
    c.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    c.commit()
    c.close()
    _assert_bad(["resume", ckpt_root, "--latest-clean"], "newer", root=ckpt_root)


def test_missing_and_malformed_manifest(ckpt_root):
    (ckpt_root / "step-00000004" / MANIFEST_NAME).write_text("{not json")
    rc, out, _ = run_cli("certify", ckpt_root, "--step", 4, "--json")
    assert rc == 1 and json.loads(out)["results"][0]["reasons"][0]["code"] == "bad_manifest"
    (ckpt_root / "step-00000003" / MANIFEST_NAME).unlink()
    rc, out, _ = run_cli("resume", ckpt_root, "--latest-clean", "--json")
    assert rc == 1


def test_step_that_does_not_exist(ckpt_root):
    _assert_bad_each(
        ckpt_root,
        [
            (["explain", "{root}", 99], "no such checkpoint"),
            (["certify", "{root}", "--step", 99], "no such checkpoint"),
            (["quarantine", "{root}", 99, "--reason", "x"], "no such checkpoint"),
        ],
    )


def test_bad_options(ckpt_root):
    _assert_bad_each(
        ckpt_root,
        [
            (["gc", "{root}", "--keep", 0], "at least 1"),
            (["ls", "{root}", "--bogus"], "No such option"),
            (["resume", "{root}"], "--latest-clean"),
            (["certify", "{root}", "--step", "x"], "Invalid value for '--step'"),
            (["certify", "{root}", "--step", 3, "--all"], "--step and --all are mutually exclusive"),
            (["certify", "{root}", "--all", "--step", 4, "--json"], "mutually exclusive"),
        ],
    )


def test_locked_ledger_readers_work_writers_fail_cleanly(ckpt_root):
    with ledger_write_lock(ckpt_root / LEDGER_NAME, 60):
        env = {"SCOUT_CKPT_BUSY_TIMEOUT": "0.5"}
        # the three at once: readers beside a writer that waits for the lock do not change what each sees
        got = run_cases(
            {
                "ls": lambda: run_cli("ls", ckpt_root, "--json", env=env),
                "resume": lambda: run_cli("resume", ckpt_root, "--latest-clean", env=env),
                "quarantine": lambda: run_cli("quarantine", ckpt_root, 3, "--reason", "x", env=env),
            }
        )
        assert got["ls"][0] == 0, got["ls"]
        assert got["resume"][0] == 0, got["resume"]
        rc, _, err = got["quarantine"]
        assert rc == 2 and "locked" in err and len(err.strip().splitlines()) == 1
    assert dict((s, st) for s, st, _ in _ledger_rows(ckpt_root))[3] == "certified"


def test_read_only_commands_do_not_import_torch(ckpt_root):
    """ls, explain, resume and report import no torch; certify (which checks tensors with torch) reads DCP's metadata
    through dcp_meta's stand-ins and never imports torch.distributed.checkpoint (2 s of imports); the command line
    keeps sqlite-utils from importing pandas (sys.argv: `main()` as the console script calls it)."""
    code = (
        "import sys\nfrom scout_ckpt.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    rc = e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH',\n"
        "      'DCP' if 'torch.distributed.checkpoint' in sys.modules else 'NO-DCP',\n"
        "      'PANDAS' if sys.modules.get('pandas') else 'NO-PANDAS', rc, file=sys.stderr)\n"
    )

    def case(i, expect, cmd, *rest):  # each on its own copy of the run, concurrently
        root = copy_root(ckpt_root, ckpt_root.parent / f"ro{i}")
        args = [cmd, root, *rest]
        p = subprocess.run(
            [sys.executable, "-c", code, *map(str, args)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert p.stderr.strip().splitlines()[-1] == expect, (args, p.stderr)

    cases = (
        ["NO-TORCH NO-DCP NO-PANDAS 0", "ls"],
        ["NO-TORCH NO-DCP NO-PANDAS 0", "explain", "4"],
        ["NO-TORCH NO-DCP NO-PANDAS 0", "resume", "--latest-clean"],
        ["NO-TORCH NO-DCP NO-PANDAS 0", "report"],
        ["TORCH NO-DCP NO-PANDAS 0", "certify", "--all"],
    )
    run_cases({args[1]: (lambda i=i, a=args: case(i, *a)) for i, args in enumerate(cases)})


def test_export_cli_round_trips_and_refuses_uncertified(ckpt_root, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "w.safetensors"
    rc, stdout, _ = run_cli("export", ckpt_root, "--latest-clean", "--out", out, "--json")
    doc = json.loads(stdout)
    assert rc == 0 and doc["step"] == 4 and doc["prefix"] == "model."
    weights = load_file(out)
    assert set(weights) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    run_cli("quarantine", ckpt_root, 3, "--reason", "test")
    rc, _, err = run_cli("export", ckpt_root, "--step", 3, "--out", tmp_path / "q.safetensors")
    assert rc == 1 and "quarantined" in err and not (tmp_path / "q.safetensors").exists()
    _assert_bad(["export", ckpt_root, "--out", tmp_path / "x.safetensors"], "exactly one", root=ckpt_root)


def test_export_prefix_selects_and_strips_the_keys(ckpt_root, tmp_path):
    """--prefix: the tensors under that prefix, the prefix stripped, recorded in the file's metadata; "" takes
    every model tensor with its full key; a prefix that matches nothing is bad input and writes nothing. The
    values are checked against DCP's own consolidation of the step (format_utils.dcp_to_torch_save)."""
    import torch
    from safetensors import safe_open
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    consolidated = tmp_path / "full.pt"
    dcp_to_torch_save(str(ckpt_root / "step-00000004"), str(consolidated))
    full = torch.load(consolidated, weights_only=True)["model"]

    def export(prefix, name):
        out = tmp_path / name
        return out, run_cli("export", ckpt_root, "--step", 4, "--prefix", prefix, "--out", out, "--json")

    got = run_cases(
        {
            "layer 0": lambda: export("model.0.", "l0.safetensors"),
            "empty": lambda: export("", "all.safetensors"),
            "nothing": lambda: export("nothing.", "none.safetensors"),
        }
    )
    out, (rc, stdout, err) = got["layer 0"]
    doc = json.loads(stdout)
    assert rc == 0 and doc["prefix"] == "model.0." and doc["tensors"] == 2, (rc, stdout, err)
    with safe_open(str(out), "pt") as f:
        assert sorted(f.keys()) == ["bias", "weight"] and f.metadata()["scout.prefix"] == "model.0."
        assert f.metadata()["scout.step"] == "4"
        assert all(f.get_tensor(k).equal(full[f"0.{k}"]) for k in ("weight", "bias"))
    out, (rc, stdout, err) = got["empty"]
    assert rc == 0 and json.loads(stdout)["prefix"] == "", (rc, stdout, err)
    with safe_open(str(out), "pt") as f:  # every model tensor, no optimizer state
        assert sorted(f.keys()) == ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight"]
        assert all(f.get_tensor(k).equal(full[k.removeprefix("model.")]) for k in f.keys())
    out, (rc, stdout, err) = got["nothing"]
    assert rc == 2 and stdout == "" and "no tensors under prefix 'nothing.'" in err and err.count("\n") == 1, err
    assert not out.exists() and not list(tmp_path.glob(".none.safetensors*"))


def test_adopt_cli_on_plain_dcp_folders(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    for step in (5, 10):
        sd = {"model": {"w": torch.full((4, 4), float(step)), "b": torch.zeros(4)}}
        dcp.save(sd, checkpoint_id=str(tmp_path / f"step-{step}"), no_dist=True)
    rc, out, _ = run_cli("adopt", tmp_path, "--json")
    doc = json.loads(out)
    assert rc == 0 and [r["state"] for r in doc["adopted"]] == ["certified", "certified"]
    rc, out, _ = run_cli("resume", tmp_path, "--latest-clean")
    assert rc == 0 and out.strip().endswith("step-10")


# ---- ROOTs of object-store runs (scout_ckpt/ops/roots.py): in-process, no S3 server needed ----------------------------


def _main(capsys, *argv) -> tuple[int, str, str]:
    from scout_ckpt.cli import main

    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return e.value.code, out, err


@pytest.mark.parametrize("cmd", [["adopt", "{root}"], ["ledger", "rebuild", "{root}"]])
def test_adopt_rebuild_refuse_another_uri_for_a_bound_ledger_dir(tmp_path, capsys, cmd):
    """A ledger_dir bound to an s3:// URI: adopt and ledger rebuild with a --uri naming another prefix are bad
    input (exit 2, one line, nothing written), before any store is opened. (Both work on S3 runs:
    tests/test_s3.py.)"""
    root = tmp_path / "ledger"
    root.mkdir()
    (root / "scout-storage.json").write_text(json.dumps({"uri": "s3://bucket/run", "storage_options": {}}))
    before = _snapshot(root)
    rc, out, err = _main(capsys, *[a.format(root=root) for a in cmd], "--uri", "s3://bucket/other")
    assert rc == 2 and out == "" and err.count("\n") == 1, (rc, out, err)
    assert "this ledger_dir belongs to s3://bucket/run, not s3://bucket/other" in err
    assert _snapshot(root) == before


@pytest.mark.parametrize(
    "cmd",
    [
        ["resume", "{root}", "--latest-clean"],
        ["certify", "{root}"],
        ["report", "{root}"],
        ["gc", "{root}", "--keep", "1"],
        ["adopt", "{root}"],
        ["ledger", "rebuild", "{root}"],
    ],
)
def test_an_s3_uri_as_root_is_bad_input_naming_the_ledger_dir(capsys, cmd):
    rc, out, err = _main(capsys, *[a.format(root="s3://bucket/run") for a in cmd])
    assert rc == 2 and out == "" and "give the run's ledger_dir as ROOT" in err and "Traceback" not in err, err
