"""Replica groups from the DeviceMesh and each DTensor's placements, on real gloo ranks: DDP x TP and FSDP x TP
(2x2), HSDP x TP (2x2x2, 8 ranks), FSDP alone; a divergence in one element of one rank's shard is caught in the
right group and attributed to the right global rank where a strict majority exists; nothing compared is
`missing`, never `pass`."""

from __future__ import annotations

import pytest

from scout_ckpt.consensus.mesh import Grid, legacy_topology
from scout_ckpt.policy import evaluate
from scout_ckpt.testing.launch import run_ranks
from tests import workers_mesh as W

TIMEOUT = 240


def same_everywhere(out) -> dict:
    """Rank 0's result, after checking every rank returned the same evidence and topology."""
    first = out[0].result
    for o in out:
        assert o.result["evidence"] == first["evidence"], o.rank
        assert o.result["topology"] == first["topology"], o.rank
    return first


def groups_of(ev: dict) -> list[tuple[list[int], list[str], str]]:
    return [(g["members"], g["dims"], g["verdict"]) for g in ev["groups"]]


def stable(ev: dict) -> dict:
    """Evidence without its timing."""
    return {k: v for k, v in ev.items() if k != "duration_s"}


def reason(ev: dict, code: str) -> dict:
    (r,) = [r for r in ev["reasons"] if r["code"] == code]
    return r


# ---- pure: the grid ---------------------------------------------------------------------------------------------


