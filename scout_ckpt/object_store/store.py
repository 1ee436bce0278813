"""One object-store root (`s3://bucket/prefix`) through fsspec: attempt prefixes, the manifest as commit marker,
verification by parallel ranged reads, listing, deletion, and stale multipart uploads.

Every network call is here, so the commit protocol (commit.py), settling (settle.py) and retention
(retention.py) stay storage-agnostic.
"""

from __future__ import annotations

import collections
import contextlib
import json
import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import xxhash

from scout_ckpt.errors import BadInput, ManifestExists, ScoutError
from scout_ckpt.format import layout
from scout_ckpt.format import manifest as manifest_mod
from scout_ckpt.format import node_manifest as fm
from scout_ckpt.format.digests import ALGO, CHUNK, bytes_digest
from scout_ckpt.format.safepaths import clip, relpath_problem
from scout_ckpt.format.verify import is_absent, unchecked_reason
from scout_ckpt.policy import FAIL, MISSING, PASS, evidence

# Ranged GETs in flight at once when verifying (each CHUNK bytes): object stores reward parallel requests far
# more than local disks do; the window bounds memory to THREADS x 2 x CHUNK.
THREADS = 8


def _import_fsspec():
    try:
        import fsspec  # noqa: F401
        from fsspec.core import url_to_fs
    except ImportError:  # pragma: no cover - the extra is missing
        raise ScoutError("object-store roots need the s3 extra: pip install 'scout-ckpt[s3]'") from None
    return url_to_fs


