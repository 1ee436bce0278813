"""One foreign DCP folder adopted: every file digested, the structure checked, the invariants run offline, and
the manifest and verdict built under the ADOPTED policy (bytes + structure + invariants). Shared by the POSIX
adopt (ops/adopt.py) and the object-store adopt (ops/adopt_bucket.py); writes nothing itself.

A folder of a registered layout (ops/adopt_layouts.py: Megatron's `iter_NNNNNNN`) is a DCP folder plus what its
framework adds: the files its own load needs are part of the structure check, and its own digest file written at
save (Megatron's integrity.json), when there is one, gives the `integrity` evidence (ops/adopt_integrity.py):
every file checked against it. Each piece of evidence about the bytes names what vouched for them (`vouched_by`,
shown by `explain`; `not_used` when a digest file was there but could not be used)."""

from __future__ import annotations

from pathlib import Path

from scout_ckpt import policy
from scout_ckpt.errors import BadInput
from scout_ckpt.format import digests, layout, manifest
from scout_ckpt.ops import adopt_integrity
from scout_ckpt.ops.adopt_layouts import AdoptLayout, missing_required
from scout_ckpt.policy import FAIL, MISSING, PASS, evidence

DEFAULT_INVARIANTS = ["finite"]
OWN_DIGESTS = "adopt's own digests (the bytes as found at adoption)"


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


def bytes_evidence(step_dir: Path, rels: list[str], spec: AdoptLayout | None) -> tuple[list[dict], dict, dict | None]:
    """(the manifest's file rows, the bytes evidence, the integrity evidence or None) of a folder's files `rels`:
    adopt's own digests, and, when the layout's digest file is there, the files checked against it (each file read
    once for both hashes when it is usable)."""
    listing = adopt_integrity.read_listing(step_dir, spec.integrity) if spec is not None and spec.integrity else None
    if listing is not None and listing.usable:
        got = adopt_integrity.hash_files(step_dir, rels)
        found = {r: got[r][:2] for r in rels}
        integrity = adopt_integrity.integrity_evidence(listing, {r: got[r][2] for r in rels if r != listing.name})
    else:
        hashed = digests.digest_files([step_dir / r for r in rels])
        found = {r: hashed[str(step_dir / r)] for r in rels}
        integrity = (
            adopt_integrity.integrity_evidence(listing, None) if listing is not None and listing.present else None
        )
    files = [{"path": r, "size": found[r][0], "digest": found[r][1], "rank": None} for r in rels]
    return (
        files,
        evidence(
            PASS, baseline="adoption", files=len(files), nbytes=sum(f["size"] for f in files), vouched_by=OWN_DIGESTS
        ),
        integrity,
    )


def source_digests_evidence(integrity: dict | None) -> dict:
    """`source_digests`: were the bytes vouched for by digests written when they were saved? pass when the
    framework's own digest file (integrity.json) matched every file; else missing: adopt's own digests only
    describe the folder as found (a bit flipped before adoption is certified with it). Not required by the ADOPTED
    policy; `ls` and `resume` show such a step as `adopted`, and `resume --latest-clean --require source_digests`
    walks past it (ops/recovery.py)."""
    if integrity is not None and integrity.get("status") == PASS:
        return evidence(PASS, vouched_by=integrity.get("vouched_by"))
    return evidence(
        MISSING,
        [
            {
                "code": "adopted_without_source_digests",
                "detail": "no digests written at save: the bytes are vouched for only by adopt's own "
                "digests of the folder as found",
            }
        ],
        vouched_by=OWN_DIGESTS,
    )


def evidence_level(statuses: dict[str, str]) -> str:
    """The word `ls`/`resume` show for what vouches for a step's bytes, from its evidence statuses ({kind:
    status}): "scout-ckpt" (digested by the ranks that wrote it, at save), "adopted" (adopted; digests only from
    adoption), "adopted+source" (adopted, matched against the framework's digests written at save)."""
    level = statuses.get("source_digests")
    if level is None:
        return "scout-ckpt"
    return "adopted+source" if level == PASS else "adopted"


def structure_evidence(step_dir: Path, spec: AdoptLayout | None) -> dict:
    """DCP's structure check (format/dcp_files.check_structure), then the layout's own files and checks."""
    from scout_ckpt.format.dcp_files import check_structure

    structure = check_structure(step_dir)
    extra = missing_required(step_dir, spec)
    if not extra:
        return structure
    return {**structure, "status": FAIL, "reasons": [*structure["reasons"], *extra]}


def adopt_step(
    root: Path,
    step: int,
    step_dir: Path,
    run_id: str,
    attempt: str,
    checks,
    specs: list,
    run_policy: dict,
    spec: AdoptLayout | None = None,
) -> tuple[dict, dict]:
    """(manifest, verdict) for one foreign folder; builds the manifest (manifest.build), writes nothing."""
    from scout_ckpt.format.dcp_files import ranks_of

    rels = [r for r in digests.relpaths(step_dir) if r != layout.MANIFEST_NAME]
    files, bytes_ev, integrity = bytes_evidence(step_dir, rels, spec)
    structure = structure_evidence(step_dir, spec)
    ev = {"bytes": bytes_ev, "structure": structure, "invariants": _invariants(step_dir, checks, structure)}
    if integrity is not None:  # not required by the policy: a fail rejects, not_applicable changes nothing
        ev["integrity"] = integrity
    ev["source_digests"] = source_digests_evidence(integrity)
    v = policy.evaluate(run_policy, ev)
    verdict = {"state": v.state, "reasons": v.reasons}
    extra = {} if spec is None else {"layout": spec.name, **(spec.extra(step) if spec.extra else {})}
    m = manifest.build(
        step=step,
        run_id=run_id,
        attempt=attempt,
        world_size=len(ranks_of(step_dir)),
        topology={"mode": "adopted"},
        policy=run_policy,
        files=files,
        evidence=ev,
        verdict=verdict,
        invariants=specs,
        adopted=True,
        **extra,
    )
    return m, verdict
