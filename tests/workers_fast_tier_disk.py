"""A rank function for tests/test_fast_tier_disk.py (module level: run_ranks forks into it): a user's DDP job on
2 ranks with the fast tier, each rank its own "node" (LOCAL_WORLD_SIZE=1, set by the caller) with its own
node-local directory BASE/node-R; node 1's directory is a tiny tmpfs that rank 1 fills up right after the
Checkpointer starts, as another job on the node would.

Local saves at steps 2, 4 and 6 (`ckpt.step`, nothing else configured). After the commit of step 2 rank 1 frees
the disk (the operator, or the other job, removed its file). A second incarnation then loads. Returns, for the
test's oracle, what the ranks saw: any exception step() raised, the sha256 of each rank's model and optimizer
state at each local save (computed here, without scout-ckpt), and what the second incarnation loaded with the
same digest of the loaded state.
"""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path

import torch

from scout_ckpt.checkpointer import Checkpointer
from scout_ckpt.options import LocalTierOptions
from tests.workers_ckpt import ddp, make_model, state_of, train_steps


def state_digest(model, opt) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for pid, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{pid}.{k}".encode())
            h.update(
                v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                if isinstance(v, torch.Tensor)
                else repr(v).encode()
            )
    return h.hexdigest()


def fill(path: Path) -> int:
    """Write zeros into `path` until the file system is full; the bytes written."""
    n, chunk = 0, b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                try:  # the last partial chunk
                    n += f.write(b"\0" * 512)
                except OSError:
                    pass
                return n


def full_local_disk_job(rank, world, root, base):
    local = LocalTierOptions(dir=str(Path(base) / f"node-{rank}"), every=2, keep=3)
    filler = Path(base) / "node-1" / "filler"
    model = make_model()
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, model=net, optimizer=opt, local=local)
    out = {"run_id": ckpt.run_id, "raised": None, "saved": {}, "verdicts": {}}
    if rank == 1:
        out["filled"] = fill(filler)
    try:
        for s in range(1, 7):
            train_steps(net, opt, 1, seed=s)
            ckpt.step(s, state_of(model, opt))
            if s % 2 == 0:
                ckpt.wait()
                out["saved"][s] = state_digest(model, opt)
                out["verdicts"][s] = ckpt.local.last_verdict
                if s == 2 and rank == 1:
                    filler.unlink()
        ckpt.wait()
    except Exception as e:  # what a training loop would die of
        out["raised"] = f"{type(e).__name__}: {e}"
    ckpt.close()
    model2 = make_model(seed=123)
    net2 = ddp(model2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    train_steps(net2, opt2, 1, seed=99)  # optimizer state exists before loading, as in a restarted job
    ckpt2 = Checkpointer(root, model=net2, optimizer=opt2, local=local)
    out["loaded"] = ckpt2.load_latest_clean(state_of(model2, opt2))
    out["tier"] = ckpt2.loaded_tier
    out["loaded_digest"] = state_digest(model2, opt2)
    ckpt2.close()
    return out
