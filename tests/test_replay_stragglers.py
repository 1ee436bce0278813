"""The replay's straggler rule (replay.stragglers) on synthetic timing sequences: pure, no processes.

Oracle: the sequences are built here with known ground truth (which rank was made slow, if any); the rule must
name exactly that rank and never a healthy one, under noise shaped like a loaded 2-core host: per-replay jitter up
to 1.8x, and scheduler bursts that make one healthy rank 3x slower for every replay of one step (a whole sweep).
"""

from __future__ import annotations

import random

import pytest

from scout_ckpt.consensus.timing import Confirmer, robust_outliers
from scout_ckpt.replay.stragglers import StragglerRule

pytestmark = pytest.mark.timing  # its outcome depends on timing: `make stress` runs it under load

TARGETS = ["embedding", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head", "optimizer"]
BASE = {
    "embedding": 0.001,
    "blocks.0": 0.035,
    "blocks.1": 0.038,
    "blocks.2": 0.041,
    "blocks.3": 0.047,
    "head": 0.008,
    "optimizer": 0.012,
}


def _sequence(ranks: int, steps: int, *, slow: int | None = None, seed: int = 0, burst_every: int = 1):
    """[(step, target, {rank: seconds})]: the rotation replays one target per step, every 5th step is a save
    whose sweep replays all of them. Every `burst_every`-th step one healthy rank (cycling, so never the same one
    twice in a row) is hit by a burst: 3x on every replay of that step. `slow` is 3x on everything, always."""
    rng = random.Random(seed)
    healthy = [r for r in range(ranks) if r != slow]
    out = []
    for step in range(1, steps + 1):
        burst = healthy[step % len(healthy)] if step % burst_every == 0 else None
        names = TARGETS if step % 5 == 0 else [TARGETS[step % len(TARGETS)]]
        for t in names:
            d = {}
            for r in range(ranks):
                v = BASE[t] * rng.uniform(1.0, 1.8)
                if r == burst:
                    v *= 3.0
                if r == slow:
                    v *= 3.0
                d[r] = v
            out.append((step, t, d))
    return out


def _run(seq, rounds=3):
    rule, events = StragglerRule(rounds), []
    for step, t, d in seq:
        events += rule.observe(step, d, t)
    return events


def test_noisy_healthy_ranks_are_never_named():
    for ranks in (3, 4, 8):
        for seed in range(5):
            assert _run(_sequence(ranks, 60, seed=seed)) == [], (ranks, seed)


def test_the_per_replay_rule_it_replaces_named_a_healthy_rank_on_the_same_noise():
    """The check above discriminates: one round per replay (the old rule) confirms a sweep-long burst."""
    conf, named = Confirmer(3), set()
    for _step, _t, d in _sequence(3, 60, seed=0):
        named |= set(conf.update(robust_outliers(d)))
    assert named  # healthy ranks, every one of them


def test_a_real_3x_straggler_is_named_alone():
    for ranks in (3, 4, 8):
        for slow in (0, ranks - 1):
            # a burst on a healthy rank every 4th step: with 3 ranks it ties with the straggler then (no
            # majority of normal ranks), so the straggler is confirmed by the three steps before the first one
            events = _run(_sequence(ranks, 30, slow=slow, seed=ranks, burst_every=4))
            # named, and only it (again after a burst on a healthy rank broke its streak: a new episode)
            assert events and {tuple(e["ranks"]) for e in events} == {(slow,)}, (ranks, slow, events)
            ev = events[0]
            # 3 consecutive steps at >= 2x the median: the jitter (up to 1.8x on a single rotation replay) delays it
            assert ev["kind"] == "straggler" and ev["step"] <= 20 and ev["detail"]["slowdown"] >= 2.0
            assert ev["detail"]["source"] == "replay"


def test_two_ranks_cannot_name_a_straggler():
    """With two peers neither is the odd one out (as with C3)."""
    assert _run(_sequence(2, 30, slow=1)) == []
