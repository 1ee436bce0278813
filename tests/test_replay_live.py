"""Replay checks the live step (issue 26): a fault that struck only one rank's live step -- the step a checkpoint
carries -- is caught at that save, on whichever rank it struck, not certified because every hook-free replay of the
captured inputs agrees.

User-shaped scripts (tests/scripts/live_fault_job.py: a plain DDP MLP, the same MLP under FSDP2 with frozen
parameters beside trainable ones, and a tiny GPT-2 from GPT2Config prepared by accelerate), dropout on,
`replay=True` and nothing else, under real torchrun. The fault is injected by the test at a rank and step the
session's seed places (tests/placement.py), so the expected rank and step come from the test, never from
scout-ckpt:

* intermittent (one step's live forward only: no replay repeats it) on a rank that is NOT that save's sweep source
  (the source rotates over the peers: with 2 ranks saves 4, 8, 12 take ranks 0, 1, 0): every rank's self-check
  (its own capture replayed against its own live step) finds it -> replay_sdc naming that rank, with 2 ranks too
  (the rank disagrees with itself: replay.live's rule), the save rejected, LiveStateCorrupt on every rank, and
  `load_latest_clean` loads the newest save before it: the state whose digest the job printed at that save;
* in the live backward only (a full backward hook adding 1e-3 to the gradient a block passes to its input, or a
  hook on a block's weight adding 1e-3 to its gradient, at one saved step, on one rank): the same, from the
  live gradients' signatures;
* persistent (every call from a step on, replays included) inside a target: caught at the first save, attributed;
* healthy controls with a user's forward hook that is part of the model's math (on every rank), FSDP2, and
  GPT-2 under accelerate's bf16 autocast: every save certified, every rank's live step checked at every save.

Not covered, by design (docs/replay.md): an intermittent fault at a step that is not saved (only the rotation's
sampled target and source see it), a fault in a module outside every target (GPT-2's ln_f), FSDP2's parameter
gradients (sharded: only its input gradients are signed).

Single-process tests pin what the live check stands on: the live signature is taken from exactly the tensor the
caller received (after the user's hooks before the capture's, before any later in-place write), the live gradients
are this module's share (an input also used outside it), reading them changes no gradient, and the replay of the
same invocation reproduces all of them bit for bit with dropout, a user's math hook and autocast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from scout_ckpt.ledger import Ledger
from tests.conftest import REPO
from tests.placement import place

JOB = REPO / "tests" / "scripts" / "live_fault_job.py"
SAVES = (4, 8, 12)  # --steps 12 --save-every 4


def source(save: int, world: int) -> int:
    """The rank whose live step the sweep at `save` cross-checks: peer k mod N at the k-th save of a generation
    (docs/replay.md)."""
    return SAVES.index(save) % world


def non_source_fault(request, world: int, saves=SAVES):
    """An intermittent fault of one rank's live step at a save whose source is ANOTHER rank (what only the
    self-check sees at that save), placed by the seed."""
    return place(request, ranks=range(world), steps=saves, where=lambda r, s: source(s, world) != r)


def first_save_from(step: int) -> int:
    return min(s for s in SAVES if s >= step)


def torchrun(n: int, root, *args) -> list[dict]:
    """The job on `n` ranks under torchrun; its records, one per rank (files: lines of several ranks on one pipe
    can interleave), by rank."""
    out = Path(f"{root}.records")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(n),
        str(JOB),
        str(root),
        "--out",
        str(out),
        *map(str, args),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    return sorted(recs, key=lambda r: r["rank"])


def ledger_view(root) -> dict:
    """Per saved step: its state, its reasons and its replay evidence, from the ledger."""
    with Ledger.open(root, readonly=True) as led:
        return {
            r["step"]: {
                "state": r["state"],
                "replay": led.evidence(r["step"]).get("replay") or {},
                "reasons": (r.get("reasons") or []),
            }
            for r in led.checkpoints()
        }


def _replay_reasons(view: dict, step: int) -> list[dict]:
    return [r for r in view[step]["replay"].get("reasons") or [] if r["code"].startswith("replay_")]


def _assert_caught(recs, view, step, target, *, ranks, code, live_step, pl):
    for r in recs:  # the save's verdict ended the generation on every rank, at that save
        assert r["live_state_corrupt"] == step, (pl, r)
        assert all(v["state"] == "certified" for s, v in r["verdicts"].items() if int(s) < step), (pl, r["verdicts"])
    assert view[step]["state"] == "rejected", (pl, view[step])
    reasons = _replay_reasons(view, step)
    assert any(
        x["code"] == code and x["target"] == target and x["ranks"] == ranks and bool(x.get("live_step")) == live_step
        for x in reasons
    ), (pl, reasons)
    assert max(view) == step, (pl, view)  # nothing saved after it
    _assert_resumed_before(recs, step, pl)


def _assert_resumed_before(recs, step, pl):
    """load_latest_clean, after the rejection, loaded the newest save before `step`: on every rank the state whose
    digest the job itself printed when it saved that step (nothing at all when the fault struck the first save)."""
    before = [s for s in SAVES if s < step]
    for r in recs:
        if not before:
            assert r["resumed_step"] is None, (pl, r["resumed_step"])
            continue
        assert r["resumed_step"] == before[-1], (pl, r["resumed_step"])
        assert r["resumed_digest"] == r["digests"][str(before[-1])], (pl, r["rank"])


def _assert_every_rank_checked(view, steps, world, pl=None):
    for s in steps:
        assert view[s]["replay"]["live_checked_ranks"] == list(range(world)), (pl, s, view[s]["replay"])
        assert "at every save" in view[s]["replay"]["live_rotation"], (pl, s, view[s]["replay"])


# ---- default tier: 2 ranks, a plain DDP MLP --------------------------------------------------------------------


def test_a_fault_of_a_non_source_ranks_live_step_is_attributed_at_that_save_with_2_ranks(tmp_path, request):
    """One rank's live forward of one saved step only (8 or 12, a save whose sweep source is the OTHER rank:
    placed by the seed) is off in one channel of blocks.1's output; every rank carries a user's math hook
    (blocks.0 scaled by 0.5) and dropout. The saves before it are certified with both ranks' live steps checked
    (the hook and dropout replayed bit for bit); that save is rejected at once: replay_sdc naming the faulty rank
    (it disagrees with its own replay), LiveStateCorrupt on both ranks, and load_latest_clean loads the save
    before, the digest the job printed then."""
    pl = non_source_fault(request, 2, saves=(8, 12))
    root = tmp_path / "run"
    recs = torchrun(
        2,
        root,
        "--model",
        "mlp",
        "--steps",
        12,
        "--save-every",
        4,
        "--math-hook",
        "--fault-rank",
        pl.rank,
        "--fault-step",
        pl.step,
        "--fault-module",
        "blocks.1",
    )
    view = ledger_view(root)
    assert all(view[s]["state"] == "certified" for s in SAVES if s < pl.step), (pl, view)
    _assert_every_rank_checked(view, [s for s in SAVES if s <= pl.step], 2, pl)
    _assert_caught(recs, view, pl.step, "blocks.1", ranks=[pl.rank], code="replay_sdc", live_step=True, pl=pl)


# ---- scenarios: FSDP2, backward faults, 3 ranks, GPT-2 prepared by accelerate; persistent faults; controls ----

LIVE_CASES = [  # (model, ranks, fault kind, the module it strikes, the target the evidence names)
    ("mlp", 3, "forward", "blocks.1", "blocks.1"),
    ("fsdp", 2, "forward", "blocks.2", "blocks.2"),
    ("fsdp", 3, "forward", "blocks.1", "blocks.1"),
    ("mlp", 2, "grad-param", "blocks.1.fc", "blocks.1"),
    ("mlp", 3, "grad-input", "blocks.2", "blocks.2"),
    ("fsdp", 2, "grad-input", "blocks.1", "blocks.1"),
]


@pytest.mark.scenario
@pytest.mark.parametrize(
    "model,world,kind,module,target", LIVE_CASES, ids=[f"{m}-{w}ranks-{k}" for m, w, k, _, _ in LIVE_CASES]
)
def test_a_live_step_fault_on_a_non_source_rank_is_attributed_at_that_save(
    tmp_path, request, model, world, kind, module, target
):
    """DDP MLP and FSDP2 (frozen parameters beside trainable ones), 2 and 3 ranks: one rank's live forward
    (`forward`) or live backward only (`grad-input`: a full backward hook on the block alters the gradient it
    passes to its input; `grad-param`: a hook on a block's weight alters its gradient before DDP averages it) at
    one saved step whose source is another rank (placed by the seed). That save is rejected: replay_sdc naming the
    rank, the live step named, the saves before certified with every rank checked, load_latest_clean at the save
    before (its printed digest)."""
    pl = non_source_fault(request, world)
    root = tmp_path / "run"
    recs = torchrun(
        world,
        root,
        "--model",
        model,
        "--steps",
        12,
        "--save-every",
        4,
        "--fault-kind",
        kind,
        "--fault-rank",
        pl.rank,
        "--fault-step",
        pl.step,
        "--fault-module",
        module,
    )
    view = ledger_view(root)
    _assert_every_rank_checked(view, [s for s in SAVES if s <= pl.step], world, pl)
    _assert_caught(recs, view, pl.step, target, ranks=[pl.rank], code="replay_sdc", live_step=True, pl=pl)


@pytest.mark.scenario
@pytest.mark.scenario_ci
def test_a_fault_of_one_ranks_live_step_is_attributed_with_3_ranks_gpt2_accelerate(tmp_path, request):
    """The issue's shape: a tiny GPT-2 prepared by accelerate, one rank's live forward of one saved step off in
    one channel of transformer.h.1's output (any rank at any save: placed by the seed). 3 ranks: that save is
    rejected, replay_sdc naming the rank, the live step named; the saves before it certified; the resume loads
    the save before."""
    pl = place(request, ranks=range(3), steps=SAVES)
    root = tmp_path / "run"
    recs = torchrun(
        3,
        root,
        "--model",
        "gpt2",
        "--steps",
        12,
        "--save-every",
        4,
        "--fault-rank",
        pl.rank,
        "--fault-step",
        pl.step,
        "--fault-module",
        "transformer.h.1",
    )
    assert "optimizer" in recs[0]["targets"] and "transformer.h.1" in recs[0]["targets"], pl
    view = ledger_view(root)
    assert all(view[s]["state"] == "certified" for s in SAVES if s < pl.step), (pl, view)
    _assert_caught(recs, view, pl.step, "transformer.h.1", ranks=[pl.rank], code="replay_sdc", live_step=True, pl=pl)


@pytest.mark.scenario
def test_gpt2_accelerate_live_fault_with_2_ranks_is_attributed_and_a_healthy_run_stays_certified(tmp_path, request):
    """2 ranks, GPT-2 + accelerate with gradient checkpointing (the block's forward runs again in the backward,
    cleanly): one rank's live step at a save (either rank, either role: placed by the seed) faulty -> that rank
    named (it disagrees with its own replay), generation ended.
    The same job without the fault, dropout on and accelerate's bf16 autocast (the live forward's autocast is
    replayed): every save certified, both ranks' live steps checked at every save."""
    pl = place(request, ranks=range(2), steps=SAVES)
    recs = torchrun(
        2,
        tmp_path / "fault",
        "--model",
        "gpt2",
        "--steps",
        12,
        "--save-every",
        4,
        "--grad-ckpt",
        "--fault-rank",
        pl.rank,
        "--fault-step",
        pl.step,
        "--fault-module",
        "transformer.h.1",
    )
    view = ledger_view(tmp_path / "fault")
    _assert_caught(recs, view, pl.step, "transformer.h.1", ranks=[pl.rank], code="replay_sdc", live_step=True, pl=pl)

    recs = torchrun(
        2, tmp_path / "healthy", "--model", "gpt2", "--steps", 12, "--save-every", 4, "--mixed-precision", "bf16"
    )
    view = ledger_view(tmp_path / "healthy")
    assert {s: v["state"] for s, v in view.items()} == {4: "certified", 8: "certified", 12: "certified"}
    _assert_every_rank_checked(view, SAVES, 2)
    assert all(r["live_state_corrupt"] is None for r in recs)
    assert len({r["digests"]["12"] for r in recs}) == 1


