"""A save flattens its state once: the load-verification signatures take the consensus's flattening of the very
state it hashed (PendingConsensus.flattened), and give what flattening afresh gives."""

from __future__ import annotations

import torch

from scout_ckpt.consensus.flatten import flatten_state
from scout_ckpt.consensus.full import full_signatures


def _state():
    g = torch.Generator().manual_seed(5)
    return {
        "app": {
            "model": {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g)},
            "optim": {
                "state": {"0": {"step": 3, "exp_avg": torch.randn(64, 33, generator=g)}},
                "param_groups": [{"lr": 1e-3, "params": [0]}],
            },
        }
    }


def test_signatures_from_a_given_flattening_are_those_of_a_fresh_one():
    state = _state()
    flat = flatten_state(state, keep_dtensor=True)
    before = dict(flat)
    given = full_signatures(state, plain="replica", flat=flat)
    fresh = full_signatures(state, plain="replica")
    assert given == fresh and len(given) == len(before) > 3
    assert flat.keys() == before.keys() and all(flat[k] is before[k] for k in flat)  # left as it was


def test_a_flattening_is_reused_only_for_the_state_it_was_taken_of():
    import torch.distributed as dist

    from scout_ckpt.consensus.groups import ConsensusGroups
    from scout_ckpt.consensus.save_time import PendingConsensus, _plan

    state = _state()
    flat = flatten_state(state, keep_dtensor=True)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        groups = ConsensusGroups.create("ddp", 1, None, timeout_s=30)
        plan = _plan(flat, sorted(flat), groups)
        pending = PendingConsensus(flat, sorted(flat), plan, groups, 0.0, ({}, 0.0))
        assert pending.flattened(state) is None  # not started from a state: nothing to reuse
        pending = PendingConsensus(flat, sorted(flat), plan, groups, 0.0, ({}, 0.0), source=state)
        assert pending.flattened(state) is flat
        assert pending.flattened(_state()) is None  # an equal state, but another object
        assert pending.flattened(dict(state)) is None
    finally:
        dist.destroy_process_group()
