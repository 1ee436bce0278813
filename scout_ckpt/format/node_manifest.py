"""scout-node-NNNNN.json: one node's part of a checkpoint's file list, with its own digest.

Why it exists: in a job of many nodes the per-rank file lists and digests would all travel to the coordinator,
land in scout-manifest.json and in one ledger row per rank-file, so that what one process receives and writes per
save, and the ledger per checkpoint, grow with the rank count. Instead each node's aggregator (its local rank 0)
writes its ranks' rows into a node manifest inside the checkpoint, and the top-level manifest and the ledger hold
one entry per node: {"path": "scout-node-00001.json", "size", "digest", "rank": the aggregator's rank, "node",
"ranks", "files", "bytes"} (the last four are totals, said again where readers want them without opening the node
manifest). A single-node job writes no node manifest: its file list stays flat, as before. On an object-store
root a node manifest is one more object of the save attempt's prefix (written by its aggregator before the
coordinator publishes the top manifest), read back through the store for every byte check.

Trust: a node manifest is read only where its bytes match the digest recorded for it (in the ledger or the top
manifest, itself digest-checked), so its rows are as trustworthy as the flat rows they replace. `expand` turns a
file list with node entries into the flat list every byte check needs; a node manifest that is missing or altered
fails as any recorded file does, and its node's data files then fail as unrecorded.
"""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path
from typing import Callable

from scout_ckpt.format.digests import bytes_digest
from scout_ckpt.format.layout import DCP_METADATA, MANIFEST_NAME
from scout_ckpt.format.safepaths import clip, read_bounded, relpath_problem

FORMAT = "scout-node-manifest/1"
NAME_RE = re.compile(r"^scout-node-(\d{5,})\.json$")
# a node manifest holds a few rows per rank of one node: far below the top manifest's limit
MAX_NODE_MANIFEST_BYTES = 16 << 20


def name(node: int) -> str:
    return f"scout-node-{node:05d}.json"


def is_node_entry(f: dict) -> bool:
    """Whether a file list row names a node manifest (by its name: the ledger keeps path, size, digest, rank)."""
    return isinstance(f.get("path"), str) and NAME_RE.match(f["path"]) is not None


def build(node: int, step: int, attempt: str | None, reports: list[dict]) -> dict:
    """The node manifest of `reports` ([{"rank", "files", "finite_bad"}], one per rank of the node, as each rank
    reports at a save). The DCP `.metadata` stays in the top-level manifest (the coordinator writes it)."""
    files = sorted(
        (dict(f, rank=r["rank"]) for r in reports for f in r["files"] if f["path"] != DCP_METADATA),
        key=lambda f: f["path"],
    )
    return {
        "format": FORMAT,
        "node": node,
        "step": step,
        "attempt": attempt,
        "ranks": sorted(r["rank"] for r in reports),
        "files": files,
        "finite_bad": {str(r["rank"]): r["finite_bad"] for r in reports if r.get("finite_bad")},
    }


def encode(doc: dict) -> bytes:
    return (json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str) + "\n").encode()


def entry(doc: dict, data: bytes, leader: int) -> dict:
    """The top-level row of a node manifest whose bytes are `data`."""
    return {
        "path": name(doc["node"]),
        "size": len(data),
        "digest": bytes_digest(data),
        "rank": leader,
        "node": doc["node"],
        "ranks": len(doc["ranks"]),
        "files": len(doc["files"]),
        "bytes": sum(f["size"] for f in doc["files"]),
    }


def totals(files: list[dict]) -> tuple[int, int]:
    """(data files, bytes) of a file list, node entries counted by the totals they carry."""
    n = b = 0
    for f in files:
        if is_node_entry(f) and "files" in f:
            n += int(f["files"])
            b += int(f.get("bytes") or 0)
        else:
            n += 1
            b += int(f.get("size") or 0)
    return n, b


def stored_bytes(files: list[dict]) -> int:
    """Bytes a checkpoint holds by its file list: every listed file's size plus the bytes each node manifest's row
    says its node's files hold (the ledger's `nbytes` of an object-store attempt, at the save and at a rebuild)."""
    return sum(int(f.get("size") or 0) + (int(f.get("bytes") or 0) if is_node_entry(f) else 0) for f in files)


def parse(data: bytes, what: str) -> dict:
    """A node manifest from its bytes; ValueError (one line) if it is not one or its rows are unusable."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{what}: malformed node manifest ({clip(type(e).__name__, 40)})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), list):
        raise ValueError(f"{what}: not a node manifest")
    for f in doc["files"]:
        if not isinstance(f, dict) or not {"path", "size", "digest"} <= set(f):
            raise ValueError(f"{what}: bad file row")
        p = f["path"]
        if relpath_problem(p) is not None or p in (MANIFEST_NAME, DCP_METADATA) or NAME_RE.match(str(p)):
            raise ValueError(f"{what}: file path not allowed in a node manifest ({clip(p, 80)})")
        if type(f["size"]) is not int or f["size"] < 0 or not isinstance(f["digest"], str):
            raise ValueError(f"{what}: bad size or digest for {clip(p, 80)}")
    return doc


def expand(
    step_dir: Path | None, files: list[dict], *, read: Callable[[str], bytes] | None = None
) -> tuple[list[dict], list[dict], list[dict]]:
    """(flat files, reasons, I/O errors): `files` with the rows of every node manifest whose bytes match its
    recorded size and digest added after it (the node entries stay: their own bytes are checked like any file).

    Where the bytes come from: `step_dir`/name on a filesystem, or `read(name)` (an object store's attempt prefix:
    ObjectStore.verify), which returns the object's bytes or raises as a file read does (FileNotFoundError when
    absent, ValueError when too large, another OSError when the store cannot be read now).

    A node manifest that is absent or differs from its record adds nothing here (the byte check of its own row
    fails it); one whose bytes match but which is unusable adds a `bad_node_manifest` reason; a row named twice
    adds `file_listed_twice`; an I/O error other than "no such file" is could-not-check (`errno`, `file`)."""
    if read is None:
        if step_dir is None:
            raise TypeError("expand: give the step dir or a reader")
        base = Path(step_dir)

        def read(rel: str) -> bytes:
            return read_bounded(base / rel, MAX_NODE_MANIFEST_BYTES, rel)

    out = list(files)
    reasons: list[dict] = []
    unchecked: list[dict] = []
    seen = {f["path"] for f in files}
    for f in files:
        if not is_node_entry(f):
            continue
        try:
            data = read(f["path"])
        except ValueError:
            continue  # not a regular file or too large: the byte check of its own row says which
        except OSError as e:
            if not isinstance(e, (FileNotFoundError, NotADirectoryError)) and e.errno not in (
                errno.ENOENT,
                errno.ENOTDIR,
            ):
                unchecked.append(
                    {
                        "code": "could_not_check",
                        "errno": errno.errorcode.get(e.errno or 0, str(e.errno)),
                        "detail": clip(e.strerror or str(e), 200),
                        "file": f["path"],
                    }
                )
            continue
        if len(data) != f.get("size") or bytes_digest(data) != f.get("digest"):
            continue
        try:
            doc = parse(data, f["path"])
        except ValueError as e:
            reasons.append({"code": "bad_node_manifest", "file": f["path"], "detail": str(e)})
            continue
        for row in doc["files"]:
            if row["path"] in seen:
                reasons.append({"code": "file_listed_twice", "file": row["path"], "node_manifest": f["path"]})
                continue
            seen.add(row["path"])
            out.append({**row, "node": doc.get("node")})
    return out, reasons, unchecked