@pytest.mark.scenario
def test_a_persistent_fault_inside_a_target_is_attributed_at_the_first_save_whatever_the_source(tmp_path, request):
    """3 ranks, DDP MLP: one rank's blocks.2 activation (inside the target, not its output) off from a step on
    (rank and step 2-8 placed by the seed), at every call. At the first save from that step, whichever rank is
    its source, the faulty rank's replays repeat the fault and disagree with the others -> replay_sdc naming it
    (its live step agrees with its own replay: the replays' comparison names it), generation ended there."""
    pl = place(request, ranks=range(3), steps=range(2, 9))
    caught = first_save_from(pl.step)
    root = tmp_path / "run"
    recs = torchrun(
        3,
        root,
        "--model",
        "mlp",
        "--steps",
        12,
        "--save-every",
        4,
        "--persistent",
        "--fault-rank",
        pl.rank,
        "--fault-step",
        pl.step,
        "--fault-module",
        "blocks.2.act",
    )
    view = ledger_view(root)
    _assert_every_rank_checked(view, [caught], 3, pl)
    _assert_caught(recs, view, caught, "blocks.2", ranks=[pl.rank], code="replay_sdc", live_step=False, pl=pl)


@pytest.mark.scenario
@pytest.mark.parametrize("model,world", [("mlp", 3), ("fsdp", 2)])
def test_a_healthy_run_with_a_math_hook_and_dropout_stays_certified(tmp_path, model, world):
    """A user's forward hook that is part of the model's math (blocks.0's output halved, on every rank), dropout
    on, DDP on 3 ranks and FSDP2 (frozen and trainable parameters) on 2: every save certified, every rank's live
    step (outputs and gradients) checked at every save; FSDP2's parameter gradients named as not signed."""
    root = tmp_path / "run"
    recs = torchrun(world, root, "--model", model, "--steps", 12, "--save-every", 4, "--math-hook")
    view = ledger_view(root)
    assert {s: v["state"] for s, v in view.items()} == {4: "certified", 8: "certified", 12: "certified"}
    _assert_every_rank_checked(view, SAVES, world)
    assert all(r["live_state_corrupt"] is None for r in recs)
    grads = view[12]["replay"].get("live_grads_not_signed") or {}
    assert bool(grads) == (model == "fsdp") and all("sharded" in " ".join(v) for v in grads.values()), grads


