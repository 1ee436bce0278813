"""A restart on another world size with the README's recipe (`"rng": RankLocal(RNGState())`): DCP reshards the
model and optimizer but not the rank-local rows, so loading 2 ranks' rows on 3 raised DCP's size mismatch as a
traceback on every rank, until torchrun's restarts ran out. The ranks that still exist get their own generators
back, a new rank keeps its fresh ones with a WARNING, and `strict=True` is a one-line error on every rank.

The oracle is each rank's own digest of its generators (torch, NumPy, Python), computed by the test's code at the
save and after the load; real gloo ranks, a real DCP checkpoint."""

from __future__ import annotations

import hashlib

from scout_ckpt.testing.launch import run_ranks


def _rng_digest() -> str:
    import random

    import numpy as np
    import torch

    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    h.update(np.random.get_state()[1].tobytes())
    h.update(repr(random.getstate()).encode())
    return h.hexdigest()


def _seed(seed: int) -> None:
    import random

    import numpy as np
    import torch

    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _state(strict=False):
    import torch

    from scout_ckpt import ModelOptimizerState, RankLocal, RNGState

    torch.manual_seed(0)  # the model is the same on every rank; the generators are re-seeded per rank after
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, {"app": ModelOptimizerState(model, opt), "rng": RankLocal(RNGState(), strict=strict)}


def _save(rank, world, root):
    from scout_ckpt import Checkpointer

    model, opt, state = _state()
    _seed(100 + rank)
    ck = Checkpointer(root, model=model, optimizer=opt)
    import torch

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))  # the same batch everywhere: replicas agree
    model(x).sum().backward()
    opt.step()
    verdict = ck.save(1, state)
    digest = _rng_digest()
    ck.close()
    return {"state": verdict["state"], "rng": digest}


def _load(rank, world, root, strict):
    from scout_ckpt import Checkpointer
    from scout_ckpt.errors import ScoutError

    model, opt, state = _state(strict)
    _seed(200 + rank)
    fresh = _rng_digest()
    ck = Checkpointer(root, model=model, optimizer=opt)
    try:
        step = ck.load_latest_clean(state)
        out = {"step": step, "rng": _rng_digest(), "fresh": fresh}
    except ScoutError as e:
        out = {"error": str(e)}
    ck.close()
    return out


def test_a_restart_on_more_or_fewer_ranks_restores_the_ranks_that_still_exist(tmp_path):
    root = str(tmp_path / "run")
    saved = [o.result for o in run_ranks(_save, 2, root, timeout=120)]
    assert [s["state"] for s in saved] == ["certified", "certified"]
    assert saved[0]["rng"] != saved[1]["rng"]  # the rows really differ by rank

    grown = [o.result for o in run_ranks(_load, 3, root, False, timeout=120)]
    assert [g.get("step") for g in grown] == [1, 1, 1], grown
    assert [g["rng"] for g in grown[:2]] == [s["rng"] for s in saved]  # ranks 0 and 1: their own generators
    assert grown[2]["rng"] == grown[2]["fresh"]  # the new rank keeps what it had

    shrunk = [o.result for o in run_ranks(_load, 1, root, False, timeout=120)]
    assert shrunk[0]["step"] == 1 and shrunk[0]["rng"] == saved[0]["rng"]

    same = [o.result for o in run_ranks(_load, 2, root, False, timeout=120)]
    assert [g["rng"] for g in same] == [s["rng"] for s in saved]


def test_strict_rank_local_refuses_another_world_size_with_one_line(tmp_path):
    root = str(tmp_path / "run")
    run_ranks(_save, 2, root, timeout=120)
    out = [o.result for o in run_ranks(_load, 3, root, True, timeout=120)]
    for o in out:
        assert o == {
            "error": "'rng': saved by 2 ranks, this job has 3 (RankLocal(strict=False) restores the ranks "
            "that still exist)"
        }
