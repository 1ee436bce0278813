"""Hostile input gets a refusal, never a traceback or an unbounded allocation (issue 9, item 7).

Every case uses real files (a real 3-rank run from the `ckpt_root` fixture, or plain DCP folders made from its
steps) and the real command line in a subprocess, and checks: the exit code (1 not clean, 2 bad input), one line
on stderr and no traceback, nothing certified that should not be, the ledger's bytes unchanged where the command
must not write, and the subprocess's peak RSS (os.wait4) well under 600 MB. Each subprocess also runs under an
address-space limit of 4 GiB, so that a regression allocating what the payload asks (16 GiB) fails fast instead of
taking the machine down; the 2 GiB payload stays under that limit, so there the RSS bound is what catches it.
"""

from __future__ import annotations

import json
import os
import pickle
import pickletools
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cli_pool import copy_root, run_cases
from tests.conftest import CLI, REPO

RSS_LIMIT = 600 << 20
AS_LIMIT = 4 << 30
LEDGER = "scout-ledger.db"


@dataclass
class Result:
    rc: int
    out: str
    err: str
    peak: int  # bytes

    def __repr__(self):
        return f"Result(rc={self.rc}, peak={self.peak >> 20} MiB, out={self.out[-800:]!r}, err={self.err[-1500:]!r})"


# The address-space limit is set by the shell that then execs the command (`ulimit -v`, KiB), not by a preexec_fn:
# cases run from several threads at once (tests/cli_pool.py), and a preexec_fn may deadlock a forked child there.
_UNDER_LIMIT = ["/bin/sh", "-c", f'ulimit -v {AS_LIMIT >> 10} && exec "$@"', "sh"]
# The peak RSS of the command alone. A process started from pytest inherits pytest's resident-set high-water mark
# (Linux keeps it across fork and exec: a CLI started from a pytest process of 660 MB read as 660 MB however
# little it used), so a small launcher, exec'd under the limit, forks the command from its own small image and
# reports what wait4 says of that grandchild (written to the file named first); its exit status is the command's.
_MEASURE = (
    "import os, resource, signal, sys\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "_, status, usage = os.wait4(pid, 0)\n"
    "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
    "code = os.waitstatus_to_exitcode(status)\n"
    "if code < 0:\n"
    "    signal.signal(-code, signal.SIG_DFL)\n"
    "    os.kill(os.getpid(), -code)\n"
    "sys.exit(code)\n"
)


