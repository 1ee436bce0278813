"""Replay covers real model shapes: targets found through DDP, FSDP2, torch.compile and activation-checkpoint
wrappers, named as the user's model names them; the optimizer replay reaches every element of every parameter
within a cycle; the save-boundary sweep gives a checkpoint complete replay evidence of its own step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scout_ckpt.errors import NoTargets, ScoutError
from scout_ckpt.replay.schedule import coverage
from scout_ckpt.replay.targets import discover, resolve, sites, user_path
from scout_ckpt.testing.launch import run_ranks
from tests import workers_replay_targets as w


@pytest.fixture
def one_thread():
    """In-process compute on one thread (see test_replay.py: an OpenMP pool here could hang forked ranks)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _same_rows(outcomes, key=None):
    got = [o.result if key is None else o.result[key] for o in outcomes]
    assert all(g == got[0] for g in got), "replay rows must be identical on all ranks"
    return got[0]


# ---- discovery (one process) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", sorted(w.SHAPES))
def test_discovery_finds_blocks_embedding_and_head_of_each_shape(shape, one_thread):
    model = w.build(shape)
    opt = torch.optim.AdamW(model.parameters())
    assert discover(model, opt) == w.EXPECTED[shape] + [("optimizer", "optimizer")]
    # activation checkpointing wraps every block: same user paths
    assert discover(w.build(shape, checkpointing=True)) == w.EXPECTED[shape]