def test_grid_partitions():
    g = Grid.make((2, 2, 2), ("replicate", "shard", "tp"), range(8))
    assert g.coords[5] == (1, 0, 1)
    assert g.partition((0,)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.partition((0, 2)) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g.partition((0, 1, 2)) == [list(range(8))]
    assert g.partition(()) == [[r] for r in range(8)]
    assert g.nested() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    pp = Grid.make((2, 2), ("pp", "dp"), range(4))
    assert pp.plain_dims == (1,) and pp.partition(pp.plain_dims) == [[0, 1], [2, 3]]  # stages never compared


def test_legacy_topologies():
    assert legacy_topology("hsdp", 6, (2, 3))["replica_groups"] == [[0, 3], [1, 4], [2, 5]]
    assert legacy_topology("hsdp", 4, (2, 2))["compare_dims"] == [["replicate", "shard"], ["replicate"]]
    assert legacy_topology("fsdp", 3)["compare_dims"] == [["shard"]]  # plain state only
    assert legacy_topology("ddp", 1)["compare_dims"] == []
    for bad in [("hsdp", 4, None), ("tp", 4, None), ("ddp", 0, None)]:
        with pytest.raises(ValueError):
            legacy_topology(*bad)


# ---- DDP x TP ---------------------------------------------------------------------------------------------------


def test_ddp_x_tp():
    res = same_everywhere(run_ranks(W.ddp_tp, 4, timeout=TIMEOUT, pg_timeout_s=120))
    topo, ev = res["topology"], res["evidence"]
    assert topo["mode"] == "ddp+tp" and topo["mesh_shape"] == [2, 2] and topo["mesh_dim_names"] == ["dp", "tp"]
    assert topo["dim_roles"] == {"dp": "replicate", "tp": "tensor_parallel"} and topo["problems"] == []
    assert topo["compare_dims"] == [["dp", "tp"], ["dp"]]
    assert topo["primary"] == ["dp"] and topo["replica_groups"] == [[0, 2], [1, 3]]
    for key in ("healthy", "healthy_again"):
        assert ev[key]["status"] == "pass", ev[key]
        assert groups_of(ev[key]) == [
            ([0, 1, 2, 3], ["dp", "tp"], "agree"),
            ([0, 2], ["dp"], "agree"),
            ([1, 3], ["dp"], "agree"),
        ]
    # Replicate on tp and copied along dp: 4 replicas, the odd one named
    assert reason(ev["tp_replicated"], "consensus_attributed") == {
        "code": "consensus_attributed",
        "ranks": [3],
        "tensors": ["model.down.bias"],
        "n_tensors": 1,
        "group": [0, 1, 2, 3],
    }
    assert reason(ev["plain_param"], "consensus_attributed")["ranks"] == [1]
    assert reason(ev["plain_param"], "consensus_attributed")["tensors"] == ["model.norm.weight"]
    # a TP shard has one copy per dp replica: the pair that differs is found, no culprit can be named
    for key, pair, tensor in (
        ("tp_shard", [0, 2], "model.up.weight"),
        ("optim_shard", [1, 3], "optim.state.2.exp_avg"),
    ):
        assert ev[key]["status"] == "inconclusive"
        r = reason(ev[key], "consensus_inconclusive")
        assert r["group"] == pair and r["tensors"] == [tensor], (key, r)
        assert [v for m, _, v in groups_of(ev[key]) if m != pair] == ["agree", "agree"]
        assert evaluate({"require": ["consensus"]}, {"consensus": ev[key]}).state == "rejected"


# ---- FSDP x TP --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp_runs():
    """FSDP x TP and FSDP alone, in one set of 4 ranks."""
    out = run_ranks(W.fsdp_runs, 4, timeout=TIMEOUT, pg_timeout_s=120)
    return {key: [type(o)(o.rank, o.exitcode, o.result[key]) for o in out] for key in ("fsdp_tp", "fsdp_only")}


def test_fsdp_x_tp(fsdp_runs):
    res = same_everywhere(fsdp_runs["fsdp_tp"])
    topo, ev = res["topology"], res["evidence"]
    assert topo["mode"] == "fsdp+tp" and topo["dim_roles"] == {"dp": "shard", "tp": "tensor_parallel"}
    assert topo["compare_dims"] == [["dp", "tp"], ["tp"]] and topo["problems"] == []
    # the old 2-D inference called this HSDP and compared ranks 0,2 (different FSDP shards): every save rejected
    healthy = ev["healthy"]
    assert groups_of(healthy) == [
        ([0, 1, 2, 3], ["dp", "tp"], "agree"),
        ([0, 1], ["tp"], "agree"),
        ([2, 3], ["tp"], "agree"),
    ]
    # TP-and-FSDP-sharded weights have no replica: agreement leaves them unvouched
    assert healthy["status"] == "not_applicable" and healthy["single_owner"] > 0
    assert "model.up.weight" in reason(healthy, "no_replicas")["tensors"]
    assert stable(ev["healthy_again"]) == stable(healthy)
    r = reason(ev["norm_pair"], "consensus_inconclusive")
    assert r["group"] == [0, 1] and r["tensors"] == ["model.norm.weight"]
    assert ev["plain_step"]["status"] == "fail"
    r = reason(ev["plain_step"], "consensus_attributed")
    assert r["ranks"] == [2] and r["tensors"] == ["optim.state.4.step"] and r["group"] == [0, 1, 2, 3]
    # Partial: fails closed with a reason, never a pass
    assert ev["partial"]["status"] == "missing"
    r = reason(ev["partial"], "consensus_layout_unknown")
    assert r["tensors"] == ["pending"] and r["ranks"] == [0, 1, 2, 3] and "pending reduction" in r["detail"]
    nothing = ev["everything_excluded"]
    assert nothing["status"] == "missing" and nothing["tensors_compared"] == 0
    assert [r["code"] for r in nothing["reasons"]] == ["consensus_nothing_compared"]
    assert (
        evaluate({"require": ["consensus"], "allow_not_applicable": ["consensus"]}, {"consensus": nothing}).state
        == "committed"
    )


# ---- HSDP x TP (8 ranks) ----------------------------------------------------------------------------------------


def test_hsdp_x_tp_8_ranks():
    res = same_everywhere(run_ranks(W.hsdp_tp, 8, timeout=TIMEOUT, pg_timeout_s=180))
    topo, ev = res["topology"], res["evidence"]
    assert topo["mode"] == "hsdp+tp" and topo["mesh_shape"] == [2, 2, 2]
    assert topo["dim_roles"] == {"replicate": "replicate", "shard": "shard", "tp": "tensor_parallel"}
    assert topo["compare_dims"] == [["replicate", "shard", "tp"], ["replicate"], ["replicate", "tp"]]
    assert topo["replica_groups"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # most parameter elements: the TP weight
    assert res["group_ranks"] == [0, 4]
    healthy = ev["healthy"]
    assert healthy["status"] == "pass" and stable(ev["healthy_again"]) == stable(healthy)
    assert groups_of(healthy) == [(list(range(8)), ["replicate", "shard", "tp"], "agree")] + [
        (g, ["replicate"], "agree") for g in ([0, 4], [1, 5], [2, 6], [3, 7])
    ] + [(g, ["replicate", "tp"], "agree") for g in ([0, 1, 4, 5], [2, 3, 6, 7])]
    assert reason(ev["norm"], "consensus_attributed") == {
        "code": "consensus_attributed",
        "ranks": [5],
        "tensors": ["model.norm"],
        "n_tensors": 1,
        "group": [0, 1, 4, 5],
    }
    assert reason(ev["plain"], "consensus_attributed")["ranks"] == [4]
    r = reason(ev["tp_shard"], "consensus_inconclusive")
    assert r["group"] == [2, 6] and r["tensors"] == ["model.w"]


# ---- FSDP alone, and a topology mismatch -------------------------------------------------------------------------


def test_fsdp_only_compares_plain_state_not_shards(fsdp_runs):
    res = same_everywhere(fsdp_runs["fsdp_only"])
    topo, ev = res["topology"], res["evidence"]
    assert topo["mode"] == "fsdp" and topo["compare_dims"] == [["dp"]]
    assert topo["replica_groups"] == [[0], [1], [2], [3]] and res["group_ranks"] == [res["group_ranks"][0]]
    healthy = ev["healthy"]
    assert healthy["status"] == "not_applicable" and healthy["plain_state_only"]
    # every parameter's shard, its exp_avg and exp_avg_sq: 6 x 3
    assert healthy["tensors_compared"] > 0 and healthy["single_owner"] == 18
    assert groups_of(healthy) == [([0, 1, 2, 3], ["dp"], "agree")]
    assert reason(ev["plain_step"], "consensus_attributed")["ranks"] == [3]
    shards = ev["shards_only"]
    assert shards["status"] == "missing" and shards["reasons"][0]["code"] == "consensus_nothing_compared"


def test_ranks_with_different_topologies_fail_at_startup():
    out = run_ranks(W.mismatched_topology, 4, timeout=120)
    assert all("different topologies" in o.result for o in out)


# ---- _StridedShard (TorchTitan's FSDP x TP) and placements consensus does not know ------------------------------


def test_strided_shard_is_a_shard_dim_and_unknown_placements_fail_closed():
    """One process on torch's "fake" backend (a real ProcessGroup that moves no data): a world of 8 as rank 5,
    HSDP x TP (dp_replicate 2, dp_shard 2, tp 2) with the placements FSDP x TP gives a colwise weight:
    [Replicate, _StridedShard(0, sf=2), Shard(0)]. Cheap: no ranks are started."""
    import types

    import torch
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import Placement, _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from scout_ckpt.consensus.indexing import dtensor_box
    from scout_ckpt.consensus.mesh import LayoutError, describe_topology, dtensor_dims, full_signable, placement_kind

    # The suite runs ranks in child processes; a group here means an earlier test leaked one (a bug to see).
    assert not dist.is_initialized(), "an earlier test left a process group initialised in the pytest process"
    dist.init_process_group("fake", rank=5, world_size=8, store=FakeStore())
    try:
        names = ("dp_replicate", "dp_shard", "tp")
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
        strided = _StridedShard(0, split_factor=2)
        assert not strided.is_shard() and placement_kind(strided) == "shard"  # not a Shard in torch 2.13
        dt = DTensor.from_local(torch.zeros(2, 4), mesh, [Replicate(), strided, Shard(0)], run_check=False)
        grid = Grid.make((2, 2, 2), names, range(8))
        assert dtensor_dims(dt, grid) == (0,)  # compared across dp_replicate only: rank 5's replica is rank 1
        model = torch.nn.Linear(4, 8, bias=False)
        model.weight = torch.nn.Parameter(dt)
        topo = describe_topology(model, world_size=8, grid=grid, roles={"tp": "tensor_parallel"})
        assert topo["problems"] == [] and topo["mode"] == "hsdp+tp"
        assert topo["compare_dims"] == [list(names), ["dp_replicate"]]
        assert topo["replica_groups"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
        with pytest.raises(ValueError, match="Shard"):  # full-tensor signatures need a box: refused, not guessed
            dtensor_box(dt)
        plain = torch.ones(3)
        assert full_signable({"w": dt, "step": plain}) == ({"step": plain}, ["w"])  # sign the rest, list it

        class Odd(Placement):  # a placement a future torch might add
            pass

        for p, why in ((Odd(), "not one scout-ckpt can map"), (Partial(), "pending reduction")):
            with pytest.raises(LayoutError, match=why):
                dtensor_dims(types.SimpleNamespace(device_mesh=mesh, placements=(Replicate(), p, Shard(0))), grid)
    finally:
        dist.destroy_process_group()
