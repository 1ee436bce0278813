"""Rank functions for the plan-cache tests (module level: run_ranks forks into them)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.planner import SavePlanner

from scout_ckpt.checkpointer import Checkpointer


def layouts(step: int) -> dict:
    """The state saved at `step`: the same layout at steps 1 and 2, then a tensor grown (3), then the same shape
    in another dtype (4), then a key added (5). Values depend on the step and the rank's share is replicated."""
    g = torch.Generator().manual_seed(step)
    w = torch.randn(4 if step < 3 else 6, 3, generator=g)
    if step >= 4:
        w = w.double()
    out = {"w": w, "b": torch.arange(5, dtype=torch.float32) * step, "meta": {"step": step}}
    if step >= 5:
        out["extra"] = torch.full((2,), float(step))
    return out


def save_changing_layouts(rank, world, root):
    """Saves steps 1-5 of `layouts` (sync, replay off: the state is not a model's) and reports each verdict and
    whether the coordinator reused the cached metadata object (torch's cache, this Checkpointer's key)."""
    ckpt = Checkpointer(root, replay=False, observer=False)
    key = ckpt._plans.key
    verdicts, reused = [], []
    before = None
    for step in range(1, 6):
        verdicts.append(ckpt.save(step, {"app": layouts(step)})["state"])
        meta = SavePlanner._cached_metadata.get(key)
        reused.append(meta is not None and meta is before)
        before = meta
    ckpt.close()
    return {"verdicts": verdicts, "reused": reused, "left_after_close": key in SavePlanner._cached_save_plan}
