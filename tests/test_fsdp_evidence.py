"""FSDP2 evidence for single-owner shards: cross-rank replay of the optimizer update, and the at-rest check.

Pure decisions are tested without processes; the behaviour on real gloo ranks under `fully_shard` (2 and 4 ranks):
healthy runs agree everywhere and train bitwise as without the evidence; a persistently wrong update of one element
on one rank is caught and attributed within one cycle; a flipped low mantissa bit between step and save is caught
at rest and names the rank and the tensor."""

from __future__ import annotations

import pytest
import torch

from scout_ckpt import policy
from scout_ckpt.replay import shard_optimizer as so
from scout_ckpt.testing.launch import run_ranks
from tests import workers_fsdp_evidence as w

FAULT_PARAM, FAULT_INDEX = "blocks.1.fc1.weight", 517  # not element 0 of parameter 0
FLIP_PARAM, FLIP_INDEX = "blocks.0.qkv.weight", 301
HEALTHY_STEPS, FAULTY_STEPS = 6, 9  # with 16 units of 256 elements per step, a cycle is <= 5 steps


# ---- pure parts ------------------------------------------------------------------------------------------------


def test_any_cycle_of_consecutive_steps_covers_every_unit():
    units = so.plan_units([("a", 10_000), ("b", 1), ("c", 0), ("d", 8192)], 4096)
    assert [(u.param, u.offset, u.length) for u in units] == [
        ("a", 0, 4096),
        ("a", 4096, 4096),
        ("a", 8192, 1808),
        ("b", 0, 1),
        ("d", 0, 4096),
        ("d", 4096, 4096),
    ]
    n, per_step = len(units), 4
    cycle = -(-n // per_step)
    for start in range(7):
        seen = {p for s in range(start, start + cycle) for p in so.positions(s, 0, per_step, n)}
        assert seen == set(range(n))
    assert so.permutation(n, 0, 1) == so.permutation(n, 0, 1) != so.permutation(n, 0, 2) or n < 3


def test_verifiers_rotate_and_never_include_the_owner():
    for world in (2, 3, 4, 8):
        for step in range(10):
            for owner in range(world):
                vs = so.verifiers(owner, step, world, 2)
                assert owner not in vs and len(set(vs)) == len(vs) == min(2, world - 1)
    assert {tuple(so.verifiers(0, s, 4, 1)) for s in range(3)} == {(1,), (2,), (3,)}


def test_decide_attributes_by_self_check_and_majority():
    ok, bad = ["x", "y"], ["x", "z"]
    assert so.decide(0, ok, {0: ok, 1: ok}) == (policy.PASS, [])
    st, why = so.decide(1, bad, {1: ok, 0: ok})  # live differs from the owner's recomputation
    assert st == policy.FAIL and why[0]["code"] == "shard_update_mismatch" and why[0]["ranks"] == [1]
    assert why[0]["units"] == [1] and why[0]["recomputation_confirmed_by"] == [0]
    st, why = so.decide(0, bad, {0: bad, 1: ok})  # 2 ranks, persistent: detected, not attributed
    assert st == policy.INCONCLUSIVE and why[0]["ranks"] == [0, 1]
    st, why = so.decide(0, bad, {0: bad, 1: ok, 2: ok})  # peers outvote a persistently wrong owner
    assert st == policy.FAIL and [(r["code"], r["ranks"]) for r in why] == [("shard_update_mismatch", [0])]
    st, why = so.decide(0, ok, {0: ok, 1: ok, 2: bad})  # a peer computing differently is named
    assert st == policy.FAIL and [(r["code"], r["ranks"]) for r in why] == [("shard_recompute_mismatch", [2])]
    st, why = so.decide(0, ok, {0: ok, 1: None})  # a verifier that failed: fail closed
    assert st == policy.INCONCLUSIVE and why[0]["code"] == "shard_replay_failed"
    assert so.decide(0, None, {})[0] == policy.MISSING


def _row(step, status=policy.PASS, ranks=()):
    return {
        "step": step,
        "status": status,
        "ranks": list(ranks),
        "reasons": [{"code": "shard_update_mismatch", "ranks": list(ranks)}] if ranks else [],
    }


def test_evidence_needs_a_clean_cycle_and_charges_faults_to_earlier_saves_within_a_cycle():
    rows = [_row(s) for s in range(1, 9)]
    assert so.shard_replay_evidence(rows, 3, cycle=4)["status"] == policy.MISSING
    assert so.shard_replay_evidence(rows, 4, cycle=4)["status"] == policy.PASS
    rows.append(_row(9, policy.FAIL, [2]))
    assert so.shard_replay_evidence(rows, 5, cycle=4)["status"] == policy.PASS  # fault began after step 5
    ev = so.shard_replay_evidence(rows, 6, cycle=4)  # it may have begun at 6
    assert ev["status"] == policy.FAIL and ev["ranks"] == [2] and ev["reasons"][0]["code"] == "shard_update_mismatch"
    assert so.shard_replay_evidence(rows + [_row(s) for s in range(10, 20)], 16, cycle=4)["status"] == policy.FAIL


def test_the_first_saves_are_decided_on_the_steps_since_the_start_and_faults_revoke_a_cycle_back():
    rows = [_row(s) for s in range(11, 14)]  # resumed at 10, cycle 40
    assert so.shard_replay_evidence(rows, 13, cycle=40)["status"] == policy.MISSING  # no start: a full cycle
    ev = so.shard_replay_evidence(rows, 13, cycle=40, start=10)
    assert ev["status"] == policy.PASS and ev["steps"] == [11, 13] and ev["revocable_until"] == 52
    assert so.shard_replay_evidence(rows[1:], 13, cycle=40, start=10)["status"] == policy.MISSING  # a gap
    assert so.shard_replay_evidence(rows, 10, cycle=40, start=10)["status"] == policy.MISSING  # nothing since
    from scout_ckpt.replay.shard_plan import charged_steps

    assert charged_steps(_row(50, policy.FAIL, [1]), 40) == (10, 50)


class _Guard:
    def __init__(self):
        self.every, self.armed = 1, []

    def arm_next(self):
        self.armed.append(True)


def test_at_rest_signs_every_step_until_a_save_then_only_on_the_save_cadence():
    from scout_ckpt.replay.shard_plan import ShardReplayLog
    from scout_ckpt.save.evidence.shard import ShardEvidence

    ev = ShardEvidence(None, ShardReplayLog(4), _Guard())
    assert ev.guard.every == 1  # before any save: every step
    ev._saw_save(10)
    assert ev.guard.every is None and ev._cadence == 10
    for s, expect in ((18, False), (19, True), (29, True), (24, False)):
        ev.guard.armed = []
        ev._arm_for(s + 1)
        assert bool(ev.guard.armed) == expect, s
    ev._saw_save(25)  # off the cadence: the cadence shrinks to fit it
    assert ev._cadence == 5
    resumed = ShardEvidence(None, ShardReplayLog(4), _Guard())
    resumed._start = 8
    resumed._saw_save(12)  # resumed at 8, saves every 4
    assert resumed._cadence == 4
    off = ShardEvidence(None, ShardReplayLog(4), _Guard(), adaptive=False)
    off._saw_save(10)
    assert off.guard.every == 1 and off._cadence is None


def test_the_log_keeps_faults_and_only_the_clean_rows_a_save_can_still_need():
    from scout_ckpt.replay.shard_plan import ShardReplayLog

    log = ShardReplayLog(cycle=3)
    assert log.add([_row(s) for s in range(1, 20)]) == []
    assert min(r["step"] for r in log.rows) == 20 - 2 * 3 and log.evidence(19)["status"] == policy.PASS
    assert log.add([_row(20, policy.FAIL, [1])])[0]["ranks"] == [1]
    log.add([_row(s) for s in range(21, 40)])
    assert [r["step"] for r in log.rows if r["status"] == policy.FAIL] == [20]
    assert log.evidence(39)["status"] == policy.FAIL
    log.reset()
    assert log.evidence(39)["status"] == policy.MISSING


def test_unknown_and_fused_optimizers_are_refused_with_the_reason():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(so.UnsupportedOptimizer, match="RMSprop"):
        so.check_supported(torch.optim.RMSprop(p))

    class MyAdam(torch.optim.Adam):
        pass

    with pytest.raises(so.UnsupportedOptimizer, match="exact classes"):
        so.check_supported(MyAdam(p))
    fused = torch.optim.AdamW(p)
    fused.param_groups[0]["fused"] = True  # (constructing a fused optimizer is slow here; the flag is what counts)
    with pytest.raises(so.UnsupportedOptimizer, match="fused"):
        so.check_supported(fused)
    for opt in (torch.optim.AdamW(p), torch.optim.Adam(p, foreach=True), torch.optim.SGD(p, lr=0.1, momentum=0.9)):
        so.check_supported(opt)


@pytest.mark.parametrize(
    "cls,kw",
    [
        (torch.optim.AdamW, {"weight_decay": 0.1}),
        (torch.optim.AdamW, {"foreach": True}),
        (torch.optim.Adam, {"amsgrad": True}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ],
)
def test_recompute_of_any_slice_matches_the_live_update_bitwise(cls, kw):
    """The oracle behind zero false positives: live (single-tensor or foreach) vs slice recomputation."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(10_007, generator=g))
    opt = cls([p], **({"lr": 1e-3} | kw))
    for _ in range(3):
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
        pre_p, pre_g = p.detach().clone(), p.grad.clone()
        pre_st = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state.get(p, {}).items()}
        opt.step()
        hyper = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        for o, n in ((0, 4096), (4096, 4096), (8192, 1815), (13, 77), (5000, 1)):
            st = {
                k: v[o : o + n] if isinstance(v, torch.Tensor) and v.shape == p.shape else v for k, v in pre_st.items()
            }
            out = so.recompute(cls, hyper, pre_p[o : o + n], pre_g[o : o + n], st)
            live = [p.detach()[o : o + n]] + [
                opt.state[p][k][o : o + n] if opt.state[p][k].shape == p.shape else opt.state[p][k]
                for k in sorted(opt.state[p])
                if isinstance(opt.state[p][k], torch.Tensor)
            ]
            assert so.digest(out) == so.digest(live)


def test_at_rest_guard_in_one_process_passes_flags_a_flipped_bit_and_needs_a_signed_step():
    from scout_ckpt.save.evidence.at_rest import AtRestGuard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step():
        model(torch.randn(4, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    guard = AtRestGuard(opt, model)
    step()
    assert guard.check(1)["status"] == policy.PASS
    with torch.no_grad():
        model[1].weight.view(-1).view(torch.int32)[5] ^= 1  # lowest mantissa bit
    ev = guard.check(1)
    assert ev["status"] == policy.FAIL and ev["reasons"][0]["tensors"] == ["1.weight"]
    guard.resign()  # adopt a legitimate write
    assert guard.check(1)["status"] == policy.PASS
    guard.close()
    sparse = AtRestGuard(opt, model, every=2)
    step()
    assert sparse.check(2)["status"] == policy.MISSING  # the step before the save was not signed
    sparse.arm_next()
    step()
    assert sparse.check(3)["status"] == policy.PASS
    with torch.no_grad():
        opt.state[model[0].weight]["exp_avg"].view(-1).view(torch.int32)[3] ^= 2  # optimizer state is covered too
    assert sparse.check(3)["reasons"][0]["tensors"] == ["0.weight:exp_avg"]


# ---- real ranks ------------------------------------------------------------------------------------------------


def _fault_plan(world):
    """(rank whose update goes wrong, rank whose shard gets a bit flipped, first faulty step)."""
    return world - 1, 0 if world == 2 else 2, 2


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def runs(request):
    """One start-up per world size: a healthy run (with the evidence on, and again with it off) and a faulty run."""
    world = request.param
    bad, flipper, since = _fault_plan(world)
    scenarios = {
        "healthy": {"steps": HEALTHY_STEPS, "opt": "adamw" if world == 4 else "sgd", "compare_off": True},
        "faulty": {
            "steps": FAULTY_STEPS,
            "opt": "adam" if world == 2 else "adamw",
            "update_fault": (bad, since, FAULT_PARAM, FAULT_INDEX),
            "flip": (flipper, 6, FLIP_PARAM, FLIP_INDEX),
        },
    }
    out = run_ranks(w.w_scenarios, world, scenarios, timeout=600, pg_timeout_s=300)
    return world, [o.result for o in out]


@pytest.fixture
def healthy(runs):
    world, results = runs
    return world, [r["healthy"] for r in results]


@pytest.fixture
def faulty(runs):
    world, results = runs
    return (world, *_fault_plan(world), [r["faulty"] for r in results])


def test_healthy_fsdp_agrees_everywhere_and_trains_bitwise_as_without_evidence(healthy):
    world, results = healthy
    cycle = results[0]["cycle"]
    assert cycle <= HEALTHY_STEPS
    for res in results:
        assert res["rows"] == results[0]["rows"]  # same verdicts on every rank
        assert [r["status"] for r in res["rows"]] == [policy.PASS] * HEALTHY_STEPS
        assert all(sum(int(v) for v in r["units"].values()) == 16 * world for r in res["rows"])
        assert [a["status"] for a in res["at_rest"]] == [policy.PASS] * (HEALTHY_STEPS // 3)
        assert res["digests"] == res["digests_off"]  # evidence on == off, bit for bit
    assert so.shard_replay_evidence(results[0]["rows"], HEALTHY_STEPS, cycle)["status"] == policy.PASS


def test_a_wrong_update_on_one_rank_is_caught_and_attributed_within_one_cycle(faulty):
    world, bad, _, since, results = faulty
    rows, cycle = results[0]["rows"], results[0]["cycle"]
    failed = [r for r in rows if r["status"] != policy.PASS]
    assert failed and all(r["status"] == policy.FAIL and r["ranks"] == [bad] for r in failed)
    assert failed[0]["step"] < since + cycle
    why = failed[0]["reasons"][0]
    assert why["code"] == "shard_update_mismatch" and why["where"] == [f"{FAULT_PARAM}[{FAULT_INDEX}]:param"]
    assert len(why["recomputation_confirmed_by"]) == min(2, world - 1)
    assert len(rows) == FAULTY_STEPS and all(r["status"] == policy.PASS for r in rows if r["step"] < since)
    ev = so.shard_replay_evidence(rows, FAULTY_STEPS, cycle)
    assert ev["status"] == policy.FAIL and ev["ranks"] == [bad]


def test_a_flipped_low_mantissa_bit_between_step_and_save_is_caught_at_rest(faulty):
    _, _, flipper, _, results = faulty
    for res in results:
        at_rest = res["at_rest"]  # save points 3, 6, 9
        assert [a["status"] for a in at_rest] == [policy.PASS, policy.FAIL, policy.PASS]
        assert at_rest[1]["ranks"] == [flipper]
        assert at_rest[1]["reasons"] == [
            {"code": "at_rest_changed", "ranks": [flipper], "step": 6, "tensors": [FLIP_PARAM], "n_tensors": 1}
        ]


@pytest.mark.scenario  # two Checkpointer runs on 2 ranks: ~20 s of CPU (the component-level check above is cheap)
def test_training_through_the_checkpointer_is_bitwise_identical_with_shard_evidence_on_and_off(tmp_path):
    out = run_ranks(w.w_checkpointer_on_off, 2, str(tmp_path), timeout=600, pg_timeout_s=300)
    for o in out:
        res = o.result
        assert res["on"]["shard"] and not res["off"]["shard"]
        assert res["on"]["digests"] == res["off"]["digests"]  # every shard, parameters and moments
        assert res["on"]["verdicts"] == ["certified", "certified"]  # the first save certified at its commit
