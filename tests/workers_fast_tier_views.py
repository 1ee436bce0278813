"""A rank function for tests/test_fast_tier_views.py (module level: run_ranks forks into it): a user's DDP job on
2 ranks with the fast tier, each rank its own "node" (LOCAL_WORLD_SIZE=1, set by the caller) with its own
node-local directory BASE/node-R, so every rank's file has a peer copy on the other "node".

Local saves at steps 2, 4 and 6 (`ckpt.step`), a durable save at step 2 too (both tiers hold it). Then one bit
of each copy of rank 1's file of step 6 is flipped and a second incarnation loads: step 6 fails its digest on
every copy (rejected, event `local_rejected`) and the load walks back to local step 4. Returns what the ranks
saw, for the tests' oracle: the sha256 of each saved file as this rank wrote it (read back right after the
commit, before the flip), and where the second incarnation loaded from.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from scout_ckpt.checkpointer import Checkpointer
from scout_ckpt.options import LocalTierOptions
from tests.workers_ckpt import ddp, make_model, state_of, train_steps


def local_tier_job(rank, world, root, base):
    local = LocalTierOptions(dir=str(Path(base) / f"node-{rank}"), every=2, keep=3)
    model = make_model()
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, model=net, optimizer=opt, local=local)
    run_id = ckpt.run_id
    for s in range(1, 7):
        train_steps(net, opt, 1, seed=s)
        ckpt.step(s, state_of(model, opt))
        if s == 2:
            ckpt.save(s, state_of(model, opt))
    ckpt.wait()
    ckpt.close()
    own = {}
    for s in (2, 4, 6):
        p = Path(local.dir) / run_id / f"step-{s:08d}" / f"rank-{rank}.pt"
        own[s] = {"path": str(p), "sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "size": p.stat().st_size}
    dist.barrier()
    if rank == 0:  # one bit of every copy of rank 1's file of step 6 (its own node's and its peer's)
        for p in Path(base).rglob("step-00000006/*rank-1.pt"):
            data = bytearray(p.read_bytes())
            data[len(data) // 2] ^= 0x10
            p.write_bytes(bytes(data))
    dist.barrier()
    model2 = make_model(seed=123)
    net2 = ddp(model2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    train_steps(net2, opt2, 1, seed=99)
    ckpt2 = Checkpointer(root, model=net2, optimizer=opt2, local=local)
    st = state_of(model2, opt2)
    loaded = ckpt2.load_latest_clean(st)
    tier = ckpt2.loaded_tier
    ckpt2.close()
    return {
        "run_id": run_id,
        "host": socket.gethostname(),
        "own": own,
        "loaded": loaded,
        "tier": tier,
        "pid": os.getpid(),
    }
