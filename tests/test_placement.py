"""tests/placement.py: a test's fault placement is a function of (seed, its node id) alone, within its ranges."""

from types import SimpleNamespace

import pytest

from tests import placement


def fake_request(nodeid: str):
    return SimpleNamespace(node=SimpleNamespace(nodeid=nodeid))


@pytest.fixture
def seed_42():
    before = placement._seed
    placement.configure({placement.ENV: "42"})
    yield
    placement._seed = before  # the session's own seed, for every other test


def draws(nodeid: str, n: int = 3) -> list:
    req = fake_request(nodeid)
    return [placement.place(req, ranks=range(4), steps=range(2, 10)) for _ in range(n)]


def test_the_same_seed_and_node_give_the_same_placements_whatever_ran_before(seed_42):
    first = draws("tests/test_x.py::test_a")
    draws("tests/test_x.py::test_b")  # another test drawing in between changes nothing
    assert draws("tests/test_x.py::test_a") == first
    assert all(p.seed == 42 and p.rank in range(4) and p.step in range(2, 10) for p in first)
    # 100 node ids: each placement is drawn over the whole range, not stuck on one value
    seen = {(p.rank, p.step) for i in range(100) for p in draws(f"t::{i}", 1)}
    assert len({r for r, _ in seen}) == 4 and len({s for _, s in seen}) == 8


def test_where_restricts_the_pairs_and_an_empty_range_is_refused(seed_42):
    req = fake_request("t::where")
    got = {
        (p.rank, p.step)
        for p in (
            placement.place(req, ranks=range(3), steps=(4, 8, 12), where=lambda r, s: (s // 4 - 1) % 3 == r)
            for _ in range(30)
        )
    }
    assert got == {(0, 4), (1, 8), (2, 12)}
    assert placement.place(req, ranks=[1]).step is None
    with pytest.raises(ValueError):
        placement.place(req, ranks=range(2), steps=[])


def test_the_seed_comes_from_the_environment_or_is_drawn():
    before = placement._seed
    try:
        assert placement.configure({placement.ENV: " 7 "}) == 7
        assert "SCOUT_TEST_SEED=7" in placement.header()
        assert 0 <= placement.configure({}) < 10**6
        with pytest.raises(ValueError, match="non-negative integer"):
            placement.configure({placement.ENV: "-3"})
    finally:
        placement._seed = before
