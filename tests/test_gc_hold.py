"""Older-generation garbage collection held off while save() blocks (save/gc_hold.py): young collections go on,
generations 1 and 2 wait, the thresholds come back as they were on every path, and nothing changes where the
application turned automatic collection off."""

from __future__ import annotations

import gc

import pytest

from scout_ckpt.save.gc_hold import collection_held


@pytest.fixture(autouse=True)
def _restore_gc():
    was, thresholds = gc.isenabled(), gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if was else gc.disable)()


def test_older_generations_wait_inside_and_the_thresholds_come_back():
    gc.enable()
    gc.set_threshold(700, 10, 10)
    with collection_held():
        inside = gc.get_threshold()
        assert gc.isenabled()
    assert inside[0] == 700
    assert min(inside[1:]) > 10**6
    assert gc.get_threshold() == (700, 10, 10)


def test_young_collections_go_on_inside_and_free_cyclic_garbage():
    gc.enable()
    gc.set_threshold(700, 10, 10)
    freed = []

    def watch(phase, info):
        if phase == "stop":
            freed.append((info["generation"], info["collected"]))

    gc.callbacks.append(watch)
    try:
        with collection_held():
            for _ in range(20_000):  # cycles made and dropped, as a save's replays leave some
                a: list = []
                a.append(a)
    finally:
        gc.callbacks.remove(watch)
    assert sum(n for g, n in freed if g == 0) > 0
    assert [g for g, _ in freed if g > 0] == []


def test_an_exception_inside_restores_the_thresholds():
    gc.enable()
    gc.set_threshold(500, 7, 9)
    with pytest.raises(KeyError), collection_held():
        raise KeyError("a failed save")
    assert gc.get_threshold() == (500, 7, 9)


def test_a_nested_hold_keeps_them_raised_until_the_outermost_ends():
    gc.enable()
    gc.set_threshold(700, 10, 10)
    with collection_held():
        with collection_held():
            pass
        assert gc.get_threshold()[1] > 10**6
    assert gc.get_threshold() == (700, 10, 10)


def test_nothing_changes_where_the_application_turned_collection_off():
    gc.disable()
    gc.set_threshold(700, 10, 10)
    with collection_held():
        assert gc.get_threshold() == (700, 10, 10)
    assert not gc.isenabled()
