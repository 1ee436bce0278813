"""Where a test's injected fault lands (which rank, which step), drawn from one seed per pytest session.

A fault always placed at the same rank and step proves the code handles that one placement; drawing it from a
range, with a new seed each session, covers the range over many runs, while a printed seed keeps every failure
reproducible. The seed is `SCOUT_TEST_SEED` when set, else drawn once when pytest starts (tests/conftest.py's
`pytest_configure`); pytest's header prints it, and a failing test's report adds a "fault placement" section
naming the seed and every placement the test drew. Rerun with `SCOUT_TEST_SEED=N` to get the same placements.

Each test draws from its own stream, seeded by (session seed, the test's node id), so its placements do not
depend on which other tests ran, in which order, or with what `-k`. A test's expected outcome must follow from
the placement by the test's own reasoning (e.g. the resume step is the newest save before the crash step), never
from the code under test, and its range must hold only placements for which that outcome is defined.

    pl = place(request, ranks=range(1, world), steps=range(3, 9))
    job(..., "--crash-rank", pl.rank, "--crash-step", pl.step)
    assert loaded == newest_save_before(pl.step), pl
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Callable, Iterable

ENV = "SCOUT_TEST_SEED"
_seed: int | None = None


def configure(env: dict | None = None) -> int:
    """Fix the session's seed: `SCOUT_TEST_SEED` if set (a non-negative integer), else a fresh random one."""
    global _seed
    text = (os.environ if env is None else env).get(ENV, "").strip()
    if text:
        if not text.isdigit():
            raise ValueError(f"{ENV} must be a non-negative integer, got {text!r}")
        _seed = int(text)
    else:
        _seed = random.SystemRandom().randrange(10**6)
    return _seed


def session_seed() -> int:
    return configure() if _seed is None else _seed


def header() -> str:
    s = session_seed()
    return f"fault placement seed: {s} (rerun with {ENV}={s})"


@dataclass(frozen=True)
class Placement:
    rank: int
    step: int | None  # None: a fault of every step (a straggler), placed by rank only
    seed: int

    def __str__(self) -> str:
        at = f"rank {self.rank}" + ("" if self.step is None else f", step {self.step}")
        return f"fault at {at} ({ENV}={self.seed})"

    __repr__ = __str__  # in an assertion message, as a tuple's item too


def _stream(request) -> random.Random:
    """The test's own stream: seeded by (session seed, node id), continued by each draw within the test."""
    node = request.node
    rng = getattr(node, "_scout_placement_rng", None)
    if rng is None:
        rng = random.Random(f"{session_seed()}|{node.nodeid}")  # a str seed is hashed by sha512: stable
        node._scout_placement_rng = rng
        node._scout_placements = []
    return rng


def place(
    request, ranks: Iterable[int], steps: Iterable[int] | None = None, where: Callable[[int, int], bool] | None = None
) -> Placement:
    """One (rank, step), uniform over the pairs of `ranks` x `steps` that `where(rank, step)` admits (all by
    default); `steps=None` places by rank only. Recorded on the test's node, so a failure's report names it with
    the seed."""
    rng = _stream(request)
    steps = [None] if steps is None else steps
    pairs = [(r, s) for r in ranks for s in steps if where is None or where(r, s)]
    if not pairs:
        raise ValueError("no placement admitted by the ranges given")
    rank, step = rng.choice(pairs)
    pl = Placement(rank, step, session_seed())
    request.node._scout_placements.append(pl)
    print(f"fault placement: {pl}")
    return pl


def placements_of(item) -> list[Placement]:
    """The placements a test drew (for its report)."""
    return list(getattr(item, "_scout_placements", []))