# ---- one process: the live signature and its replay, bit for bit ----------------------------------------------


@pytest.fixture
def one_thread():
    """In-process compute on one thread (as tests/test_replay.py: an OpenMP pool in this process could hang ranks
    forked from it later)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class _Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(x))))


def _capture_and_replay(autocast: bool = False, fault_once: bool = False):
    """Three blocks, the middle one captured with live=True; the user's math hooks on and in it, a later block
    that writes the target's output in place, dropout on. Returns (live signature, the replay's, target, cap)."""
    from scout_ckpt.consensus.signatures import replica_signatures
    from scout_ckpt.replay.capture import ModuleCapture
    from scout_ckpt.replay.execute import replay_module

    torch.manual_seed(0)
    blocks = nn.Sequential(_Block(), _Block(), _Block())
    target = blocks[1]
    target.register_forward_hook(lambda m, a, out: out * 0.5)  # the user's math: before the capture's hook
    target.fc1.register_forward_hook(lambda m, a, out: out + 0.25)  # inside the target: replayed too
    calls = []

    def once(m, a, out):  # a fault of the live forward only: the replay's call is the second
        calls.append(1)
        return out + 1e-3 if fault_once and len(calls) == 1 else None

    target.fc2.register_forward_hook(once)
    cap = ModuleCapture(target, live=True, refs=True)
    cap.arm()
    late = []
    target.register_forward_hook(lambda m, a, out: late.append(1))  # after the capture's: not part of its output
    blocks[2].register_forward_pre_hook(lambda m, a: a[0].add_(1.0))  # a later in-place write of that output
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = blocks(x)
    y.float().square().mean().backward()
    cap.disarm()
    live = cap.invocation.live.clone()
    labels, tensors = replay_module(target, cap.invocation, hook_ids=cap.hook_ids)
    assert labels[0] == "output[0]" and late == [1] and len(calls) == 2  # the late hook did not run on the replay
    return live, replica_signatures(tensors[:1]), target, cap


@pytest.mark.parametrize("autocast", [False, True])
def test_the_live_signature_is_what_the_caller_received_and_the_replay_reproduces_it(one_thread, autocast):
    live, replayed, _, _ = _capture_and_replay(autocast)
    assert torch.equal(live, replayed)


def test_a_live_only_fault_differs_from_the_replay_and_plumbing_hooks_are_not_replayed(one_thread):
    from scout_ckpt.replay.execute import _plumbing, replay_module, replaying

    live, replayed, target, cap = _capture_and_replay(fault_once=True)
    assert not torch.equal(live, replayed)  # the live step's fault, which its replay does not repeat
    # a user's hook can tell a replay from the live step
    seen = []
    target.fc2.register_forward_hook(lambda m, a, out: seen.append(replaying()))
    replay_module(target, cap.invocation, hook_ids=cap.hook_ids)
    assert seen == [True] and not replaying()
    # frameworks' hooks are plumbing (never replayed); a user's lambda, function or bound method is not
    assert _plumbing(torch.nn.functional.relu) and _plumbing(cap._post)
    assert not _plumbing(lambda *a: None) and not _plumbing(_Block().forward)


def _grad_run(capture: bool, grad_fault: bool = False, input_fault: bool = False):
    """Three blocks, the middle one's input also used outside it (a skip around it); the middle block captured
    with live gradients signed when `capture`. `grad_fault`: a hook on its fc2 weight adds 1e-3 to the gradient
    (registered before the capture's, as a user's would be); `input_fault`: a full backward hook on the target
    adds 1e-3 to the gradient it passes to its input (its parameters' gradients untouched). Returns (every parameter's .grad, the capture)."""
    from scout_ckpt.replay.capture import ModuleCapture

    torch.manual_seed(0)
    blocks = nn.Sequential(_Block(), _Block(), _Block())
    target = blocks[1]
    target.register_forward_hook(lambda m, a, out: out * 0.5)  # the user's math
    if grad_fault:
        target.fc2.weight.register_hook(lambda g: g + 1e-3)
    if input_fault:
        target.register_full_backward_hook(lambda m, gi, go: (gi[0] + 1e-3,))
    cap = None
    if capture:
        names = frozenset(n for n, _ in target.named_parameters())
        cap = ModuleCapture(target, live=True, refs=True, grads=True, grad_params=names)
        cap.arm()
    x = torch.randn(4, 16, requires_grad=True)
    h = blocks[0](x)
    y = blocks[2](target(h) + 0.3 * h)  # h feeds the target AND the skip: its total gradient is not the target's
    y.square().mean().backward()
    if cap is not None:
        cap.disarm()
    return [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()], cap, target


def _transformers_or_skip():
    """transformers, an optional extra: skipped on a plain install, but under CI (where `make test` installs
    the extras) its absence fails, so a broken extra cannot hide behind a skip."""
    if os.environ.get("CI", "").lower() in ("true", "1"):  # as .ci/run sets it (and tests/test_report.py reads it)
        import transformers

        return transformers
    return pytest.importorskip("transformers")


def _target_share():
    """The middle block's own output and gradients, computed without the library: the same seeds and blocks as
    `_grad_run`, with the skip fed a detached copy of the block's input, so the input's gradient is the block's
    share alone. {"output[0]", "grad_input[0]", "grad_param:<name>"} -> tensor."""
    torch.manual_seed(0)
    blocks = nn.Sequential(_Block(), _Block(), _Block())
    target = blocks[1]
    target.register_forward_hook(lambda m, a, out: out * 0.5)  # the user's math, as in _grad_run
    x = torch.randn(4, 16, requires_grad=True)
    h = blocks[0](x)
    own = h.detach().requires_grad_()
    out = target(own)
    blocks[2](out + 0.3 * h).square().mean().backward()
    return {
        "output[0]": out.detach(),
        "grad_input[0]": own.grad,
        **{f"grad_param:{n}": p.grad for n, p in target.named_parameters()},
    }


def test_the_live_gradients_are_this_modules_share_and_the_replay_reproduces_them(one_thread):
    from scout_ckpt.consensus.signatures import replica_signatures
    from scout_ckpt.replay import live
    from scout_ckpt.replay.execute import replay_module

    plain, _, _ = _grad_run(capture=False)
    grads, cap, target = _grad_run(capture=True)
    # signing the live backward (an identity view handed to the forward, hooks that return None) changes no
    # gradient by a bit
    assert all(torch.equal(a, b) for a, b in zip(plain, grads, strict=True))
    inv = cap.invocation
    assert set(inv.live_grads) == {"grad_input[0]"} | {f"grad_param:{n}" for n, _ in target.named_parameters()}
    labels, tensors = replay_module(target, inv, hook_ids=cap.hook_ids)
    # the replay computes the block's output and its own share of every gradient, bit for bit (the input's total
    # gradient, target + skip, is not that share)
    share = _target_share()
    assert labels == list(share)
    for label, t in zip(labels, tensors, strict=True):
        assert torch.equal(t, share[label]), label
    assert live.self_check(labels, replica_signatures(tensors), inv) == live.SELF_AGREE

    for fault in ("grad_fault", "input_fault"):  # the live backward alone altered: a parameter's, the input's
        _, cap, target = _grad_run(capture=True, **{fault: True})
        labels, tensors = replay_module(target, cap.invocation, hook_ids=cap.hook_ids)
        for label, t in zip(labels, tensors, strict=True):  # the replay is the healthy computation still
            assert torch.equal(t, share[label]), (fault, label)
        assert live.self_check(labels, replica_signatures(tensors), cap.invocation) == live.SELF_GRAD, fault


def test_a_live_output_fault_fails_the_self_check_and_a_module_run_twice_signs_no_parameter_gradient(one_thread):
    from scout_ckpt.consensus.signatures import replica_signatures
    from scout_ckpt.replay import live
    from scout_ckpt.replay.capture import ModuleCapture
    from scout_ckpt.replay.execute import replay_module

    _, _, target, cap = _capture_and_replay(fault_once=True)
    labels, tensors = replay_module(target, cap.invocation, hook_ids=cap.hook_ids)
    assert live.self_check(labels, replica_signatures(tensors), cap.invocation) == live.SELF_OUTPUT
    assert live.self_check(labels, replica_signatures(tensors), None) == live.SELF_UNCHECKED

    torch.manual_seed(0)
    block = _Block()
    cap = ModuleCapture(
        block, live=True, refs=True, grads=True, grad_params=frozenset(n for n, _ in block.named_parameters())
    )
    cap.arm()
    x = torch.randn(4, 16, requires_grad=True)
    block(block(x)).sum().backward()  # reused before its backward: the hooks would see both calls' sum
    cap.disarm()
    assert cap.invocation.grad_note and not any(k.startswith("grad_param:") for k in cap.invocation.live_grads)


def test_the_self_check_is_on_by_default_and_a_bad_value_names_the_field():
    from scout_ckpt import options
    from scout_ckpt.errors import BadOption

    assert options.ReplayOptions().self_check is True and options.ReplayOptions().runner_kwargs()["self_check"]
    assert options.ReplayOptions.from_dict({"self_check": False}).self_check is False
    with pytest.raises(BadOption, match="replay.self_check"):
        options.ReplayOptions.from_dict({"self_check": "yes"})


def test_a_gpt2_block_handed_a_kv_cache_reproduces_its_live_step(one_thread):
    """transformers' GPT-2 hands each block the forward's DynamicCache, which the block appends its keys and values
    to: by the time of a replay it holds the live call's. The capture takes a cache with no entry yet for the
    block's layer as None, so the replay computes what the live call did: outputs and every gradient bit-equal
    (handed the live cache, the replay attended over the live keys and its own, and the keys' and values'
    gradients differed on every healthy step)."""
    transformers = _transformers_or_skip()
    from scout_ckpt.consensus.signatures import replica_signatures
    from scout_ckpt.replay import live
    from scout_ckpt.replay.capture import ModuleCapture
    from scout_ckpt.replay.execute import replay_module

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    )
    block = model.transformer.h[1]
    seen = {}  # the live call's input and output, kept by the test's own hooks (registered before the capture's)

    def keep(key: str, retain: bool):
        def hook(m, args, out) -> None:
            t = out[0] if isinstance(out, tuple) else out
            if retain:
                t.retain_grad()
            seen[key] = t if retain else t.detach().clone()

        return hook

    model.transformer.h[0].register_forward_hook(keep("input", retain=True))  # the block's input, nobody else's
    block.register_forward_hook(keep("output", retain=False))
    cap = ModuleCapture(
        block, live=True, refs=True, grads=True, grad_params=frozenset(n for n, _ in block.named_parameters())
    )
    cap.arm()
    ids = torch.randint(0, 128, (4, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    cap.disarm()
    assert any(k.startswith("grad_param:attn.c_attn") for k in cap.invocation.live_grads)
    labels, tensors = replay_module(block, cap.invocation, hook_ids=cap.hook_ids)
    # the live values, read from the model after its backward (the block runs once per step, and its input feeds
    # only it): the replay reproduces each bit for bit
    expected = {
        "output[0]": seen["output"],
        "grad_input[0]": seen["input"].grad,
        **{f"grad_param:{n}": p.grad for n, p in block.named_parameters()},
    }
    assert set(labels) <= set(expected), labels
    for label, t in zip(labels, tensors, strict=True):
        assert torch.equal(t, expected[label]), label
    assert live.self_check(labels, replica_signatures(tensors), cap.invocation) == live.SELF_AGREE
