"""Rank functions for tests/test_node_manifest.py: a 4-rank gloo job laid out as torchrun lays out 2 nodes of 2."""

from __future__ import annotations

import os

import torch

from scout_ckpt.checkpointer import Checkpointer
from tests import workers_ckpt as w


def as_two_nodes(rank: int, per_node: int = 2) -> None:
    """torchrun's environment for `rank` in a job of nodes of `per_node` ranks (global ranks contiguous per node)."""
    os.environ.update(
        {"LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node)}
    )


def save_on_two_nodes(rank, world, root, async_save=False):
    """Save steps 2 and 4 (a DDP model and AdamW), then a fresh model loads the latest clean checkpoint; returns
    each save's verdict, this rank's state after step 4 and after the load (compared by the test)."""
    as_two_nodes(rank)
    model = w.make_model()
    net = w.ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, model=net, optimizer=opt, async_save=async_save)
    verdicts = []
    for s in (2, 4):
        w.train_steps(net, opt, 2, seed=s)
        verdicts.append(ckpt.save(s, w.state_of(model, opt)))
    ckpt.wait()
    saved = w.flat_tensors(w.state_of(model, opt))
    ckpt.close()
    model2 = w.make_model(seed=123)
    net2 = w.ddp(model2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    w.train_steps(net2, opt2, 1, seed=99)
    ckpt2 = Checkpointer(root, model=net2, optimizer=opt2)
    st = w.state_of(model2, opt2)
    loaded_step = ckpt2.load_latest_clean(st)
    model2.load_state_dict(st["model"])
    opt2.load_state_dict(st["optim"])
    loaded = w.flat_tensors(w.state_of(model2, opt2))
    ckpt2.close()
    return {"verdicts": verdicts, "loaded_step": loaded_step, "saved": saved, "loaded": loaded}


def gather_three_nodes(rank, world, tmp, broken_node=None):
    """The per-node gather alone on the default group, nodes of 3, 2 and 1 ranks (global ranks contiguous):
    every rank reports one file of its own; `broken_node`'s aggregator writes into a folder that does not exist.
    Returns the coordinator's rows (None elsewhere)."""
    from pathlib import Path

    import torch.distributed as dist

    from scout_ckpt.save import node_manifest as nm

    sizes = [3, 2, 1]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    node = max(i for i, s in enumerate(starts) if s <= rank)
    p = nm.NodePlan(
        node=node, leader=starts[node], members=tuple(range(starts[node], starts[node] + sizes[node])), world=world
    )
    files = [{"path": f"__{rank}_0.distcp", "size": 10 + rank, "digest": f"d{rank}", "rank": rank}]
    if rank == 0:
        files.append({"path": ".metadata", "size": 5, "digest": "m", "rank": 0})
    report = {"rank": rank, "files": files, "finite_bad": ["w"] if rank == 4 else []}
    where = Path(tmp) / ("missing" if node == broken_node else "")
    return nm.gather(p, rank, report, where, 7, "a1", dist.group.WORLD)
