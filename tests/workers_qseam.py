"""Rank workers of tests/test_quarantine_seam.py (module level: the launcher imports them by name): a quarantined
step reached again, by the run that wrote it and by a later one, on an object store and in the fast tier."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist

from scout_ckpt.checkpointer import Checkpointer
from scout_ckpt.errors import ScoutError
from scout_ckpt.options import LocalTierOptions
from tests.workers_ckpt import ddp, make_model, state_of, train_steps
from tests.workers_one_truth import digest as job_digest
from tests.workers_s3 import digest as s3_digest
from tests.workers_s3 import make_model as s3_model
from tests.workers_s3 import options


def _quarantine(rank: int, root: str, step: int) -> None:
    """The operator quarantines `step` while the job runs (rank 0, the real library call); every rank waits."""
    if rank == 0:
        from scout_ckpt.ops.operator import quarantine

        quarantine(root, step, "suspect node")
    dist.barrier()


def s3_quarantined_by_its_own_run(rank, world, uri, ledger_dir, endpoint):
    """Saves 2 and 4 on the store; the operator quarantines 4; this same run saves 4 again, which must be refused
    on every rank. Returns the job's own digest of each saved state and the refusal."""
    model = s3_model(seed=0)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(uri, ledger_dir=ledger_dir, storage_options=options(endpoint), model=net, optimizer=opt)
    saved, done = {}, 0
    for s in (2, 4):
        train_steps(net, opt, s - done, seed=s)
        done = s
        assert ckpt.save(s, state_of(model, opt))["state"] == "certified"
        saved[s] = s3_digest(state_of(model, opt))
    _quarantine(rank, ledger_dir, 4)
    refused = None
    try:
        ckpt.save(4, state_of(model, opt))
    except ScoutError as e:
        refused = {"error": type(e).__name__, "message": str(e)}
    ckpt.close()
    return {"saved": saved, "refused": refused}


def _tier_opts(local_dir: str, rank: int, keep: int = 2) -> LocalTierOptions:
    """Each rank its own node (LOCAL_WORLD_SIZE=1) with its own node-local directory."""
    return LocalTierOptions(dir=f"{local_dir}/node{rank}", every=2, keep=keep)


def _files(folder: Path) -> dict[str, str]:
    """{file name: sha256 of its bytes} of a node's step folder: the test's own record of the bytes."""
    if not folder.is_dir():
        return {}
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def tiers_quarantined_by_its_own_run(rank, world, root, local_dir):
    """Local saves every 2 steps (keep=1), a durable save at 3; the operator quarantines step 4 (held by the fast
    tier alone); this same run saves step 4 locally again, then step 6 (whose retention must keep quarantined 4),
    and the operator quarantines 6 too. Returns the job's digests, the verdicts, and this rank's files of step 4
    (name -> sha256) before the re-save and after the save of 6."""
    model = make_model(seed=5)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(
        root, model=net, optimizer=opt, local=_tier_opts(local_dir, rank, keep=1), replay=False, observer=False
    )
    printed, verdicts = {}, {}
    for step in range(1, 5):
        train_steps(net, opt, 1, seed=step)
        ckpt.step(step, state_of(model, opt))
        if step == 3:
            verdicts[3] = ckpt.save(3, state_of(model, opt))["state"]
        printed[step] = job_digest(model, opt)
    ckpt.local.wait()
    verdicts[4] = ckpt.local.last_verdict["state"]
    folder = Path(local_dir) / f"node{rank}" / ckpt.run_id / "step-00000004"
    before = _files(folder)
    _quarantine(rank, root, 4)
    train_steps(net, opt, 1, seed=40)  # the state differs from the quarantined one: an overwrite would show
    ckpt.local.save(4, state_of(model, opt))
    ckpt.local.wait()
    again = ckpt.local.last_verdict
    train_steps(net, opt, 1, seed=6)
    ckpt.local.save(6, state_of(model, opt))
    ckpt.local.wait()
    verdicts[6] = ckpt.local.last_verdict["state"]
    after = _files(folder)
    _quarantine(rank, root, 6)  # so that the restart goes back before step 4
    ckpt.close()
    return {
        "run_id": ckpt.run_id,
        "digests": printed,
        "verdicts": verdicts,
        "again": again,
        "before": before,
        "after": after,
    }


def tiers_later_run_reaches_the_step(rank, world, root, local_dir):
    """A restart: load_latest_clean, then train to step 4 and save it locally (due every 2 steps). Returns what it
    loaded, from which tier, the local save's verdict and the job's own digest of the state saved at 4."""
    model = make_model(seed=6)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(net, opt, 1, seed=99)
    ckpt = Checkpointer(
        root, model=net, optimizer=opt, local=_tier_opts(local_dir, rank), replay=False, observer=False, timeout_s=60
    )
    st = state_of(model, opt)
    loaded = ckpt.load_latest_clean(st)
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optim"])
    out = {"run_id": ckpt.run_id, "loaded": loaded, "tier": ckpt.loaded_tier, "loaded_digest": job_digest(model, opt)}
    for step in range((loaded or 0) + 1, 5):
        train_steps(net, opt, 1, seed=step)
        ckpt.step(step, state_of(model, opt))
    ckpt.local.wait()
    out["verdict"] = ckpt.local.last_verdict
    out["digest"] = job_digest(model, opt)
    ckpt.close()
    return out
