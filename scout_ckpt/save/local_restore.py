"""The fast tier's restore side: the walk-back's local candidate, its load re-verified by digest on every rank
(own node's file, else a peer copy fetched over the tier's group), and its rejection.

Why apart from local_tier.py: saving (stage, serialize, write, copy to peers, commit, retention) and restoring
(choose, verify, fetch, apply, reject) share only the files (local_files.py) and the ledger rows
(local_tier_rows.py); save/loading.py's walk-back calls these through LocalTier's methods. `tier` is the job's
LocalTier (its rank, world, group, layout, ledger).
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from scout_ckpt import policy
from scout_ckpt.format.digests import bytes_digest
from scout_ckpt.format.verify import COULD_NOT_CHECK
from scout_ckpt.save import local_tier_rows as rows
from scout_ckpt.save import log as scout_log
from scout_ckpt.save import peer_copy
from scout_ckpt.save.local_files import rank_files, read_file, try_write


def candidate(tier, below: int | None) -> dict | None:
    """Coordinator: the newest certified local step below `below` that this job's layout can restore, as the
    walk-back's candidate (None: none). A step whose durable row speaks against the step itself (quarantined, or
    rejected for anything but that copy's bytes: policy.step_distrusted) is passed over: a verdict on a step holds
    for every copy of it. Rows of another layout (an elastic restart) are passed over, older ones still tried."""
    ledger = tier.ck.ledger
    for r in rows.rows(ledger, states=("certified",)):
        if below is not None and r["step"] >= below:
            continue
        if r.get("layout") != tier.layout:
            if not tier.layout_told:
                tier.layout_told = True
                scout_log.logger.info(
                    "local tier: steps saved by %s skipped, this job is %s", r.get("layout"), tier.layout
                )
            continue
        durable = ledger.checkpoint(r["step"])
        if durable is not None and policy.step_distrusted(durable["state"], durable.get("reasons") or []):
            scout_log.logger.info(
                "local step %d skipped: its durable row is %s (%s)",
                r["step"],
                durable["state"],
                ", ".join(x.get("code", "?") for x in durable["reasons"] or []),
            )
            continue
        return {
            "tier": "local",
            "step": r["step"],
            "path": r["dir"],
            "files": r["files"],
            "copies": r.get("copies") or [],
            "signatures": r.get("signatures") or {},
            "reasons": [],
            "world_size": r["world_size"],
        }
    return None


def load(tier, state: dict, cand: dict, loader) -> list[dict]:
    """Collective: load `cand` into `state` if every rank gets bytes that hash to its recorded digest (its
    own node's file, else a peer copy sent over the group) and the loaded values match the recorded
    signatures. Returns [] when loaded, else the reasons (the same on every rank)."""
    group = tier.ck._pg
    step_dir = tier.base / cand["path"]
    want = {f["rank"]: f["digest"] for f in cand["files"]}
    held, bad = {}, []
    for owner, path in rank_files(step_dir, tier.rank, tier.local_world):
        if owner in held or owner not in want:
            continue
        data = read_file(path)
        if data is None:
            continue
        if bytes_digest(data) == want[owner]:
            held[owner] = data
        else:
            bad.append(owner)
    own = held.get(tier.rank)
    own_ok = own is not None
    table = [None] * tier.world
    dist.all_gather_object(table, {"own": own_ok, "held": sorted(held), "bad": bad}, group=group)
    plan, reasons = [], []
    for r in range(tier.world):
        if table[r]["own"]:
            continue
        holder = next((h for h in range(tier.world) if h != r and r in table[h]["held"]), None)
        if holder is not None:
            plan.append((r, holder))
            continue
        damaged = any(r in t["bad"] for t in table)
        reasons.append(
            {
                "code": "digest_mismatch" if damaged else COULD_NOT_CHECK,
                "rank": r,
                "tier": "local",
                "detail": "every copy of the rank's file fails its digest"
                if damaged
                else "no copy of the rank's file on any node",
            }
        )
    if reasons:
        return reasons
    got = peer_copy.fetch(tier.rank, plan, held, group)
    blob = own if own_ok else got
    held.clear()
    ok = torch.tensor([1 if blob is not None and bytes_digest(blob) == want.get(tier.rank) else 0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not int(ok[0]):
        return [{"code": "digest_mismatch", "tier": "local", "detail": "a fetched peer copy failed its digest"}]
    _apply(state, torch.load(io.BytesIO(blob), weights_only=True))
    if not own_ok:  # this rank's node lost its copy: keep the fetched one, as its own node's file again
        error = try_write(step_dir / f"rank-{tier.rank}.pt", blob)
        if error:  # the load stands: the copy back is for the next restart, which can fetch it again
            scout_log.logger.warning(
                "local step %d: the fetched copy of rank %d's file was not written back to its node (%s)",
                cand["step"],
                tier.rank,
                error,
            )
    loader.hook("after_load", cand["step"])
    differ = loader._loaded_differences(cand["step"], cand["signatures"], state)
    if differ:
        return [{"code": "load_mismatch", "tier": "local", "tensors": differ[:16], "count": len(differ)}]
    tier.last_loaded = {"step": cand["step"], "fetched": [r for r, _ in plan]}
    return []


def _apply(state: dict, loaded: dict) -> None:
    for k, v in loaded.items():
        target = state.get(k)
        if isinstance(target, Stateful):
            sd = target.state_dict()
            target.load_state_dict(_merge(sd, v))
        elif k in state:
            state[k] = _merge(target, v)


def reject(tier, cand: dict, reasons: list[dict]) -> None:
    """Coordinator: a local candidate whose bytes or loaded values failed is rejected for good (CAS from
    certified), with an event; a could-not-check one keeps its state."""
    if all(r.get("code") == COULD_NOT_CHECK for r in reasons):
        return
    ledger = tier.ck.ledger
    if rows.set_state(ledger, cand["step"], "rejected", reasons, expect="certified"):
        ledger.add_event("local_rejected", step=cand["step"], run_id=tier.ck.run_id, detail={"reasons": reasons[:8]})


def _merge(dst, src):
    """Write the loaded `src` into `dst` in place where `dst` has tensors; other leaves are replaced. Returns the
    merged value (for leaves that are replaced)."""
    if isinstance(dst, DTensor):
        dst.to_local().copy_(src)
        return dst
    if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
        with torch.no_grad():
            dst.copy_(src)
        return dst
    if isinstance(dst, dict) and isinstance(src, dict):
        for k, v in src.items():
            dst[k] = _merge(dst[k], v) if k in dst else v
        return dst
    if isinstance(dst, list) and isinstance(src, list) and len(dst) == len(src):
        for i, v in enumerate(src):
            dst[i] = _merge(dst[i], v)
        return dst
    return src
