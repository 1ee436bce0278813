"""Byte-level verification of a committed checkpoint against its recorded file list.

Used by `certify`, by `resume` before it hands out a path, and by `load_latest_clean` (where each rank checks
a disjoint share of the files, so no rank re-reads everyone's bytes).

File names come from the ledger or a manifest, which a hostile or damaged run can hold: a name that is not a
normalized relative path (`..`, absolute, NUL) is refused as bad input before anything is joined, and a file that
is a symlink leading out of the step dir, or is not a regular file (a FIFO would block the hash for ever), is
never opened: it fails verification as `unsafe_file`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from scout_ckpt.errors import BadInput
from scout_ckpt.format.digests import digest_files, relpaths
from scout_ckpt.format.layout import DCP_METADATA, MANIFEST_NAME, is_folder_dir
from scout_ckpt.format.safepaths import clip, inside, is_regular, relpath_problem
from scout_ckpt.policy import FAIL, PASS, evidence


def checkpoint_dir(root: str | os.PathLike, rel: str) -> Path:
    """ROOT/rel for a step dir path recorded in the ledger; BadInput if rel is not a plain relative path inside
    ROOT (a tampered ledger must not send a verifier or an exporter elsewhere)."""
    if relpath_problem(rel) is not None or inside(root, rel) is None:
        raise BadInput(f"{root}: the ledger records a checkpoint path that escapes the root ({clip(rel, 80)})")
    return Path(root) / rel


def verify_files(step_dir: Path, files: list[dict], *, expect_complete: bool = True,
                 progress: Callable[[int], None] | None = None, dcp: bool | None = None,
                 hasher: Callable[..., dict] | None = None) -> dict:
    """Bytes evidence: every recorded file present with its size and digest; nothing missing or extra.

    `files` are {"path", "size", "digest"} rows (from the ledger or the manifest). With expect_complete the
    directory must hold exactly those files (plus the manifest) and a DCP `.metadata`. BadInput if a recorded
    name is not a normalized relative path. `hasher` replaces `digest_files` (same signature and result): `certify`
    passes `scan.StepScan.hasher`, which checks the tensors in the same read.
    """
    step_dir = Path(step_dir)
    for f in files:
        if relpath_problem(f.get("path")) is not None:
            raise BadInput(f"{step_dir}: a recorded file path escapes the checkpoint ({clip(f.get('path'), 80)})")
    reasons: list[dict] = []
    if not step_dir.is_dir():
        return evidence(FAIL, [{"code": "missing_dir", "path": str(step_dir)}], files_checked=0)
    present = {}
    for f in files:
        p = step_dir / f["path"]
        if not os.path.lexists(p):
            reasons.append({"code": "missing_file", "file": f["path"], "rank": f.get("rank")})
        elif inside(step_dir, f["path"]) is None:
            reasons.append({"code": "unsafe_file", "file": f["path"], "rank": f.get("rank"),
                            "detail": "a symlink leading out of the checkpoint"})
        elif not is_regular(p):
            reasons.append({"code": "unsafe_file" if p.exists() else "missing_file", "file": f["path"],
                            "rank": f.get("rank"), "detail": "not a regular file"})
        else:
            present[str(p)] = (os.path.realpath(p), f)   # hashed where it resolves, never re-resolved
    try:
        digests = (hasher or digest_files)(sorted({real for real, _ in present.values()}), progress=progress)
    except (OSError, BadInput) as e:  # replaced or removed while hashing
        return evidence(FAIL, reasons + [{"code": "unreadable_file", "detail": clip(str(e), 200)}],
                        files_checked=len(files))
    for real, f in present.values():
        size, digest = digests[real]
        if size != f["size"]:
            reasons.append({"code": "truncated_file" if size < f["size"] else "size_mismatch", "file": f["path"],
                            "rank": f.get("rank"), "expected": f["size"], "actual": size})
        elif digest != f["digest"]:
            reasons.append({"code": "digest_mismatch", "file": f["path"], "rank": f.get("rank"),
                            "expected": f["digest"], "actual": digest})
    if expect_complete:
        recorded = {f["path"] for f in files}
        # a Trainer checkpoint-N folder has no DCP .metadata; any other directory must (fail closed)
        if (not is_folder_dir(step_dir) if dcp is None else dcp) and DCP_METADATA not in recorded:
            reasons.append({"code": "missing_file", "file": DCP_METADATA})
        for extra in sorted(set(relpaths(step_dir)) - recorded - {MANIFEST_NAME}):
            reasons.append({"code": "unexpected_file", "file": extra})
    nbytes = sum(f["size"] for f in files)
    return evidence(FAIL if reasons else PASS, reasons, files_checked=len(files), bytes_checked=nbytes)