class ObjectStore:
    """An fsspec filesystem and a base prefix. `storage_options` go to the filesystem (s3fs: client_kwargs=
    {"endpoint_url": ...}, default_block_size=..., key/secret); listings are never cached (a cached listing
    would hide a manifest written by another process)."""

    def __init__(self, uri: str, storage_options: dict):
        url_to_fs = _import_fsspec()
        self.uri = uri.rstrip("/")
        self.protocol = self.uri.split("://", 1)[0]
        self.storage_options = dict(storage_options)  # as given (credentials included): never written as is
        opts = dict(storage_options)
        if self.protocol == "s3":
            opts.setdefault("use_listings_cache", False)
            try:
                import s3fs  # noqa: F401
            except ImportError:
                raise ScoutError("s3:// roots need s3fs: pip install 'scout-ckpt[s3]'") from None
        try:
            self.fs, self.base = url_to_fs(self.uri, **opts)
        except (ValueError, ImportError) as e:
            raise ScoutError(f"{self.uri}: cannot open ({e})") from None
        self.base = self.base.rstrip("/")
        self.conditional_create = self.protocol == "s3"

    # ---- names ---------------------------------------------------------------------------------------------

    def key(self, name: str, *rest: str) -> str:
        """The filesystem path of ATTEMPT[/file] (no scheme)."""
        return posixpath.join(self.base, name, *rest)

    def uri_of(self, name: str) -> str:
        return f"{self.uri}/{name}"

    # ---- writing -------------------------------------------------------------------------------------------

    def publish_manifest(self, name: str, data: bytes) -> str:
        """Write the commit marker: conditional create (If-None-Match: *) where the store honours it, so a
        manifest is never overwritten. Where it does not (other fsspec backends), the ledger's `writing` row,
        recorded before any data, is what names the one attempt allowed to publish under this fresh prefix."""
        path = self.key(name, layout.MANIFEST_NAME)
        if self.conditional_create:
            try:
                with self.fs.open(path, "xb") as f:
                    f.write(data)
            except FileExistsError:
                raise ManifestExists(f"{self.uri_of(name)}: manifest already exists; not overwritten") from None
        else:
            if self.fs.exists(path):
                raise ManifestExists(f"{self.uri_of(name)}: manifest already exists; not overwritten")
            with self.fs.open(path, "wb") as f:
                f.write(data)
        return bytes_digest(data)

    def write_object(self, name: str, rel: str, data: bytes) -> None:
        """One small object of attempt `name` (a node manifest), stored when this returns. Created, never
        overwritten, where the store honours a conditional create: an attempt's prefix is written once."""
        with self.fs.open(self.key(name, rel), "xb" if self.conditional_create else "wb") as f:
            f.write(data)

    def read_bytes(self, name: str, rel: str, limit: int | None = None) -> bytes:
        """One object whole (FileNotFoundError if absent); ValueError if over `limit` bytes."""
        path = self.key(name, rel)
        if limit is not None:
            size = self.fs.size(path)
            if size is not None and size > limit:
                raise ValueError(f"{rel} is {size} bytes, over the {limit}-byte limit")
        return self.fs.cat_file(path)

    # ---- the manifest --------------------------------------------------------------------------------------

    def has_manifest(self, name: str) -> bool:
        return self.fs.exists(self.key(name, layout.MANIFEST_NAME))

    def read_manifest(self, name: str) -> tuple[dict, str]:
        """(manifest, digest of its bytes), with manifest.read's checks; BadInput if missing or malformed."""
        where = self.uri_of(name)
        try:
            data = self.read_bytes(name, layout.MANIFEST_NAME, manifest_mod.max_manifest_bytes())
        except FileNotFoundError:
            raise BadInput(f"{where}: no {layout.MANIFEST_NAME} (the attempt never committed)") from None
        except (ValueError, OSError) as e:
            raise BadInput(f"{where}: unreadable manifest ({clip(e, 160)})") from None
        return parse_manifest(data, where), bytes_digest(data)

    def trusted_manifest(self, row: dict) -> tuple[dict | None, list[dict]]:
        """recovery.trusted_manifest for an attempt prefix: the manifest if it reads and matches the digest the
        ledger recorded, else the reasons not to trust it."""
        try:
            m, digest = self.read_manifest(row["path"])
        except BadInput as e:
            return None, [{"code": "bad_manifest", "detail": str(e)}]
        if row.get("manifest_digest") and digest != row["manifest_digest"]:
            return m, [{"code": "manifest_mismatch"}]
        return m, []

    # ---- listing -------------------------------------------------------------------------------------------

    def objects(self, name: str | None = None) -> dict[str, int]:
        """{relative key: size} of every object under the root (or under one attempt prefix)."""
        base = self.key(name) if name else self.base
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for path, info in found.items():
            if info.get("type", "file") != "file":
                continue
            rel = path[len(base) :].lstrip("/") if path.startswith(base) else path
            out[rel] = int(info.get("size") or 0)
        return out

    def attempts(self) -> dict[str, bool]:
        """{attempt prefix name: has a manifest} for every `step-N.attempt-X/` prefix holding any object."""
        out: dict[str, bool] = {}
        for rel in self.objects():
            head, _, tail = rel.partition("/")
            if layout.parse_attempt_dir(head) is None:
                continue
            out[head] = out.get(head, False) or tail == layout.MANIFEST_NAME
        return out

    def committed(self) -> dict[int, list[str]]:
        """{step: [attempt prefixes with a manifest]}: what can be listed at all. A step without its manifest is
        never here."""
        out: dict[int, list[str]] = collections.defaultdict(list)
        for name, has in sorted(self.attempts().items()):
            if has:
                out[layout.parse_attempt_dir(name)[0]].append(name)
        return dict(sorted(out.items()))

    # ---- verification: parallel ranged reads ---------------------------------------------------------------

    def verify(
        self,
        name: str,
        files: list[dict],
        *,
        expect_complete: bool = True,
        progress: Callable[[int], None] | None = None,
    ) -> dict:
        """verify.verify_files for an attempt prefix. Sizes come from one listing (a missing or short object
        costs no read); then every file is read in CHUNK-sized ranged GETs, THREADS in flight across all files,
        each file hashed in order as its ranges arrive."""
        files, node_reasons, node_unchecked = self._expand(name, files)
        listed, reasons, todo = self._sizes(name, files)
        if not listed:
            return evidence(FAIL, [{"code": "missing_dir", "path": self.uri_of(name)}], files_checked=0)
        reasons = node_reasons + reasons
        try:
            digests = self._digests(name, todo, progress)
        except OSError as e:
            if is_absent(e):  # removed while read: a missing file
                return evidence(
                    FAIL, reasons + [{"code": "missing_file", "detail": clip(str(e), 200)}], files_checked=len(files)
                )
            # a timeout, a 5xx, an unreachable store: could not check now, which is not a fault (format/verify.py)
            unchecked = [unchecked_reason(e)]
            return (
                evidence(FAIL, reasons + unchecked, files_checked=len(files))
                if reasons
                else evidence(MISSING, unchecked, could_not_check=True, files_checked=len(files))
            )
        reasons += _digest_reasons(todo, digests)
        if expect_complete:
            recorded = {f["path"] for f in files}
            if layout.DCP_METADATA not in recorded:
                reasons.append({"code": "missing_file", "file": layout.DCP_METADATA})
            # a node manifest that could not be read leaves its node's objects unaccounted for, not unexpected
            for extra in [] if node_unchecked else sorted(set(listed) - recorded - {layout.MANIFEST_NAME}):
                reasons.append({"code": "unexpected_file", "file": extra})
        detail = {"files_checked": len(files), "bytes_checked": sum(f["size"] for f in files)}
        if reasons:
            return evidence(FAIL, reasons + node_unchecked, **detail)
        if node_unchecked:  # the store could not be read now: not evidence of damage (format/verify.py)
            return evidence(MISSING, node_unchecked, could_not_check=True, **detail)
        return evidence(PASS, [], **detail)

    def fetch(self, name: str, files: list[dict], dest) -> list[dict]:
        """Copy an attempt's recorded files to the local directory `dest` (same relative names) with the ranged
        reads `verify` uses, hashing every byte as it is written. Returns `verify`'s reasons for what was
        written (sizes from one listing first, then digests): empty means the local copy is exactly what the
        record vouches for, so a caller that reads only the local copy reads the bytes it verified (no second
        fetch that could differ)."""
        import os
        from pathlib import Path

        files, reasons, unchecked = self._expand(name, files)
        if reasons or unchecked:
            return reasons + unchecked
        _, reasons, _ = self._sizes(name, files)
        if reasons:
            return reasons
        dest = Path(dest)
        with contextlib.ExitStack() as stack:
            outs = {}
            for f in files:
                target = dest / f["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                outs[f["path"]] = stack.enter_context(open(target, "xb"))
            try:
                digests = self._digests(name, files, None, lambda path, data: outs[path].write(data))
            except OSError as e:
                return [{"code": "unreadable_file", "detail": clip(str(e), 200)}]
            for out in outs.values():
                out.flush()
                os.fsync(out.fileno())
        return _digest_reasons(files, digests)

    def _expand(self, name: str, files: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
        """format/node_manifest.expand on an attempt prefix: the per-rank rows of every node manifest object whose
        bytes match its row (a save of several nodes records one row per node). An error other than the store's
        own OSError (a client error while the store is unreachable) is could-not-check too, never damage."""
        if not any(fm.is_node_entry(f) for f in files):
            return files, [], []

        def read(rel: str) -> bytes:
            try:
                return self.read_bytes(name, rel, fm.MAX_NODE_MANIFEST_BYTES)
            except (OSError, ValueError):
                raise
            except Exception as e:  # noqa: BLE001 - botocore's connection errors are not OSErrors
                raise OSError(f"{type(e).__name__}: {e}") from e

        return fm.expand(None, files, read=read)

    def _sizes(self, name: str, files: list[dict]) -> tuple[dict[str, int], list[dict], list[dict]]:
        """(the attempt's listing, the reasons of missing or wrongly sized files, the files whose size matches):
        one listing, no read. BadInput first if a recorded path would escape the checkpoint."""
        for f in files:
            if relpath_problem(f.get("path")) is not None:
                raise BadInput(
                    f"{self.uri_of(name)}: a recorded file path escapes the checkpoint ({clip(f.get('path'), 80)})"
                )
        listed = self.objects(name)
        reasons, sized = [], []
        for f in files:
            size = listed.get(f["path"])
            if size is None:
                reasons.append({"code": "missing_file", "file": f["path"], "rank": f.get("rank")})
            elif size != f["size"]:
                reasons.append(
                    {
                        "code": "truncated_file" if size < f["size"] else "size_mismatch",
                        "file": f["path"],
                        "rank": f.get("rank"),
                        "expected": f["size"],
                        "actual": size,
                    }
                )
            else:
                sized.append(f)
        return listed, reasons, sized

    def _digests(self, name: str, files: list[dict], progress, sink=None) -> dict[str, str]:
        ranges = [
            (f["path"], start, min(start + CHUNK, f["size"]))
            for f in files
            for start in range(0, max(f["size"], 1), CHUNK)
        ]
        hashers = {f["path"]: xxhash.xxh3_128() for f in files}

        def get(r):
            path, start, end = r
            if end <= start:
                return b""
            data = self.fs.cat_file(self.key(name, path), start=start, end=end)
            if len(data) != end - start:
                raise OSError(f"{path}: short ranged read at {start} ({len(data)} of {end - start} bytes)")
            return data

        window: collections.deque = collections.deque()
        with ThreadPoolExecutor(THREADS) as pool:
            it = iter(ranges)
            for r in it:
                window.append((r, pool.submit(get, r)))
                if len(window) >= 2 * THREADS:
                    self._take(window, hashers, progress, sink)
            while window:
                self._take(window, hashers, progress, sink)
        return {p: f"{ALGO}:{h.hexdigest()}" for p, h in hashers.items()}

    @staticmethod
    def _take(window, hashers, progress, sink=None) -> None:
        (path, _, _), fut = window.popleft()
        data = fut.result()
        hashers[path].update(data)
        if sink is not None:
            sink(path, data)
        if progress is not None and data:
            progress(len(data))

    # ---- deletion and stale uploads ------------------------------------------------------------------------

    def delete_attempt(self, name: str) -> None:
        """Remove an attempt prefix, its manifest first: from the first request on it is no longer listed as
        committed, so a crash part-way leaves objects without a manifest (swept later), never a torn step."""
        manifest = self.key(name, layout.MANIFEST_NAME)
        if self.fs.exists(manifest):
            self.fs.rm_file(manifest)
        rest = [self.key(name, rel) for rel in self.objects(name)]
        if rest:
            self.fs.rm(rest)

    def multipart_uploads(self) -> list[dict]:
        """Unfinished multipart uploads under the root: [{"key", "upload_id", "attempt", "initiated"}]. Empty
        for stores without multipart uploads."""
        if self.protocol != "s3":
            return []
        bucket, _, prefix = self.base.partition("/")
        out, kw = [], {"Bucket": bucket, "Prefix": (prefix + "/") if prefix else ""}
        while True:
            resp = self.fs.call_s3("list_multipart_uploads", **kw)
            for u in resp.get("Uploads") or []:
                rel = u["Key"][len(kw["Prefix"]) :]
                head = rel.split("/", 1)[0]
                out.append(
                    {"key": u["Key"], "upload_id": u["UploadId"], "attempt": head, "initiated": str(u.get("Initiated"))}
                )
            if not resp.get("IsTruncated"):
                return out
            kw.update(KeyMarker=resp.get("NextKeyMarker"), UploadIdMarker=resp.get("NextUploadIdMarker"))

    def abort_upload(self, upload: dict) -> None:
        bucket = self.base.partition("/")[0]
        self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["key"], UploadId=upload["upload_id"])


def parse_manifest(data: bytes, where: str) -> dict:
    """manifest.read's checks on bytes fetched from an object store (no symlinks to resolve there)."""
    try:
        m = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise BadInput(f"{where}: malformed manifest ({clip(type(e).__name__ + ': ' + str(e), 160)})") from None
    if not isinstance(m, dict) or any(k not in m for k in manifest_mod.REQUIRED_KEYS):
        raise BadInput(f"{where}: malformed manifest (missing keys)")
    if m["format"] != manifest_mod.FORMAT:
        raise BadInput(f"{where}: unknown manifest format {clip(m['format'], 60)}")
    if type(m["step"]) is not int or not isinstance(m["evidence"], dict) or not isinstance(m["policy"], dict):
        raise BadInput(f"{where}: malformed manifest (step, evidence or policy of the wrong type)")
    files, seen = m["files"], set()
    if not isinstance(files, list):
        raise BadInput(f"{where}: malformed manifest: bad file list")
    for f in files:
        if not isinstance(f, dict) or not {"path", "size", "digest"} <= set(f):
            raise BadInput(f"{where}: malformed manifest: bad file list")
        if relpath_problem(f["path"]) is not None or f["path"] in seen:
            raise BadInput(f"{where}: malformed manifest: bad or repeated file path ({clip(f['path'], 80)})")
        seen.add(f["path"])
        if type(f["size"]) is not int or f["size"] < 0 or not isinstance(f["digest"], str):
            raise BadInput(f"{where}: malformed manifest: bad size or digest for {clip(f['path'], 80)}")
    return m


def _digest_reasons(files: list[dict], digests: dict[str, str]) -> list[dict]:
    return [
        {
            "code": "digest_mismatch",
            "file": f["path"],
            "rank": f.get("rank"),
            "expected": f["digest"],
            "actual": digests[f["path"]],
        }
        for f in files
        if digests[f["path"]] != f["digest"]
    ]
