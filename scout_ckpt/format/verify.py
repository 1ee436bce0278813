"""Byte-level verification of a committed checkpoint against its recorded file list.

Used by `certify`, by `resume` before it hands out a path, and by `load_latest_clean` (where each rank checks
a disjoint share of the files, so no rank re-reads everyone's bytes).

File names come from the ledger or a manifest, which a hostile or damaged run can hold: a name that is not a
normalized relative path (`..`, absolute, NUL) is refused as bad input before anything is joined, and a file that
is a symlink leading out of the step dir, or is not a regular file (a FIFO would block the hash for ever), is
never opened: it fails verification as `unsafe_file`.

Could not check is not bad (docs/design.md, "Faults of the world"): an I/O error other than "no such file" (EIO,
EACCES, ESTALE, a timeout) while looking at or reading a file says nothing about the bytes. It gives the reason
`could_not_check` and, unless a real fault was also found, evidence whose status is `missing` with
"could_not_check": True (`could_not_check(ev)`), never `fail`: callers walk past such a checkpoint for this call
and record nothing. A missing file, a size or digest mismatch, an unsafe file stay failures (rejections).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Callable

from scout_ckpt.errors import BadInput
from scout_ckpt.format import node_manifest
from scout_ckpt.format.digests import digest_files, relpaths
from scout_ckpt.format.layout import DCP_METADATA, MANIFEST_NAME, is_folder_dir
from scout_ckpt.format.safepaths import clip, inside, relpath_problem
from scout_ckpt.policy import FAIL, MISSING, PASS, evidence

COULD_NOT_CHECK = "could_not_check"


def is_absent(e: OSError) -> bool:
    """The error says the file is not there (a missing file is a verdict; any other I/O error is not)."""
    return isinstance(e, (FileNotFoundError, NotADirectoryError)) or e.errno in (errno.ENOENT, errno.ENOTDIR)


def unchecked_reason(e: OSError, file: str | None = None, **extra) -> dict:
    """The `could_not_check` reason of an I/O error: which file, the errno's name and the system's words."""
    out = {
        "code": COULD_NOT_CHECK,
        "errno": errno.errorcode.get(e.errno or 0, str(e.errno)),
        "detail": clip(e.strerror or str(e), 200),
        **extra,
    }
    if file is not None:
        out["file"] = file
    return out


def could_not_check(ev: dict | None) -> bool:
    """Evidence that is only "could not check now": no fault found, some file not checked for an I/O error."""
    if not ev:
        return False
    return ev.get("status") != FAIL and any(r.get("code") == COULD_NOT_CHECK for r in ev.get("reasons") or [])


def only_unchecked(reasons: list[dict]) -> bool:
    """Reasons that all say "could not check" (none a fault): nothing to record, walk past for now."""
    return bool(reasons) and all(r.get("code") == COULD_NOT_CHECK for r in reasons)


def _outcome(reasons: list[dict], unchecked: list[dict], **detail) -> dict:
    if reasons:
        return evidence(FAIL, reasons + unchecked, **detail)
    if unchecked:
        return evidence(MISSING, unchecked, could_not_check=True, **detail)
    return evidence(PASS, [], **detail)


def checkpoint_dir(root: str | os.PathLike, rel: str) -> Path:
    """ROOT/rel for a step dir path recorded in the ledger; BadInput if rel is not a plain relative path inside
    ROOT (a tampered ledger must not send a verifier or an exporter elsewhere)."""
    if relpath_problem(rel) is not None or inside(root, rel) is None:
        raise BadInput(f"{root}: the ledger records a checkpoint path that escapes the root ({clip(rel, 80)})")
    return Path(root) / rel


def verify_files(
    step_dir: Path,
    files: list[dict],
    *,
    expect_complete: bool = True,
    progress: Callable[[int], None] | None = None,
    dcp: bool | None = None,
    hasher: Callable[..., dict] | None = None,
) -> dict:
    """Bytes evidence: every recorded file present with its size and digest; nothing missing or extra.

    `files` are {"path", "size", "digest"} rows (from the ledger or the manifest); a node manifest's row
    (format/node_manifest.py) stands for its node's rows, read from it once its own bytes match. With expect_complete the
    directory must hold exactly those files (plus the manifest) and a DCP `.metadata`. BadInput if a recorded
    name is not a normalized relative path. `hasher` replaces `digest_files` (same signature and result): `certify`
    passes `scan.StepScan.hasher`, which checks the tensors in the same read.
    """
    step_dir = Path(step_dir)
    for f in files:
        if relpath_problem(f.get("path")) is not None:
            raise BadInput(f"{step_dir}: a recorded file path escapes the checkpoint ({clip(f.get('path'), 80)})")
    reasons: list[dict] = []
    unchecked: list[dict] = []
    try:
        if not stat.S_ISDIR(os.stat(step_dir).st_mode):
            return evidence(FAIL, [{"code": "missing_dir", "path": str(step_dir)}], files_checked=0)
    except OSError as e:
        if is_absent(e):
            return evidence(FAIL, [{"code": "missing_dir", "path": str(step_dir)}], files_checked=0)
        return _outcome([], [unchecked_reason(e, path=str(step_dir))], files_checked=0)
    if any(node_manifest.is_node_entry(f) for f in files):  # a multi-node save: each node's rows in its file
        files, reasons, unchecked = node_manifest.expand(step_dir, files)
    unchecked_nodes = bool(unchecked)
    present = {}
    for f in files:
        p = step_dir / f["path"]
        try:
            os.lstat(p)
        except OSError as e:
            if is_absent(e):
                reasons.append({"code": "missing_file", "file": f["path"], "rank": f.get("rank")})
            else:
                unchecked.append(unchecked_reason(e, f["path"], rank=f.get("rank")))
            continue
        if inside(step_dir, f["path"]) is None:
            reasons.append(
                {
                    "code": "unsafe_file",
                    "file": f["path"],
                    "rank": f.get("rank"),
                    "detail": "a symlink leading out of the checkpoint",
                }
            )
            continue
        try:
            regular = stat.S_ISREG(os.stat(p).st_mode)
        except OSError as e:
            if is_absent(e):  # a dangling symlink
                reasons.append(
                    {"code": "missing_file", "file": f["path"], "rank": f.get("rank"), "detail": "not a regular file"}
                )
            else:
                unchecked.append(unchecked_reason(e, f["path"], rank=f.get("rank")))
            continue
        if not regular:
            reasons.append(
                {"code": "unsafe_file", "file": f["path"], "rank": f.get("rank"), "detail": "not a regular file"}
            )
        else:
            present[str(p)] = (os.path.realpath(p), f)  # hashed where it resolves, never re-resolved
    try:
        digests = (hasher or digest_files)(sorted({real for real, _ in present.values()}), progress=progress)
    except BadInput as e:  # replaced by something that is not a regular file while hashing
        return evidence(
            FAIL,
            reasons + [{"code": "unreadable_file", "detail": clip(str(e), 200)}] + unchecked,
            files_checked=len(files),
        )
    except OSError as e:
        name = _recorded_name(e, present)
        if is_absent(e):  # removed while hashing
            return evidence(
                FAIL,
                reasons + [{"code": "missing_file", "file": name, "detail": "removed while hashing"}] + unchecked,
                files_checked=len(files),
            )
        return _outcome(reasons, unchecked + [unchecked_reason(e, name)], files_checked=len(files))
    for real, f in present.values():
        size, digest = digests[real]
        if size != f["size"]:
            reasons.append(
                {
                    "code": "truncated_file" if size < f["size"] else "size_mismatch",
                    "file": f["path"],
                    "rank": f.get("rank"),
                    "expected": f["size"],
                    "actual": size,
                }
            )
        elif digest != f["digest"]:
            reasons.append(
                {
                    "code": "digest_mismatch",
                    "file": f["path"],
                    "rank": f.get("rank"),
                    "expected": f["digest"],
                    "actual": digest,
                }
            )
    if expect_complete:
        recorded = {f["path"] for f in files}
        # a Trainer checkpoint-N folder has no DCP .metadata; any other directory must (fail closed)
        if (not is_folder_dir(step_dir) if dcp is None else dcp) and DCP_METADATA not in recorded:
            reasons.append({"code": "missing_file", "file": DCP_METADATA})
        # a node manifest that could not be read leaves its node's files unaccounted for, not unexpected
        for extra in [] if unchecked_nodes else sorted(set(relpaths(step_dir)) - recorded - {MANIFEST_NAME}):
            reasons.append({"code": "unexpected_file", "file": extra})
    nbytes = sum(f["size"] for f in files)
    return _outcome(reasons, unchecked, files_checked=len(files), bytes_checked=nbytes)


def _recorded_name(e: OSError, present: dict) -> str | None:
    """The recorded name of the file an OSError names (its path as hashed), if it names one."""
    if e.filename is None:
        return None
    for real, f in present.values():
        if os.fspath(e.filename) == real:
            return f["path"]
    return os.path.basename(os.fspath(e.filename))
