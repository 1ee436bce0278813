"""One foreign DCP step dir adopted: every file digested, the structure checked, the invariants run offline, and
the manifest and verdict built under the ADOPTED policy (bytes + structure + invariants). Shared by the POSIX
adopt (ops/adopt.py) and the object-store adopt (ops/adopt_bucket.py); writes nothing itself."""

from __future__ import annotations

from pathlib import Path

from scout_ckpt import policy
from scout_ckpt.errors import BadInput
from scout_ckpt.format import digests, layout, manifest
from scout_ckpt.policy import FAIL, MISSING, PASS, evidence

DEFAULT_INVARIANTS = ["finite"]


def _invariants(step_dir: Path, checks, structure: dict) -> dict:
    if structure["status"] != PASS:
        return evidence(MISSING, [{"code": "invariants_skipped", "detail": "structure check failed"}])
    from scout_ckpt.format.dcp_files import read_tensors
    from scout_ckpt.invariants import run_offline

    try:
        tensors = read_tensors(step_dir, include_bytes=any(c.kind == "monotone" for c in checks))
    except BadInput as e:
        return evidence(FAIL, [{"code": "bad_metadata", "detail": str(e)}])
    return run_offline(checks, tensors)


def adopt_step(root: Path, step: int, step_dir: Path, run_id: str, attempt: str, checks, specs: list,
               run_policy: dict) -> tuple[dict, dict]:
    """(manifest, verdict) for one foreign step dir; builds the manifest (manifest.build), writes nothing."""
    from scout_ckpt.format.dcp_files import check_structure, ranks_of

    rels = [r for r in digests.relpaths(step_dir) if r != layout.MANIFEST_NAME]
    found = digests.digest_files([step_dir / r for r in rels])
    files = [{"path": r, "size": found[str(step_dir / r)][0], "digest": found[str(step_dir / r)][1], "rank": None}
             for r in rels]
    bytes_ev = evidence(PASS, baseline="adoption", files=len(files), nbytes=sum(f["size"] for f in files))
    structure = check_structure(step_dir)
    ev = {"bytes": bytes_ev, "structure": structure, "invariants": _invariants(step_dir, checks, structure)}
    v = policy.evaluate(run_policy, ev)
    verdict = {"state": v.state, "reasons": v.reasons}
    m = manifest.build(step=step, run_id=run_id, attempt=attempt, world_size=len(ranks_of(step_dir)),
                       topology={"mode": "adopted"}, policy=run_policy, files=files, evidence=ev, verdict=verdict,
                       invariants=specs, adopted=True)
    return m, verdict
