"""Automatic garbage collection held off while save() blocks (save/gc_hold.py): off inside, back as it was after,
on every path; never turned on where the application turned it off."""

from __future__ import annotations

import gc

import pytest

from scout_ckpt.save.gc_hold import collection_held


@pytest.fixture(autouse=True)
def _restore_gc():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_collection_is_off_inside_and_on_again_after():
    gc.enable()
    with collection_held():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_an_exception_inside_turns_collection_back_on():
    gc.enable()
    with pytest.raises(KeyError), collection_held():
        raise KeyError("a failed save")
    assert gc.isenabled()


def test_a_nested_hold_leaves_it_off_until_the_outermost_ends():
    gc.enable()
    with collection_held():
        with collection_held():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_collection_the_application_turned_off_stays_off():
    gc.disable()
    with collection_held():
        pass
    assert not gc.isenabled()
