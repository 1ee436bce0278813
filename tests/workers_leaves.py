"""Rank functions for the canonical-leaf tests (module level: run_ranks starts them)."""

from __future__ import annotations

import random

import torch
import torch.nn as nn

from scout_ckpt.checkpointer import Checkpointer

TAGS = [f"tag-{i:02d}-{'x' * (i % 7)}" for i in range(50)]


class Holder:
    """A plain object whose repr shows a set: equal on every rank, its repr not (compared by repr, it was an SDC)."""

    def __init__(self, tags):
        self.tags = set(tags)

    def __repr__(self) -> str:
        return f"Holder({self.tags})"


def _meta(rank: int) -> dict:
    """The same set of 50 strings, frozenset of 9 and Holder on every rank, each built in an order of its own."""
    order = list(TAGS)
    random.Random(rank).shuffle(order)
    return {"tags": set(order), "frozen": frozenset(t for t in order if t in TAGS[:9]), "holder": Holder(order)}


def save_with_a_set(rank, world, root):
    """Every rank saves the same model and the same sets, which iterate differently on each rank: its hash seed
    differs (spawned children, PYTHONHASHSEED unset) and so does the insertion order: step 1 holds the set, step 2
    the frozenset and the Holder too. Then a fresh Checkpointer loads the checkpoint back, the load verified
    against the signatures recorded at the save. Returns the verdicts, the set's iteration order, a string's
    hash, and what the load gave."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    meta = _meta(rank)
    ckpt = Checkpointer(root, model=model)
    try:
        plain = ckpt.save(1, {"model": model.state_dict(), "meta": {"tags": meta["tags"]}})
        verdict = ckpt.save(2, {"model": model.state_dict(), "meta": meta})
    finally:
        ckpt.close()
    torch.manual_seed(1)
    fresh = nn.Linear(4, 2)
    ckpt = Checkpointer(root, model=fresh)
    try:
        into = {"model": fresh.state_dict(), "meta": _meta(rank + 10)}
        loaded = ckpt.load_latest_clean(into)
    finally:
        ckpt.close()
    return {
        "plain": plain,
        "verdict": verdict,
        "order": list(meta["tags"]),
        "hash_of_tag": hash(TAGS[0]),
        "loaded": loaded,
        "tags_loaded": sorted(into["meta"]["tags"]) == sorted(TAGS),
    }
