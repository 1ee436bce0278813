"""scout-manifest.json: the record inside every checkpoint directory.

It is enough to rebuild the ledger's checkpoint rows (`scout-ckpt ledger rebuild`), so losing the database
loses history, not the ability to resume. Written by the coordinator after every rank has hashed its files and
before the rename that publishes the directory (so a published `step-*` always carries one).

In a job of several nodes its `files` hold `.metadata` and one row per node, the node's manifest
(format/node_manifest.py: its path, size and digest, and its totals), which lists that node's ranks' files; the
byte checks read through it (format/verify.py), so the manifest grows with the node count, not the rank count.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

from scout_ckpt.errors import BadInput
from scout_ckpt.format.digests import bytes_digest
from scout_ckpt.format.layout import MANIFEST_NAME, atomic_write_bytes
from scout_ckpt.format.safepaths import clip, inside, read_bounded, relpath_problem

FORMAT = "scout-manifest/1"
REQUIRED_KEYS = ("format", "step", "files", "evidence", "policy")
MAX_MANIFEST_ENV = "SCOUT_CKPT_MAX_MANIFEST_BYTES"
DEFAULT_MAX_MANIFEST_BYTES = 64 << 20


class ManifestUnreadable(BadInput):
    """The manifest is there but an I/O error (EIO, EACCES, ...) stopped the read: could not check now, which
    says nothing about the checkpoint (`oserror` is the error). Not a missing or malformed manifest."""

    def __init__(self, message: str, oserror: OSError):
        super().__init__(message)
        self.oserror = oserror


def max_manifest_bytes() -> int:
    """The size limit for scout-manifest.json (SCOUT_CKPT_MAX_MANIFEST_BYTES, bytes; default 64 MiB): a manifest
    is read whole and parsed into objects several times its size."""
    raw = os.environ.get(MAX_MANIFEST_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_MANIFEST_BYTES
    if not raw.isdigit() or int(raw) <= 0:
        raise BadInput(f"{MAX_MANIFEST_ENV}={clip(raw, 40)}: not a positive number of bytes")
    return int(raw)


def build(
    *,
    step: int,
    run_id: str | None,
    attempt: str | None,
    world_size: int,
    topology: dict,
    policy: dict,
    files: list[dict],
    evidence: dict,
    verdict: dict,
    signatures: dict | None = None,
    invariants: list | None = None,
    versions: dict | None = None,
    **extra,
) -> dict:
    return {
        "format": FORMAT,
        "step": step,
        "run_id": run_id,
        "attempt": attempt,
        "created": time.time(),
        "world_size": world_size,
        "topology": topology,
        "policy": policy,
        "files": sorted(files, key=lambda f: f["path"]),
        "evidence": evidence,
        "verdict": verdict,
        "signatures": signatures or {},
        "invariants": invariants or [],
        "versions": versions or {},
        **extra,
    }


def encode(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True, default=str) + "\n").encode()


def write(step_dir: Path, manifest: dict, *, sync_dir: bool = True) -> str:
    """Write atomically (temp + fsync + rename); return the digest of the bytes written. `sync_dir=False`: the
    caller fsyncs `step_dir` itself before anything depends on the manifest's entry (a save's temp dir, which
    `layout.commit_dir` fsyncs before its rename)."""
    data = encode(manifest)
    atomic_write_bytes(step_dir / MANIFEST_NAME, data, sync_dir=sync_dir)
    return bytes_digest(data)


def read(step_dir: Path) -> tuple[dict, str]:
    """(manifest, digest of its bytes); BadInput if missing or malformed, including a file name that is not a
    normalized relative path resolving inside step_dir (`..`, absolute, NUL, or a symlink leading out)."""
    path = Path(step_dir) / MANIFEST_NAME
    try:
        if inside(step_dir, MANIFEST_NAME) is None:
            raise ValueError("it resolves outside the checkpoint directory")
        data = read_bounded(path, max_manifest_bytes(), MANIFEST_NAME)
    except FileNotFoundError:
        raise BadInput(f"{step_dir}: no {MANIFEST_NAME} (not written by scout-ckpt; try `scout-ckpt adopt`)") from None
    except ValueError as e:
        raise BadInput(f"{path}: unreadable manifest ({e})") from None
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise BadInput(f"{step_dir}: no {MANIFEST_NAME}") from None
        raise ManifestUnreadable(f"{path}: unreadable now ({e.strerror})", e) from None
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise BadInput(f"{path}: malformed manifest ({clip(type(e).__name__ + ': ' + str(e), 160)})") from None
    if not isinstance(manifest, dict) or any(k not in manifest for k in REQUIRED_KEYS):
        raise BadInput(f"{path}: malformed manifest (missing keys)")
    if manifest["format"] != FORMAT:
        raise BadInput(f"{path}: unknown manifest format {clip(manifest['format'], 60)}")
    if (
        type(manifest["step"]) is not int
        or not isinstance(manifest["evidence"], dict)
        or not isinstance(manifest["policy"], dict)
    ):
        raise BadInput(f"{path}: malformed manifest (step, evidence or policy of the wrong type)")
    problem = files_problem(step_dir, manifest["files"])
    if problem:
        raise BadInput(f"{path}: malformed manifest: {problem}")
    return manifest, bytes_digest(data)


def files_problem(step_dir: Path, files) -> str | None:
    """Why a manifest's file list is unusable, or None: every row {"path", "size", "digest"} with a safe path
    (see safepaths.inside), a non-negative integer size and a string digest, no path twice."""
    if not isinstance(files, list):
        return "bad file list"
    seen = set()
    for f in files:
        if not isinstance(f, dict) or not {"path", "size", "digest"} <= set(f):
            return "bad file list"
        name = f["path"]
        if relpath_problem(name) is not None or inside(step_dir, name) is None:
            return f"file path escapes the checkpoint ({clip(name, 80)})"
        if name in seen:
            return f"file listed twice ({clip(name, 80)})"
        seen.add(name)
        if type(f["size"]) is not int or f["size"] < 0 or not isinstance(f["digest"], str):
            return f"bad size or digest for {clip(name, 80)}"
    return None