def run_measured(*args, env=None, code: str | None = None, timeout: float = 240) -> Result:
    """The CLI (or `python -c code`) in a subprocess under the address-space limit, with its own peak RSS."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    cmd = [sys.executable, "-c", code, *map(str, args)] if code is not None else [*CLI, *map(str, args)]
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.NamedTemporaryFile("r", suffix=".peak") as peak,
    ):
        p = subprocess.Popen(
            [*_UNDER_LIMIT, sys.executable, "-c", _MEASURE, peak.name, *cmd],
            stdout=out,
            stderr=err,
            env=full_env,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while True:
            pid, status, _usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                os.killpg(p.pid, signal.SIGKILL)  # the launcher and the command it started
                os.wait4(p.pid, 0)
                pytest.fail(f"{args} did not finish in {timeout}s")
            time.sleep(0.02)
        p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting again
        out.seek(0)
        err.seek(0)
        kib = int(peak.read() or 0)
        return Result(
            p.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"), kib * 1024
        )


def assert_refused(res: Result, rc: int | tuple[int, ...], match: str | None = None) -> None:
    """Exit code as given; bad input: exactly one line on stderr; never a traceback; bounded memory."""
    rcs = (rc,) if isinstance(rc, int) else rc
    assert res.rc in rcs, res
    assert "Traceback" not in res.err and "Traceback" not in res.out, res
    lines = res.err.strip().splitlines()
    assert len(lines) == (1 if res.rc == 2 else len(lines[:1])), res
    if match is not None:
        assert match in (res.err + res.out), res
    assert res.peak < RSS_LIMIT, res


def ledger_bytes(root: Path) -> str:
    """The ledger's content (a SQL dump through a read-only connection): a WAL checkpoint on close may rewrite
    the file without changing a row, so the dump is what "unchanged" compares."""
    c = sqlite3.connect(f"file:{root / LEDGER}?mode=ro", uri=True)
    try:
        return "\n".join(c.iterdump())
    finally:
        c.close()


def states(root: Path) -> dict[int, str]:
    c = sqlite3.connect(f"file:{root / LEDGER}?mode=ro", uri=True)
    try:
        return dict(c.execute("SELECT step, state FROM checkpoints"))
    finally:
        c.close()


# ---- crafted `.metadata` files ----------------------------------------------------------------------------------


def bytearray_bomb(n: int) -> bytes:
    """A protocol-2 pickle of `bytearray(n)`: about 40 bytes that allocate n."""
    return b"\x80\x02cbuiltins\nbytearray\n\x8a" + bytes([8]) + n.to_bytes(8, "little") + b"\x85R."


MEMO_BOMB = b"\x80\x02Nr" + struct.pack("<I", 1 << 28) + b"."  # C unpickler: a 2**29-slot memo array
NESTED_KEY = b"\x80\x02}" + b")" + b"\x85" * 200_000 + b"Ns."  # pickle.loads: hashing the key segfaults
STRING_BOMB = b"\x80\x04\x8d" + struct.pack("<Q", 1 << 40) + b"."  # BINUNICODE8 declaring 1 TiB
FRAME_BOMB = b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"N."
SIZE_CALL = b"\x80\x02ctorch\nSize\n\x8a\x05\x00\x00\x00\x00\x04\x85R."  # torch.Size(2**34)


def absurd_tensor(md_bytes: bytes) -> bytes:
    """The step's real metadata with one tensor (and its chunk) declared 2**20 x 2**20 (4 TiB of float32)."""
    import torch

    md = pickle.loads(md_bytes)
    fqn, item = next((k, v) for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks") and len(v.size) == 2)
    item.size = torch.Size([1 << 20, 1 << 20])
    key = next(k for k in md.storage_data if k.fqn == fqn)
    info = md.storage_data.pop(key)
    chunk = item.chunks[0]
    chunk.offsets, chunk.sizes = torch.Size([0, 0]), torch.Size([1 << 20, 1 << 20])
    item.chunks = [chunk]
    md.storage_data[type(key)(fqn, [0, 0])] = info
    return pickle.dumps(md)


def py313_pathlib(md_bytes: bytes) -> bytes:
    """The metadata as Python 3.13 writes it: storage_meta's PosixPath comes from `pathlib._local` (protocol 4;
    the enclosing FRAME's length is patched)."""
    ops = list(pickletools.genops(md_bytes))
    frames = [pos for op, _, pos in ops if op.name == "FRAME"]
    hits = [pos for op, arg, pos in ops if op.name == "SHORT_BINUNICODE" and arg == "pathlib"]
    assert hits, "expected a pathlib global in the DCP metadata"
    out = bytearray(md_bytes)
    old, new = b"\x8c\x07pathlib", b"\x8c\x0epathlib._local"
    for pos in reversed(hits):
        assert out[pos : pos + len(old)] == old
        out[pos : pos + len(old)] = new
        frame = max(f for f in frames if f < pos)
        size = struct.unpack("<Q", out[frame + 1 : frame + 9])[0]
        out[frame + 1 : frame + 9] = struct.pack("<Q", size + len(new) - len(old))
    return bytes(out)


def plain_copy(root: Path, src_step: int, step: int) -> Path:
    """A plain DCP folder (no scout manifest) `step-N` under root, copied from a real step: for `adopt`."""
    d = root / f"step-{step}"
    shutil.copytree(root / f"step-{src_step:08d}", d)
    (d / "scout-manifest.json").unlink()
    return d


@pytest.fixture
def hostile_root(ckpt_root):
    """ckpt_root plus plain DCP folders: 101 bytearray(2**34), 102 bytearray(2**31), 103 a tensor of absurd
    declared size, 104 a .metadata over the size limit (sparse), 105 the Python 3.13 pickle (genuine)."""
    real = (ckpt_root / "step-00000003" / ".metadata").read_bytes()
    plain_copy(ckpt_root, 3, 101).joinpath(".metadata").write_bytes(bytearray_bomb(1 << 34))
    plain_copy(ckpt_root, 3, 102).joinpath(".metadata").write_bytes(bytearray_bomb(1 << 31))
    plain_copy(ckpt_root, 3, 103).joinpath(".metadata").write_bytes(absurd_tensor(real))
    with open(plain_copy(ckpt_root, 3, 104) / ".metadata", "r+b") as f:
        f.truncate((64 << 20) + 1)
    plain_copy(ckpt_root, 3, 105).joinpath(".metadata").write_bytes(py313_pathlib(real))
    return ckpt_root


def test_crafted_metadata_through_adopt_export_certify_ls_explain(hostile_root, tmp_path):
    root = hostile_root
    res = run_measured("adopt", root, "--json")
    assert_refused(res, 1)  # some adopted steps are not clean
    adopted = {a["step"]: a for a in json.loads(res.out)["adopted"]}
    for step, what in ((101, "builtins.bytearray"), (102, "builtins.bytearray"), (103, "declares"), (104, "over the")):
        assert adopted[step]["state"] == "rejected", adopted[step]
        assert adopted[step]["reasons"][0]["code"] == "bad_metadata", adopted[step]
        assert what in json.dumps(adopted[step]["reasons"]), adopted[step]
    assert adopted[105]["state"] == "certified", adopted[105]  # Python 3.13's pathlib._local is accepted

    # The cases below do not depend on each other: each runs on its own copy of the adopted root, concurrently.
    def export_refused(step, what):
        # export reads .metadata and tensors of a step whose bytes match the ledger: refused, nothing written
        r = copy_root(root, tmp_path / f"export{step}")
        before = ledger_bytes(r)
        out = tmp_path / f"w{step}.safetensors"
        res = run_measured("export", r, "--step", step, "--force", "--out", out)
        assert_refused(res, 2, what)
        assert not out.exists() and not list(tmp_path.glob(f".w{step}*"))
        assert ledger_bytes(r) == before

    def certify_refused(step, what):
        # adopt rejected the step; certify leaves a rejected step as it is (nothing raises a rejected attempt
        # back): not clean (1), nothing certified, the ledger unchanged, the hostile bytes never read
        r = copy_root(root, tmp_path / f"certify{step}")
        before = ledger_bytes(r)
        res = run_measured("certify", r, "--step", step)
        assert_refused(res, 1)
        assert states(r)[step] == "rejected"
        assert ledger_bytes(r) == before
        # the same step as a ledger that trusted it would hold it (committed): certify must read the hostile
        # .metadata now, and refuses it as bad input (2, one line), nothing certified, the ledger unchanged
        c = sqlite3.connect(r / LEDGER)
        with c:
            c.execute("UPDATE checkpoints SET state = 'committed' WHERE step = ?", (step,))
        c.close()
        before = ledger_bytes(r)
        res = run_measured("certify", r, "--step", step)
        assert_refused(res, 2, what)
        assert states(r)[step] == "committed"
        assert ledger_bytes(r) == before

    def genuine_py313():
        # the genuine Python 3.13 pickle goes all the way: certify and export
        r = copy_root(root, tmp_path / "genuine")
        res = run_measured("certify", r, "--step", 105)
        assert res.rc == 0 and "Traceback" not in res.err, res
        res = run_measured("export", r, "--step", 105, "--out", tmp_path / "ok.safetensors")
        assert res.rc == 0 and (tmp_path / "ok.safetensors").stat().st_size > 0, res

    def read_only_views():
        # read-only views do not read the hostile files and still work
        r = copy_root(root, tmp_path / "views")
        before = ledger_bytes(r)
        res = run_measured("ls", r, "--json")
        assert res.rc == 0 and res.peak < RSS_LIMIT, res
        assert {c["step"]: c["state"] for c in json.loads(res.out)["checkpoints"]}[101] == "rejected"
        res = run_measured("explain", r, 101)
        assert_refused(res, 1)
        assert ledger_bytes(r) == before

    cases = {
        f"export {step}": (lambda s=step, w=what: export_refused(s, w))
        for step, what in (
            (101, "refusing to unpickle builtins.bytearray"),
            (103, "declares 4398046511104 bytes"),
            (104, "limit"),
        )
    }
    cases.update(
        {
            f"certify {step}": (lambda s=step, w=what: certify_refused(s, w))
            for step, what in ((102, "refusing to unpickle builtins.bytearray"), (103, "declares 4398046511104"))
        }
    )
    cases.update({"genuine 3.13 pickle": genuine_py313, "ls and explain": read_only_views})
    run_cases(cases)


_LIBRARY_PROBE = r"""
import json, resource, sys
from scout_ckpt.format.dcp_files import load_metadata
from scout_ckpt.errors import BadInput
out = {}
for path in sys.argv[1:]:
    try:
        load_metadata(path)
        out[path] = "loaded"
    except BadInput as e:
        out[path] = "refused: " + str(e)
out["imported"] = sorted(m for m in ("torch", "torch.distributed.checkpoint") if m in sys.modules)
print(json.dumps(out))
"""


def _genuine_metadata() -> bytes:
    """A `.metadata` pickled from DCP's own classes, touching every global the unpickler maps to a stand-in: a
    bf16 tensor in two chunks, a bytes entry, a transform-free storage info, storage_meta with a PosixPath."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    props = TensorProperties(dtype=torch.bfloat16)
    chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
        ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3])),
    ]
    md = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(props, torch.Size([4, 3]), chunks),
            "step": BytesStorageMetadata(),
        },
        storage_data={
            MetadataIndex("w", [0, 0]): _StorageInfo("__0_0.distcp", 0, 900),
            MetadataIndex("w", [2, 0]): _StorageInfo("__1_0.distcp", 0, 900),
            MetadataIndex("step"): _StorageInfo("__0_0.distcp", 900, 300),
        },
        storage_meta=StorageMeta(checkpoint_id=Path("/x/step-1"), save_id="s"),
    )
    return pickle.dumps(md)


def test_stand_in_tables_match_torch(tmp_path):
    """dcp_meta's dtype and layout tables are torch's (a dtype missing there would refuse a genuine checkpoint),
    and a genuine DCP pickle reads back field for field."""
    import torch

    from scout_ckpt.format import dcp_meta
    from scout_ckpt.format.dcp_files import load_metadata

    public = {a: v for a in dir(torch) if not a.startswith("_") and isinstance(v := getattr(torch, a), torch.dtype)}
    assert {a: str(v).removeprefix("torch.") for a, v in public.items()} == {
        a: dcp_meta.DTYPE_ALIASES.get(a, a) for a in public
    }
    assert dcp_meta.DTYPE_ITEMSIZE == {str(v).removeprefix("torch."): v.itemsize for v in public.values()}
    assert set(dcp_meta.LAYOUTS) == {str(v) for v in torch.__dict__.values() if isinstance(v, torch.layout)}
    assert all(dcp_meta.torch_dtype(dcp_meta.dtype(a)) is v for a, v in public.items())
    (tmp_path / ".metadata").write_bytes(_genuine_metadata())
    md = load_metadata(tmp_path / ".metadata")
    w = md.state_dict_metadata["w"]
    assert type(w.size) is dcp_meta.Size and w.size == (4, 3) and w.properties.dtype.itemsize == 2
    assert dcp_meta.torch_dtype(w.properties.dtype) is torch.bfloat16 and w.properties.layout is dcp_meta.STRIDED
    assert [md.storage_data[dcp_meta.MetadataIndex("w", c.offsets)].relative_path for c in w.chunks] == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert md.storage_data[dcp_meta.MetadataIndex("step")].offset == 900
    assert str(md.storage_meta.checkpoint_id) == "/x/step-1"


def test_pickle_tricks_beyond_the_allowlist_are_refused_in_bounded_memory(tmp_path):
    """Payloads that a restricted find_class alone does not stop: the C unpickler's memo array, a key whose hash
    recurses 200,000 levels, length fields declaring a TiB, a torch.Size call with an int, opcodes DCP never
    writes (sets, extensions), code execution."""
    payloads = {
        "memo": MEMO_BOMB,
        "nested_key": NESTED_KEY,
        "string": STRING_BOMB,
        "frame": FRAME_BOMB,
        "size_call": SIZE_CALL,
        "set": b"\x80\x04\x8f(K\x01\x90.",
        "ext": b"\x80\x02\x82\x01.",
        "system": pickle.dumps(os.system),
        "list": b"\x80\x02cbuiltins\nlist\n)R.",
        "garbage": b"\x00" * 100,
    }
    paths = []
    for name, data in payloads.items():
        (tmp_path / name).write_bytes(data)
        paths.append(tmp_path / name)
    (tmp_path / "genuine").write_bytes(_genuine_metadata())
    res = run_measured(*paths, tmp_path / "genuine", code=_LIBRARY_PROBE)
    assert res.rc == 0 and res.peak < RSS_LIMIT, res
    out = json.loads(res.out)
    assert out.pop(str(tmp_path / "genuine")) == "loaded"
    assert out.pop("imported") == []  # reading metadata needs neither torch nor DCP (dcp_meta's stand-ins)
    for path, outcome in out.items():
        assert outcome.startswith("refused: ") and "\n" not in outcome, (path, outcome)


def test_metadata_size_limit_is_configurable(ckpt_root, tmp_path):
    d = plain_copy(ckpt_root, 3, 200)
    size = (d / ".metadata").stat().st_size
    res = run_measured("adopt", ckpt_root, "--json", env={"SCOUT_CKPT_MAX_METADATA_BYTES": str(size - 1)})
    assert_refused(res, 1)
    got = {a["step"]: a for a in json.loads(res.out)["adopted"]}[200]
    assert got["state"] == "rejected" and "SCOUT_CKPT_MAX_METADATA_BYTES" in got["reasons"][0]["detail"], got
    res = run_measured(
        "export",
        ckpt_root,
        "--step",
        200,
        "--force",
        "--out",
        tmp_path / "x.safetensors",
        env={"SCOUT_CKPT_MAX_METADATA_BYTES": "banana"},
    )
    assert_refused(res, 2, "SCOUT_CKPT_MAX_METADATA_BYTES")


def _edit_manifest(step_dir: Path, paths: list[str]) -> None:
    mpath = step_dir / "scout-manifest.json"
    m = json.loads(mpath.read_text())
    for f, p in zip(m["files"], paths):
        f["path"] = p
    mpath.write_text(json.dumps(m))


MANIFEST_ESCAPES = ["../step-00000003/.metadata", "/etc/hostname", "a/../../x", "x\u0000y"]


def test_manifest_file_names_must_stay_inside_the_checkpoint(ckpt_root, tmp_path):
    """A manifest edited to name files outside its checkpoint: certify and resume refuse to trust it (its digest
    no longer matches the ledger, and it cannot even be read), rebuild skips it, nothing is hashed there. One case
    per name, each on its own copy of the run, concurrently."""

    def case(i, bad):
        root = copy_root(ckpt_root, tmp_path / f"run{i}")
        step4 = root / "step-00000004"
        _edit_manifest(step4, [bad])
        res = run_measured("certify", root, "--step", 4, "--json")
        assert_refused(res, 1)
        reasons = json.loads(res.out)["results"][0]["reasons"]
        # the manifest cannot even be read (a name escapes the checkpoint): bad_manifest, before any digest compare
        assert "bad_manifest" in [r.get("code") for r in reasons], reasons
        assert states(root)[4] == "rejected"

        res = run_measured("resume", root, "--latest-clean", "--json")
        assert res.rc == 0 and json.loads(res.out)["step"] == 3, res  # walks back past step 4

        # rebuild skips the step (a rebuild that left a checkpoint out is not a success: exit 1, one line) and
        # writes the ledger without it; step 3 is rebuilt as before
        res = run_measured("ledger", "rebuild", root, "--json")
        assert_refused(res, 1, "file path escapes the checkpoint")
        out = json.loads(res.out)
        assert [s["step"] for s in out["skipped"]] == [4], out
        assert "file path escapes the checkpoint" in out["skipped"][0]["reason"], out
        assert {"step": 4, "before": "rejected", "after": None, "why": "skipped"} in out["changes"], out
        assert 4 not in states(root) and states(root)[3] == "certified"

    run_cases({repr(bad): (lambda i=i, b=bad: case(i, b)) for i, bad in enumerate(MANIFEST_ESCAPES)})


def test_rebuild_with_a_hostile_manifest_is_not_a_success(ckpt_root):
    _edit_manifest(ckpt_root / "step-00000004", ["../step-00000003/.metadata", "/etc/hostname"])
    res = run_measured("ledger", "rebuild", ckpt_root)
    assert_refused(res, 1, "file path escapes the checkpoint")


def test_ledger_file_names_are_checked_before_they_are_joined(ckpt_root):
    """Defence in depth: a ledger tampered to list `../` or absolute names is bad input; nothing is hashed
    outside, nothing is written."""
    c = sqlite3.connect(ckpt_root / LEDGER)
    with c:
        c.execute("UPDATE files SET path = '../step-00000003/.metadata' WHERE step = 4 AND path = '.metadata'")
    c.close()

    def case(i, *args):  # certify and resume, each on its own copy of the tampered run, concurrently
        root = copy_root(ckpt_root, ckpt_root.parent / f"run{i}")
        before = ledger_bytes(root)
        res = run_measured(args[0], root, *args[1:])
        assert_refused(res, 2, "escapes the checkpoint")
        assert ledger_bytes(root) == before and states(root)[4] == "certified"

    run_cases(
        {"certify": lambda: case(1, "certify", "--step", 4), "resume": lambda: case(2, "resume", "--latest-clean")}
    )


def test_a_symlink_out_of_the_step_dir_is_never_followed(ckpt_root, tmp_path):
    """A data file replaced by a symlink to an identical copy outside the checkpoint: same bytes, same digest,
    but not the checkpoint's own file: certify rejects it (unsafe_file), resume walks back."""
    victim = next(p for p in sorted((ckpt_root / "step-00000004").iterdir()) if p.suffix == ".distcp")
    outside = tmp_path / "elsewhere.distcp"
    shutil.copy(victim, outside)
    victim.unlink()
    victim.symlink_to(outside)
    res = run_measured("certify", ckpt_root, "--step", 4, "--json")
    assert_refused(res, 1)
    reasons = json.loads(res.out)["results"][0]["reasons"]
    assert any(r.get("code") == "unsafe_file" and r.get("file") == victim.name for r in reasons), reasons
    res = run_measured("resume", ckpt_root, "--latest-clean", "--json")
    assert res.rc == 0 and json.loads(res.out)["step"] == 3, res


def _entry_blob(data_pkl: bytes) -> bytes:
    """A `torch.save`-shaped archive whose data.pkl is the given pickle."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


def test_a_hostile_entry_is_not_adopted(ckpt_root, tmp_path):
    """`dcp.load` opens non-tensor entries with torch.load(weights_only=False): a foreign folder whose `lr` entry
    runs code (or allocates 16 GiB through weights_only's bytearray) must be rejected at adoption, before any
    job resumes from it; the payload never runs. Both payloads, each on its own copy of the run, concurrently."""

    def case(payload):
        root = copy_root(ckpt_root, tmp_path / f"run-{payload}")
        marker = tmp_path / f"pwned-{payload}"
        pkl = {
            "code": b"\x80\x02cposix\nsystem\nX"
            + struct.pack("<I", len(f"touch {marker}"))
            + f"touch {marker}".encode()
            + b"\x85R.",
            "bytearray": bytearray_bomb(1 << 34),
        }[payload]
        d = plain_copy(root, 3, 300)
        md = pickle.loads((d / ".metadata").read_bytes())
        key = next(k for k in md.storage_data if k.fqn == "optim.param_groups.0.lr")
        info = md.storage_data[key]
        blob = _entry_blob(pkl)
        target = d / info.relative_path
        info.offset, info.length = target.stat().st_size, len(blob)
        with open(target, "ab") as f:
            f.write(blob)
        (d / ".metadata").write_bytes(pickle.dumps(md))
        res = run_measured("adopt", root, "--json")
        assert_refused(res, 1)
        got = {a["step"]: a for a in json.loads(res.out)["adopted"]}[300]
        assert got["state"] == "rejected" and got["reasons"][0]["code"] == "bad_entry", got
        assert not marker.exists()
        res = run_measured("resume", root, "--latest-clean", "--json")
        assert res.rc == 0 and json.loads(res.out)["step"] == 4, res
        assert not marker.exists()

    run_cases({p: (lambda p=p: case(p)) for p in ("code", "bytearray")})