def test_gpt2_head_is_found_although_its_weight_is_the_embedding(one_thread):
    model = w.build("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert ("head", "lm_head") in discover(model)


@pytest.mark.parametrize("shape", sorted(w.SHAPES))
def test_torch_compile_is_unwrapped_whole_model_and_per_block(shape, one_thread):
    """Real torch.compile objects, never run (compiling on CPU costs seconds): `_orig_mod` is transparent."""
    model = w.build(shape)
    compiled = torch.compile(model)
    assert type(compiled).__name__ == "OptimizedModule" and compiled._orig_mod is model
    assert discover(compiled) == w.EXPECTED[shape]
    # TorchTitan compiles each block and puts the compiled module back in its container
    holder = model.model.layers if shape == "hf" else model.transformer.h if shape == "gpt2" else model.layers
    for name, block in list(holder.named_children()):
        holder.register_module(name, torch.compile(block))
    assert discover(model) == w.EXPECTED[shape]
    # raw paths spelled with the wrapper components resolve to the user path
    block = w.EXPECTED[shape][-2][1]
    assert user_path(compiled, "_orig_mod." + block) == block
    assert user_path(model, block + "._orig_mod") == block
    site = sites(compiled)[block]
    assert type(site.outer).__name__ == "OptimizedModule" and type(site.inner) is w.DecoderLayer
    # whole-model compile hides the blocks' hooks (the runner then runs capture steps eagerly); per-block does not
    assert site.under_compile and not sites(model)[block].under_compile


def test_a_model_without_blocks_is_covered_layer_by_layer(one_thread):
    """A user's net with nothing repeated (fc1, an activation, fc2; a DDP-wrapped nn.Sequential of Linear and
    ReLU): every child that holds parameters is a target, in order; parameter-free layers are not."""
    assert discover(w.NoBlocks()) == [("block", "fc1"), ("block", "fc2")]
    seq = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert discover(seq, optimizer=object()) == [
        ("embedding", "0"),
        ("block", "1"),
        ("block", "3"),
        ("optimizer", "optimizer"),
    ]


def test_a_model_with_nothing_to_cover_is_refused_at_construction(one_thread):
    """A bare Linear (its parameters on the root itself): no block and no child to replay -> NoTargets, one line
    that says how to name targets or turn replay off, and the runner refuses before touching a process group."""
    with pytest.raises(NoTargets) as e:
        discover(nn.Linear(4, 4))
    msg = str(e.value)
    assert isinstance(e.value, ScoutError) and "\n" not in msg
    assert "targets=" in msg and "replay=False" in msg
    from scout_ckpt.replay.runner import ReplayRunner

    with pytest.raises(NoTargets):
        ReplayRunner(nn.Linear(4, 4), groups=None)


def test_targets_override_accepts_user_paths_raw_paths_and_pairs(one_thread):
    model = w.build("gpt2")
    ddp_like = nn.Module()
    ddp_like.inner = model  # not a wrapper: `inner` is an ordinary child and stays in the path
    assert resolve(model, ["transformer.h.1", "transformer.wte", "optimizer"]) == [
        ("block", "transformer.h.1"),
        ("embedding", "transformer.wte"),
        ("optimizer", "optimizer"),
    ]
    assert resolve(torch.compile(model), ["_orig_mod.lm_head", ("head", "lm_head")]) == [
        ("block", "lm_head"),
        ("head", "lm_head"),
    ]
    assert resolve(ddp_like, ["inner.lm_head"]) == [("block", "inner.lm_head")]
    with pytest.raises(NoTargets, match="not a submodule"):
        resolve(model, ["transformer.h.9"])
    with pytest.raises(NoTargets):
        resolve(model, [])


def test_largest_container_of_same_class_children_is_the_fallback(one_thread):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(w.VOCAB, w.D)
            self.stem = nn.ModuleList([nn.Linear(w.D, w.D), nn.Linear(w.D, w.D)])
            self.trunk = nn.Sequential(*(w.DecoderLayer() for _ in range(3)))
            self.proj = nn.Linear(w.D, w.VOCAB)

    names = [t for _, t in discover(Odd())]
    assert names == ["emb", "trunk.0", "trunk.1", "trunk.2", "proj"]


def test_demo_model_blocks_are_still_found(one_thread):
    from scout_ckpt.demo.model import TinyTransformer

    assert [t for _, t in discover(TinyTransformer(n_blocks=4))] == [
        "embedding",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks.3",
        "head",
    ]


# ---- optimizer windows (one process) -----------------------------------------------------------------------------


def test_optimizer_windows_cover_every_element_of_every_parameter_in_one_cycle(one_thread):
    from scout_ckpt.replay.optimizer_replay import (
        OptimizerCapture,
        replay_update,
        windows,
    )

    model = w.build("titan")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    budget = 1000
    cap = OptimizerCapture(opt, max_elems=budget)
    seen = [torch.zeros(p.numel(), dtype=torch.bool) for p in params]
    cycle = max(n for _, _, n in windows([p.numel() for p in params], budget, 0))
    assert cycle > 3  # the test means something: several rounds are needed
    for rnd in range(cycle):
        cap.arm(rnd)
        w.loss_of(model, w.tokens_for(rnd, 0)).backward()
        opt.step()
        opt.zero_grad()
        cap.disarm()
        c = cap.capture
        assert len(c.params) == len(params) and c.cycle == cycle  # every tensor, every round
        assert c.elements <= budget + 64 * len(params)
        for i, (s, p) in enumerate(zip(c.starts, c.params)):
            seen[i][s : s + p.numel()] = True
        new_p, _ = replay_update(type(opt), opt.defaults, c)
        assert all(torch.equal(a, b) for a, b in zip(new_p, c.after_params))  # bitwise, grouped replay
    assert all(bool(s.all()) for s in seen), "every element of every parameter within one cycle"
    # the choice is a pure function of the round: the same on every rank and after a restart
    assert windows([1000, 5000], 600, 7) == windows([1000, 5000], 600, 7)
    assert windows([1000, 5000], 600, 7) != windows([1000, 5000], 600, 8)
    assert windows([10, 20], 600, 3) == [(0, 10, 1), (0, 20, 1)]  # the whole model fits: whole tensors


# ---- real gloo runs ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_wrapped_models_are_discovered_and_replayed_on_two_ranks(kind):
    outcomes = run_ranks(w.w_discover_wrapped, 2, kind, timeout=240)
    res = _same_rows(outcomes)
    for shape, r in res.items():
        want = w.EXPECTED[shape] + [("optimizer", "optimizer")]
        assert r["found"] == w.EXPECTED[shape] and r["inner"] == w.EXPECTED[shape], (shape, r["found"])
        # step 2: the rotation's target plus the sweep of every other one, each replayed once, all clean
        at2 = [(x["target"], x["status"]) for x in r["rows"] if x["step"] == 2]
        assert sorted(at2) == sorted((t, "AGREE") for _, t in want), shape
        assert sum(1 for x in r["rows"] if x["step"] == 2 and not x["detail"].get("sweep")) == 1
        if kind == "ddp" and shape == "hf":  # a save announced at 3 never came: its rotation replay still ran
            at3 = [(x["target"], x["status"], x["detail"].get("sweep")) for x in r["rows"] if x["step"] == 3]
            assert at3 == [(want[(3 - 1) % len(want)][1], "AGREE", None)], at3
            assert [x["step"] for x in r["rows"]][-2:] == [3, 4]
        if kind == "fsdp":
            assert all(c.startswith("FSDP") for c in r["classes"]), r["classes"]
    assert res["titan"]["classes"] == (["CheckpointWrapper"] if kind == "ddp" else ["FSDPCheckpointWrapper"])


@pytest.mark.slow
@pytest.mark.scenario  # compiles a model: 35-40 s on a loaded 2-core machine (make scenarios runs it)
def test_whole_model_compile_under_ddp_is_captured_on_eager_steps():
    """nanoGPT: DDP(torch.compile(model)). Dynamo ignores hooks added after compiling, so the steps with a capture
    armed run eagerly; every target replays (rotation at 2 and 3, sweep of all at 3)."""
    outcomes = run_ranks(w.w_nanogpt_compiled, 2, 3, (3,), timeout=300)
    res = outcomes[0].result
    assert all(o.result["rows"] == res["rows"] for o in outcomes)
    assert res["found"] == w.EXPECTED["gpt2"]
    rows = res["rows"]
    assert {r["target"] for r in rows if r["step"] == 3} == {t for _, t in w.EXPECTED["gpt2"]} | {"optimizer"}
    assert {r["status"] for r in rows} == {"AGREE"} and [r["step"] for r in rows][:2] == [2, 3]
    assert all(o.result["stance_restored"] for o in outcomes)


@pytest.fixture(scope="module")
def three_ranks():
    """The sweep and the optimizer scenarios share one 3-rank start-up."""
    outcomes = run_ranks(
        w.w_sweep_and_optimizer,
        3,
        sweep_kw={
            "steps": 9,
            "save_at": (3, 5, 7, 9),
            "expect": (3, 5),
            "faults": {1: (1, 7, 1.5)},
            "unarmed": (1,),
            "bitwise": True,
            "poke": (5,),
            "head_fault": (2, 9, 2083, 1.5),
        },
        opt_kw={"steps": 14, "bad_rank": 2, "from_step": 2, "opt_elems": 1500},
        timeout=300,
    )
    return outcomes


def test_sweep_certifies_each_save_at_once_and_attributes_a_fault_from_the_save_step(three_ranks):
    """3 ranks, no rotation: a save at 1 (before anything was armed: its sweep replays nothing), step 2 captured
    while the save period is unknown, saves at 3 and 5 announced, 7 and 9 predicted from the period. Rank 1's blocks.1 computes wrongly from step 7:
    the sweep at the save at 7 attributes it to rank 1, and coverage fails 7 and 9 while 3 passes with no later
    replay. From 9 rank 2's head computes one interior output element wrongly: named at 9 too. At 5, after the
    step, user code writes in place into the activation blocks.0 received: the sweep's
    reference to it is stale, so blocks.0 is not replayed and 5 is not certified (coverage incomplete: fail
    closed); from 7 on blocks.0 is captured by copy and replays again."""
    outcomes = [o.result["sweep"] for o in three_ranks]
    rows = outcomes[0]["rows"]
    assert all(o["rows"] == rows for o in outcomes), "replay rows must be identical on all ranks"
    res = outcomes[0]
    targets = res["targets"]
    names = {t for _, t in targets}
    assert [s for s, armed in res["armed_at"].items() if armed] == [2, 3, 5, 7, 9]
    by_step = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r)
    assert sorted(by_step) == [3, 5, 7, 9]
    assert {(r["target"], r["status"]) for r in by_step[3]} == {(n, "AGREE") for n in names}
    ev = coverage([r for r in rows if r["step"] <= 3], targets, step=3)
    assert ev["status"] == "pass", ev  # lag 0: nothing after the save was needed
    assert {(r["target"], r["status"]) for r in by_step[5]} == {(n, "AGREE") for n in names - {"blocks.0"}}
    ev = coverage([r for r in rows if 3 < r["step"] <= 5], targets, step=5)
    assert ev["status"] == "missing" and ev["reasons"] == [
        {"code": "replay_coverage_incomplete", "missing": ["blocks.0"]}
    ], ev
    assert ("blocks.0", "AGREE") in {(r["target"], r["status"]) for r in by_step[7]}
    for s in (7, 9):
        bad = [r for r in by_step[s] if r["status"] != "AGREE"]
        # from 9 on rank 2's head (the last module target, before the optimizer) is off in one interior output
        # element: the sweep names it and only it
        assert [(r["target"], r["status"], r["ranks"]) for r in bad] == [("blocks.1", "ATTRIBUTED", [1])] + (
            [("head", "ATTRIBUTED", [2])] if s == 9 else []
        )
        assert all(r["detail"]["sweep"] for r in by_step[s])
    head9 = next(r for r in by_step[9] if r["target"] == "head")
    # the ring (the default sweep): rank 2's replay of rank 1's step and rank 0's replay of rank 2's step both
    # disagree in the output, the pairs around rank 2
    assert head9["detail"]["check"] == "ring"
    assert head9["detail"]["ring"]["failed_pairs"] == [[2, 0, "output"], [1, 2, "output"]]
    ev = coverage([r for r in rows if r["step"] > 5], targets, step=7)
    assert ev["status"] == "fail" and ev["reasons"][0]["ranks"] == [1] and ev["reasons"][0]["target"] == "blocks.1"
    # the fault found later does not reach back to the checkpoints the sweep cleared
    assert coverage(rows, targets, step=3)["status"] == "pass"
    opt_rows = [r for r in rows if r["recipe"] == "optimizer"]
    assert all(r["detail"]["elements"] > 0 and r["detail"]["tensors"] > 0 for r in opt_rows)
    assert all(o["bitwise"] for o in outcomes), "sweep capture must not change training by a bit"


def test_optimizer_replay_catches_a_corruption_of_the_last_parameters_last_element(three_ranks):
    steps = 14  # three_ranks: rank 2's optimizer corrupts the last element of the last parameter from step 2
    outcomes = [o.result["optimizer"] for o in three_ranks]
    rows = outcomes[0]["rows"]
    assert all(o["rows"] == rows for o in outcomes), "replay rows must be identical on all ranks"
    res = outcomes[0]
    assert [r["step"] for r in rows] == list(range(2, steps + 1))
    cycle = rows[0]["detail"]["cycle"]
    assert 3 <= cycle <= steps - 2, cycle
    assert all(r["detail"]["tensors"] == res["n_params"] for r in rows)  # every tensor in every round
    bad = [r for r in rows if r["status"] != "AGREE"]
    assert bad and all(r["status"] == "ATTRIBUTED" and r["ranks"] == [2] for r in bad)
    assert bad[0]["step"] < 2 + cycle, "caught within one cycle of the fault"
    assert bad[0]["detail"]["disagree"] == ["live_vs_replay"]
    assert len(bad) < len(rows)  # windows without the last element agree: the windows really move
