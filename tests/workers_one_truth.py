"""Rank workers of tests/test_one_truth.py (module level: the launcher imports them by name)."""

from __future__ import annotations

import hashlib
import time

import torch

from scout_ckpt.checkpointer import Checkpointer
from tests.workers_ckpt import ddp, make_model, state_of, train_steps


def digest(model, opt) -> str:
    """The job's own fingerprint of its model and optimizer (sha256 of every tensor's bytes, no scout-ckpt)."""
    h = hashlib.sha256()
    for part in (model.state_dict(), opt.state_dict()["state"]):
        for k in sorted(part, key=str):
            v = part[k]
            for t in (v.values() if isinstance(v, dict) else [v]):
                if isinstance(t, torch.Tensor):
                    h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def local_verdict_races_durable_save(rank, world, root, local_dir):
    """Local save at step 2 of a state with a NaN (its commit slowed by 2 s on the commit thread), the NaN gone
    again before the durable save of step 3: the durable save must see the local verdict first."""
    def slow(point, step):
        if point == "local_written":
            time.sleep(2.0)

    model = make_model(seed=3)
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, model=net, optimizer=opt, local={"dir": local_dir, "every": 2},
                        on_live_fault="continue", fault_hook=slow, replay=False, observer=False)
    train_steps(net, opt, 1, seed=1)
    ckpt.step(1, state_of(model, opt))
    train_steps(net, opt, 1, seed=2)
    with torch.no_grad():
        keep = model[2].weight[1, 3].item()
        model[2].weight[1, 3] = float("nan")
    ckpt.step(2, state_of(model, opt))   # the local save: staged with the NaN, committing in the background
    with torch.no_grad():
        model[2].weight[1, 3] = keep
    verdict = ckpt.save(3, state_of(model, opt))
    try:
        ckpt.wait()
    except Exception as e:  # noqa: BLE001 - reported
        return {"durable": verdict, "local": ckpt.local.last_verdict, "error": repr(e)}
    local = ckpt.local.last_verdict
    ckpt.close()
    return {"durable": verdict, "local": local}
