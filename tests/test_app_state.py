"""The script's own state (RNG, data position, scalars) round-trips through a certified checkpoint, per rank."""

import pytest

from scout_ckpt import Scalars
from scout_ckpt.testing.launch import run_ranks
from tests import workers_app_state as w


def test_scalars_round_trip_types():
    values = {"iter_num": 7, "best": 0.25, "done": True}
    sd = Scalars(values).state_dict()
    fresh = {"iter_num": 0, "best": 0.0, "done": False}
    Scalars(fresh).load_state_dict(sd)
    assert fresh == values and type(fresh["iter_num"]) is int and type(fresh["done"]) is bool


def test_scalars_refuse_objects():
    with pytest.raises(TypeError, match="not an int, float or bool"):
        Scalars({"path": "x"}).state_dict()


@pytest.mark.slow
def test_rank_local_rng_and_scalars_resume_per_rank(tmp_path):
    root = str(tmp_path / "run")
    saved = [o.result for o in run_ranks(w.save_then_draw, 3, root, timeout=180)]
    # Ranks seeded differently, so their RNG state differs: still certified (never compared across ranks).
    assert all(s["verdict"]["state"] == "certified" for s in saved), saved[0]["verdict"]
    loaded = [o.result for o in run_ranks(w.load_then_draw, 3, root, timeout=180)]
    for rank in range(3):
        assert loaded[rank]["start"] == 3
        # The oracle is what each rank drew right after its own save, not scout-ckpt's verifier.
        assert loaded[rank]["after"] == saved[rank]["after"]
        assert loaded[rank]["local"] == saved[rank]["local"]
        assert loaded[rank]["extra"] == saved[rank]["extra"]
    assert len({str(s["after"]) for s in saved}) == 3  # the ranks really did differ
