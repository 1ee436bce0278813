"""Rank functions for tests/test_s3_nodes.py (module level: run_ranks forks into them): a job laid out as two
torchrun nodes saving to the test's own moto server."""

from __future__ import annotations

import torch

from scout_ckpt.checkpointer import Checkpointer
from tests import workers_s3 as w
from tests.workers_ckpt import ddp, state_of, train_steps
from tests.workers_pernode import as_two_nodes


def save_on_two_nodes(rank, world, uri, ledger_dir, endpoint, async_save=False, steps=(2, 4)):
    """Train and save at each step of `steps` as a rank of a two-node job; returns each save's verdict (None for
    an async save: it comes later, in the ledger) and the job's own digest (workers_s3.digest) of the state it
    saved there, taken when save() returns (an async save has staged its copy by then; training then goes on)."""
    as_two_nodes(rank)
    model = w.make_model()
    net = ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(
        uri,
        ledger_dir=ledger_dir,
        storage_options=w.options(endpoint),
        model=net,
        optimizer=opt,
        timeout_s=120,
        async_save=async_save,
    )
    verdicts, saved, models, done = {}, {}, {}, 0
    for s in steps:
        train_steps(net, opt, s - done, seed=s)
        done = s
        v = ckpt.save(s, state_of(model, opt))
        verdicts[s] = v["state"] if v else None
        saved[s] = w.digest(state_of(model, opt))
        models[s] = w.digest(model.state_dict())  # the weights alone: what `export` must write
    ckpt.close()
    return {"verdicts": verdicts, "saved": saved, "models": models}


def load_on_two_nodes(rank, world, uri, ledger_dir, endpoint):
    """A restarted two-node job: workers_s3.load_latest (fresh model and AdamW, load_latest_clean)."""
    as_two_nodes(rank)
    return w.load_latest(rank, world, uri, ledger_dir, endpoint)
