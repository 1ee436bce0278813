"""scout-manifest.json: the record inside every checkpoint directory.

It is enough to rebuild the ledger's checkpoint rows (`scout-ckpt ledger rebuild`), so losing the database
loses history, not the ability to resume. Written by the coordinator after every rank has hashed its files and
before the rename that publishes the directory (so a published `step-*` always carries one).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from scout_ckpt.digests import bytes_digest
from scout_ckpt.errors import BadInput
from scout_ckpt.layout import MANIFEST_NAME, atomic_write_bytes

FORMAT = "scout-manifest/1"
REQUIRED_KEYS = ("format", "step", "files", "evidence", "policy")


def build(*, step: int, run_id: str | None, attempt: str | None, world_size: int, topology: dict, policy: dict,
          files: list[dict], evidence: dict, verdict: dict, signatures: dict | None = None,
          invariants: list | None = None, versions: dict | None = None, **extra) -> dict:
    return {
        "format": FORMAT, "step": step, "run_id": run_id, "attempt": attempt, "created": time.time(),
        "world_size": world_size, "topology": topology, "policy": policy,
        "files": sorted(files, key=lambda f: f["path"]), "evidence": evidence, "verdict": verdict,
        "signatures": signatures or {}, "invariants": invariants or [], "versions": versions or {}, **extra,
    }


def encode(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True, default=str) + "\n").encode()


def write(step_dir: Path, manifest: dict) -> str:
    """Write atomically (temp + fsync + rename); return the digest of the bytes written."""
    data = encode(manifest)
    atomic_write_bytes(step_dir / MANIFEST_NAME, data)
    return bytes_digest(data)


def read(step_dir: Path) -> tuple[dict, str]:
    """(manifest, digest of its bytes); BadInput if missing or malformed."""
    path = Path(step_dir) / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BadInput(f"{step_dir}: no {MANIFEST_NAME} (not written by scout-ckpt; try `scout-ckpt adopt`)") from None
    except OSError as e:
        raise BadInput(f"{path}: unreadable ({e.strerror})") from None
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: malformed manifest ({e})") from None
    if not isinstance(manifest, dict) or any(k not in manifest for k in REQUIRED_KEYS):
        raise BadInput(f"{path}: malformed manifest (missing keys)")
    if manifest["format"] != FORMAT:
        raise BadInput(f"{path}: unknown manifest format {manifest['format']!r}")
    if not isinstance(manifest["files"], list) or not all(
            isinstance(f, dict) and {"path", "size", "digest"} <= set(f) for f in manifest["files"]):
        raise BadInput(f"{path}: malformed manifest (bad file list)")
    return manifest, bytes_digest(data)
