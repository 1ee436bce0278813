"""`scout-ckpt ledger rebuild`: recreate the ledger's checkpoint rows from the manifests on disk.

The new ledger is built under a temp name and swapped in with a rename; the old one (if any) is kept beside it
as scout-ledger.db.bak-<time>, so a rebuild never destroys the history it cannot recreate (events, replays).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from scout_ckpt import manifest, policy
from scout_ckpt.errors import BadInput, ScoutError
from scout_ckpt.layout import LEDGER_NAME, dir_bytes, fsync_dir, list_step_dirs
from scout_ckpt.ledger import Ledger
from scout_ckpt.verify import verify_files


def rebuild(root: str | os.PathLike, *, verify: bool = True) -> dict:
    root = Path(root)
    if not root.is_dir():
        raise BadInput(f"{root}: {'not a directory' if root.exists() else 'no such directory'}")
    steps = list_step_dirs(root)
    manifests = {}
    skipped = []
    for step, d in steps.items():
        try:
            manifests[step] = manifest.read(d)
        except BadInput as e:
            skipped.append({"step": step, "reason": str(e)})
    if not manifests:
        raise BadInput(f"{root}: no checkpoint with a scout-manifest.json to rebuild from")
    build_dir = root / f".ledger-rebuild-{os.getpid()}"
    build_dir.mkdir()
    try:
        rows = []
        with Ledger.open(build_dir, create=True) as ledger:
            for run_id in sorted({m.get("run_id") or "unknown" for m, _ in manifests.values()}):
                first = next(m for m, _ in manifests.values() if (m.get("run_id") or "unknown") == run_id)
                ledger.begin_run(run_id, world_size=first.get("world_size") or 0, topology=first.get("topology", {}),
                                 policy=first["policy"], versions=first.get("versions", {}))
            for step, (m, digest) in sorted(manifests.items()):
                ev = dict(m["evidence"])
                if verify:
                    ev["bytes"] = verify_files(steps[step], m["files"])
                else:
                    ev["bytes"] = policy.evidence(policy.MISSING, [{"code": "bytes_unverified"}])
                v = policy.evaluate(m["policy"], ev)
                ledger.record_commit(step, run_id=m.get("run_id") or "unknown", path=steps[step].name,
                                     nbytes=dir_bytes(steps[step]), manifest_digest=digest, files=m["files"],
                                     evidence=ev, state=v.state, reasons=v.reasons, source="rebuild",
                                     attempt=m.get("attempt"))
                rows.append({"step": step, "state": v.state, "reasons": v.reasons})
        final = root / LEDGER_NAME
        backup = None
        if final.exists():
            backup = root / f"{LEDGER_NAME}.bak-{time.strftime('%Y%m%dT%H%M%S')}"
            for suffix in ("", "-wal", "-shm"):
                if Path(f"{final}{suffix}").exists():
                    os.rename(f"{final}{suffix}", f"{backup}{suffix}")
        os.rename(build_dir / LEDGER_NAME, final)
        fsync_dir(root)
    except OSError as e:
        raise ScoutError(f"{root}: ledger rebuild failed ({e.strerror})") from None
    finally:
        for f in build_dir.glob("*"):
            f.unlink()
        build_dir.rmdir()
    return {"checkpoints": rows, "skipped": skipped, "backup": str(backup) if backup else None}
