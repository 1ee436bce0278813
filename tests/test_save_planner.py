"""DCP's plan cache as the Checkpointer uses it (save/planner.py): reused while the state's layout is unchanged,
re-planned when a shape, a dtype or a key changes, one cache per Checkpointer, dropped at close. Judged by the
files DCP wrote (their `.metadata` and the tensors loaded back), against the tensors the test built."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlanner

from scout_ckpt.save.planner import PlanCache
from scout_ckpt.save.storage import ScoutWriter
from scout_ckpt.testing.launch import run_ranks
from tests import workers_planner as w


def _save(cache: PlanCache, state: dict, path) -> None:
    dcp.save(state, storage_writer=ScoutWriter(path, step=0), planner=cache.planner(), no_dist=True)


def _read_back(path, like: dict) -> tuple[dict, dict]:
    """(the stored tensors' (dtype, shape) from `.metadata`, the tensors loaded into fresh buffers)."""
    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    layout = {k: (v.properties.dtype, tuple(v.size)) for k, v in md.items() if hasattr(v, "properties")}
    fresh = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(fresh, checkpoint_id=str(path), no_dist=True)
    return layout, fresh


def test_an_unchanged_layout_reuses_the_plan_and_writes_this_saves_values(tmp_path):
    cache = PlanCache()
    first = {"w": torch.randn(4, 3), "b": torch.ones(5)}
    _save(cache, first, tmp_path / "a")
    meta = SavePlanner._cached_metadata[cache.key]
    second = {"w": torch.randn(4, 3), "b": torch.full((5,), 2.0)}
    _save(cache, second, tmp_path / "b")
    assert SavePlanner._cached_metadata[cache.key] is meta  # planned once
    _, loaded = _read_back(tmp_path / "b", second)
    assert all(torch.equal(loaded[k], second[k]) for k in second)
    cache.clear()


def test_a_new_dtype_at_the_same_shape_is_planned_anew(tmp_path):
    # torch's own comparison of plans looks at names and chunks only: the cached .metadata would keep float32
    cache = PlanCache()
    _save(cache, {"w": torch.randn(4, 3)}, tmp_path / "a")
    wider = {"w": torch.randn(4, 3, dtype=torch.float64)}
    _save(cache, wider, tmp_path / "b")
    layout, loaded = _read_back(tmp_path / "b", wider)
    assert layout["w"] == (torch.float64, (4, 3))
    assert torch.equal(loaded["w"], wider["w"])
    cache.clear()


def test_a_new_shape_and_a_new_key_are_planned_anew(tmp_path):
    cache = PlanCache()
    _save(cache, {"w": torch.randn(4, 3)}, tmp_path / "a")
    grown = {"w": torch.randn(6, 3), "extra": torch.arange(3.0)}
    _save(cache, grown, tmp_path / "b")
    layout, loaded = _read_back(tmp_path / "b", grown)
    assert layout == {"w": (torch.float32, (6, 3)), "extra": (torch.float32, (3,))}
    assert all(torch.equal(loaded[k], grown[k]) for k in grown)
    cache.clear()


def test_two_caches_never_share_plans_and_clear_drops_them(tmp_path):
    a, b = PlanCache(), PlanCache()
    assert a.key != b.key
    _save(a, {"w": torch.randn(4, 3)}, tmp_path / "a")
    other = {"v": torch.randn(2)}
    _save(b, other, tmp_path / "b")  # b's first plan: a's cached plan must not stand in for it
    layout, loaded = _read_back(tmp_path / "b", other)
    assert layout == {"v": (torch.float32, (2,))}
    assert torch.equal(loaded["v"], other["v"])
    a.clear()
    b.clear()
    assert a.key not in SavePlanner._cached_metadata
    assert b.key not in SavePlanner._cached_save_plan


@pytest.mark.scenario  # 2 gloo ranks, about 10 s: every Checkpointer test with two saves runs the cached path too
def test_checkpointer_saves_of_changing_layouts_on_two_ranks_store_each_saves_state(tmp_path):
    out = run_ranks(w.save_changing_layouts, 2, str(tmp_path), timeout=120)
    coordinator = out[0].result
    assert coordinator["verdicts"] == ["certified"] * 5
    # reused at step 2 (same layout), re-planned at 3, 4, 5 (shape, dtype, key)
    assert coordinator["reused"] == [False, True, False, False, False]
    assert [r.result["left_after_close"] for r in out] == [False, False]
    for step in range(1, 6):
        want = w.layouts(step)
        tensors = {f"app.{k}": v for k, v in want.items() if isinstance(v, torch.Tensor)}
        path = tmp_path / f"step-{step:08d}"
        layout, loaded = _read_back(path, tensors)
        assert layout == {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
        assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
