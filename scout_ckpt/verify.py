"""Byte-level verification of a committed checkpoint against its recorded file list.

Used by `certify`, by `resume` before it hands out a path, and by `load_latest_clean` (where each rank checks
a disjoint share of the files, so no rank re-reads everyone's bytes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from scout_ckpt.digests import digest_files, relpaths
from scout_ckpt.layout import DCP_METADATA, MANIFEST_NAME
from scout_ckpt.policy import FAIL, PASS, evidence


def verify_files(step_dir: Path, files: list[dict], *, expect_complete: bool = True,
                 progress: Callable[[int], None] | None = None) -> dict:
    """Bytes evidence: every recorded file present with its size and digest; nothing missing or extra.

    `files` are {"path", "size", "digest"} rows (from the ledger or the manifest). With expect_complete the
    directory must hold exactly those files (plus the manifest) and a DCP `.metadata`.
    """
    step_dir = Path(step_dir)
    reasons: list[dict] = []
    if not step_dir.is_dir():
        return evidence(FAIL, [{"code": "missing_dir", "path": str(step_dir)}], files_checked=0)
    present = {}
    for f in files:
        p = step_dir / f["path"]
        if not p.is_file():
            reasons.append({"code": "missing_file", "file": f["path"], "rank": f.get("rank")})
        else:
            present[str(p)] = f
    digests = digest_files(present.keys(), progress=progress)
    for path, f in present.items():
        size, digest = digests[path]
        if size != f["size"]:
            reasons.append({"code": "truncated_file" if size < f["size"] else "size_mismatch", "file": f["path"],
                            "rank": f.get("rank"), "expected": f["size"], "actual": size})
        elif digest != f["digest"]:
            reasons.append({"code": "digest_mismatch", "file": f["path"], "rank": f.get("rank"),
                            "expected": f["digest"], "actual": digest})
    if expect_complete:
        recorded = {f["path"] for f in files}
        if DCP_METADATA not in recorded:
            reasons.append({"code": "missing_file", "file": DCP_METADATA})
        for extra in set(relpaths(step_dir)) - recorded - {MANIFEST_NAME}:
            reasons.append({"code": "unexpected_file", "file": extra})
    nbytes = sum(f["size"] for f in files)
    return evidence(FAIL if reasons else PASS, reasons, files_checked=len(files), bytes_checked=nbytes)
