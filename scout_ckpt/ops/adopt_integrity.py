"""A framework's own per-file SHA-256 digests, written at save, as bytes evidence when a folder is adopted.

Megatron-Core r0.18+ writes `integrity.json` at rank 0 after `dist_checkpointing.save(..., verify_integrity=True)`
(megatron/core/dist_checkpointing/validation.py `save_integrity_manifest`, commit 970c2540aa8d "checkpoint
integrity verification (#4305)"; megatron-core 0.16.1 has no such file): every regular file directly in the folder
except integrity.json itself, `{"algorithm": "sha256", "files": {"name": "<sha256 hex>", ...}}`. Megatron's own
verifier reads a missing "algorithm" as sha256; so does this one.

Adopt's own digests say only that the bytes have not changed since adoption; a listing written at save says they
have not changed since they were written. So when the listing is usable, every file is hashed once, with both
adopt's digest (xxh3-128, for the manifest) and SHA-256 from the same reads (what is compared is what is recorded),
and compared (`compare`); any difference is a fault of the folder (evidence kind `integrity`: fail -> rejected):

  a file whose SHA-256 differs        digest_mismatch, naming the file
  a file listed but absent            missing_file
  a file present but not listed       unexpected_file (as format/verify.py calls a file the manifest does not
                                      name: nothing written at save vouches for it, and the folder is not the
                                      one that was saved)

A rejection is final (`certify` leaves rejected steps as they are), so none of these can be certified later on
adopt's own digests. A listing that cannot be used (unreadable, not JSON, another algorithm, a bad name or
digest, one that lists nothing) is not evidence either way: adopt proceeds on its own digests as when there is
none, and the `integrity` evidence (not_applicable) says the listing was not used and why. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from scout_ckpt.format.digests import ALGO, CHUNK
from scout_ckpt.format.safepaths import clip, inside, read_bounded, relpath_problem
from scout_ckpt.policy import FAIL, NOT_APPLICABLE, PASS, evidence

MAX_LISTING_BYTES = 64 << 20
HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


@dataclass(frozen=True)
class Listing:
    """What a folder's digest file gives: `files` ({relative path: sha256 hex}) when usable; else `why` it is not
    (None with no file at all)."""

    name: str
    files: dict[str, str] | None = None
    why: str | None = None
    present: bool = field(default=True)

    @property
    def usable(self) -> bool:
        return self.files is not None


def read_listing(step_dir: Path, name: str) -> Listing:
    """The digest file `name` of a folder: usable, unusable (with why), or absent. Never raises for its content."""
    path = Path(step_dir) / name
    if not os.path.lexists(path):
        return Listing(name, present=False)
    if inside(step_dir, name) is None:
        return Listing(name, why="it resolves outside the checkpoint folder")
    try:
        raw = read_bounded(path, MAX_LISTING_BYTES, name)
    except FileNotFoundError:
        return Listing(name, present=False)
    except ValueError as e:
        return Listing(name, why=str(e))
    except OSError as e:
        return Listing(name, why=f"unreadable ({e.strerror or e})")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        return Listing(name, why=f"not JSON ({clip(type(e).__name__ + ': ' + str(e), 100)})")
    if not isinstance(doc, dict):
        return Listing(name, why="not a JSON object")
    algorithm = doc.get("algorithm", "sha256")  # Megatron's verifier: a missing algorithm is sha256
    if algorithm != "sha256":
        return Listing(name, why=f"algorithm {clip(algorithm, 40)} is not sha256")
    files = doc.get("files")
    if not isinstance(files, dict):
        return Listing(name, why='no "files" object')
    if not files:
        return Listing(name, why="it lists no files")
    out: dict[str, str] = {}
    for rel, hexd in files.items():
        if relpath_problem(rel) is not None:
            return Listing(name, why=f"a file name that is not a plain relative path ({clip(rel, 60)})")
        if rel == name:
            return Listing(name, why="it lists itself")
        if not isinstance(hexd, str) or not HEX64.match(hexd):
            return Listing(name, why=f"the digest of {clip(rel, 60)} is not a SHA-256 hex string")
        out[rel] = hexd.lower()
    return Listing(name, files=out)


def _hash_one(path: Path) -> tuple[int, str, str]:
    """(size, adopt's digest "xxh3_128:hex", sha256 hex) of one regular file, from one read of it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        from scout_ckpt.errors import BadInput

        raise BadInput(f"{path}: not a regular file; refusing to hash it")
    x, s, size = xxhash.xxh3_128(), hashlib.sha256(), 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(fd, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            x.update(view[:n])
            s.update(view[:n])
            size += n
    return size, f"{ALGO}:{x.hexdigest()}", s.hexdigest()


def hash_files(step_dir: Path, rels: list[str]) -> dict[str, tuple[int, str, str]]:
    """{rel: (size, adopt's digest, sha256)} for a folder's files, in parallel threads (both hashes release the
    GIL on large reads)."""
    if not rels:
        return {}
    threads = min(len(rels), os.cpu_count() or 1, 8)
    with ThreadPoolExecutor(threads) as pool:
        return dict(zip(rels, pool.map(lambda r: _hash_one(Path(step_dir) / r), rels)))


def compare(listing: Listing, sha: dict[str, str]) -> tuple[str, list[dict]]:
    """(status, reasons) of the files found ({rel: sha256}, the listing file itself excluded) against a usable
    listing: pass, or fail with one reason per file that differs, is absent, or is not listed."""
    reasons: list[dict] = []
    for rel in sorted(set(sha) | set(listing.files)):
        want, got = listing.files.get(rel), sha.get(rel)
        if want is None:
            reasons.append(
                {
                    "code": "unexpected_file",
                    "file": rel,
                    "evidence": listing.name,
                    "detail": f"not listed in {listing.name}: nothing written at save vouches for it",
                }
            )
        elif got is None:
            reasons.append({"code": "missing_file", "file": rel, "evidence": listing.name})
        elif got != want:
            reasons.append(
                {
                    "code": "digest_mismatch",
                    "file": rel,
                    "evidence": listing.name,
                    "expected": f"sha256:{want}",
                    "actual": f"sha256:{got}",
                }
            )
    return (FAIL if reasons else PASS), reasons


def integrity_evidence(listing: Listing, sha: dict[str, str] | None) -> dict:
    """The `integrity` evidence of a folder with a digest file: the comparison (`sha`: the files' SHA-256) when
    the listing is usable, else not_applicable with why it was not used."""
    if not listing.usable:
        return evidence(
            NOT_APPLICABLE,
            [{"code": "integrity_not_used", "file": listing.name, "detail": listing.why}],
            file=listing.name,
            used=False,
            not_used=f"{listing.name}: {listing.why}",
        )
    status, reasons = compare(listing, sha or {})
    return evidence(
        status,
        reasons,
        file=listing.name,
        used=True,
        algorithm="sha256",
        listed=len(listing.files),
        vouched_by=f"{listing.name}: SHA-256 of {len(listing.files)} file(s) written at save"
        + (", every file matched" if status == PASS else ""),
    )
