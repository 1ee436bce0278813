"""The demo's pieces in one process: the model learns, faults corrupt it as specified, specs parse strictly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from scout_ckpt.demo import faults
from scout_ckpt.demo.data import DataStream, MarkovDomains, OnlineMixer
from scout_ckpt.demo.model import TinyTransformer, retract_to_sphere, set_sdc, sphere_deviation
from scout_ckpt.demo.train import RNGState, state_digest, warmup_cosine
from scout_ckpt.errors import BadInput


@pytest.fixture(autouse=True)
def _no_sdc():
    torch.set_num_threads(1)
    set_sdc(None)
    yield
    set_sdc(None)


def _train(steps: int, mixer: OnlineMixer | None = None, sphere: bool = False):
    torch.manual_seed(0)
    model = TinyTransformer()
    data = DataStream(MarkovDomains(n_domains=mixer.n_domains if mixer else 1), 32, 16, 0, 1, mixer=mixer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps))
    losses, weights = [], []
    for _ in range(steps):
        x, y, dom = data.next_batch()
        per_sample = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1), reduction="none").view(y.shape).mean(1)
        per_sample.mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if sphere:
            retract_to_sphere(model)
        if mixer is not None:
            mixer.update(mixer.domain_stats(per_sample, dom))
            mixer.check()
            weights.append(mixer.weights.clone())
        losses.append(float(per_sample.detach().mean()))
    return model, losses, weights


def test_loss_falls():
    _, losses, _ = _train(30)
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


def test_mixing_weights_stay_on_simplex_and_move_to_hard_domains():
    mixer = OnlineMixer(4)
    _, _, weights = _train(12, mixer=mixer)
    for w in weights:
        assert bool((w > 0).all()) and abs(float(w.sum()) - 1.0) < 1e-12
    # domain d has 2**(d+1) successors per token: the hardest (last) one gains weight
    assert float(weights[-1][-1]) > 0.25 > float(weights[-1][0])
    restored = OnlineMixer(4)
    restored.load_state_dict(mixer.state_dict())
    assert torch.equal(restored.weights, mixer.weights) and restored.updates == 12


def test_mixer_update_is_a_pure_function_of_the_losses():
    a, b = OnlineMixer(3), OnlineMixer(3)
    stats = torch.tensor([[3.0, 6.0, 0.0], [1.0, 2.0, 0.0]], dtype=torch.float64)  # domain 2 unseen
    a.update(stats)
    b.update(stats.clone())
    assert torch.equal(a.weights, b.weights)
    a.check()
    with pytest.raises(AssertionError):
        a.weights = torch.tensor([0.5, 0.6, -0.1], dtype=torch.float64)
        a.check()


def test_sphere_constraint_holds_radius():
    model, losses, _ = _train(5, sphere=True)
    assert sphere_deviation(model) < 1e-5
    assert losses[-1] < losses[0]


def test_data_stream_is_a_function_of_position_and_shards_the_global_batch():
    dom = MarkovDomains(n_domains=1)
    whole = DataStream(dom, 8, 4, 0, 1)
    whole.position = 3
    x_all, _, _ = whole.next_batch()
    parts = []
    for rank in range(2):
        s = DataStream(dom, 8, 4, rank, 2)
        s.load_state_dict({"position": torch.tensor(3), "seed": torch.tensor(0)})
        parts.append(s.next_batch()[0])
    assert torch.equal(torch.cat(parts), x_all)


def test_sdc_is_persistent_and_survives_deepcopy():
    torch.manual_seed(0)
    model = TinyTransformer()
    x = torch.randint(0, 256, (2, 8))
    clean = model(x)
    layer = model.blocks[1].mlp.fc1
    h = torch.randn(2, 8, 64)
    ref = layer(h)
    set_sdc("blocks.1.mlp.fc1")
    bad = layer(h)
    diff = (bad != ref).nonzero()
    assert diff.tolist() == [[0, 0, 0]]
    b0, r0 = float(bad[0, 0, 0].detach()), float(ref[0, 0, 0].detach())
    assert b0 in (2 * r0, 0.5 * r0)
    assert torch.equal(copy.deepcopy(layer)(h), bad)  # a replay runner's copy fails the same way
    assert not torch.equal(model(x), clean)
    other = model.blocks[0].mlp.fc1
    assert torch.equal(other(h), F.linear(h, other.weight))  # only the target layer fails
    bad.sum().backward()  # autograd still flows through the corrupted op


def test_sdc_elem_picks_the_element_and_qkv_element_0_leaves_the_forward_unchanged():
    """`elem` (negative from the end) is the one element that is wrong. Element 0 of an attention's qkv output is
    the query of position 0, which causal attention gives its only key whatever its value: the model's output does
    not change, which is why the campaign draws elements of the last position instead."""
    torch.manual_seed(0)
    model = TinyTransformer()
    x = torch.randint(0, 256, (2, 8))
    h = torch.randn(2, 8, 64)
    layer = model.blocks[1].attn.qkv
    ref = layer(h)
    set_sdc("blocks.1.attn.qkv", -3)
    bad = layer(h)
    assert (bad != ref).nonzero().tolist() == [[1, 7, 3 * 64 - 3]]
    with torch.no_grad():
        corrupted_last = model(x)
        set_sdc("blocks.1.attn.qkv", 0)
        corrupted_first = model(x)
        set_sdc(None)
        clean = model(x)
    assert not torch.equal(corrupted_last, clean)
    assert torch.equal(corrupted_first, clean)


def test_param_flip_changes_one_element():
    torch.manual_seed(0)
    model = TinyTransformer()
    before = copy.deepcopy(model.state_dict())
    name = faults.flip_param_bit(model, None, 30)
    after = model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == [name]
    assert (before[name] != after[name]).sum() == 1


def test_rng_state_round_trip():
    import random

    import numpy as np

    rng = RNGState()
    random.gauss(0, 1)  # leaves a cached gauss value
    sd = {k: v.clone() for k, v in rng.state_dict().items()}
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)), random.gauss(0, 1))
    rng.load_state_dict(sd)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1)), random.gauss(0, 1)) == expect


def test_state_digest_single_process_is_stable(tmp_path):
    import datetime

    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        torch.manual_seed(0)
        model = TinyTransformer()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randint(0, 256, (1, 4))).sum().backward()
        opt.step()
        d1 = state_digest(model, opt)
        assert d1 == state_digest(model, opt) and d1.startswith("xxh3_128:")
        faults.flip_param_bit(model, None, 3)
        assert state_digest(model, opt) != d1
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "spec,kind,rank,step,opts",
    [
        ("crash:rank=1:step=20", "crash", 1, 20, {"at": "during_write"}),
        ("crash:rank=0:step=10:at=before_rename", "crash", 0, 10, {"at": "before_rename"}),
        ("bitflip:step=10", "bitflip", None, 10, {"file": None, "bit": None}),
        ("sdc:rank=2:step=5", "sdc", 2, 5, {"layer": "blocks.1.mlp.fc1", "elem": 0}),
        ("sdc:rank=1:step=5:layer=blocks.1.attn.qkv:elem=-7", "sdc", 1, 5, {"layer": "blocks.1.attn.qkv", "elem": -7}),
        ("hang:rank=3:step=7", "hang", 3, 7, {}),
        ("slow:rank=1:factor=2.5", "slow", 1, None, {"factor": 2.5}),
        ("param:rank=0:step=4", "param", 0, 4, {"name": None, "bit": 30}),
    ],
)
def test_parse_valid(spec, kind, rank, step, opts):
    f = faults.parse(spec)
    assert (f.kind, f.rank, f.step, f.opts) == (kind, rank, step, opts)
    assert faults.parse(f.spec) == f


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "explode:rank=1",
        "crash:rank=1",
        "crash:step=3",
        "crash:rank=x:step=3",
        "crash:rank=1:step=0",
        "crash:rank=1:step=3:rank=2",
        "crash:rank=1:step=3:color=red",
        "crash:rank=1:step=3:at=never",
        "bitflip",
        "bitflip:step",
        "bitflip:step=",
        "slow:rank=1:factor=0.5",
        "slow:rank=1:factor=fast",
        "param:rank=0:step=2:bit=40",
        "hang:rank=-1:step=2",
        "sdc:rank=0:step=2:elem=last",
    ],
)
def test_parse_invalid_is_one_line_bad_input(spec):
    with pytest.raises(BadInput) as e:
        faults.parse(spec)
    assert "\n" not in str(e.value) and "--inject" in str(e.value)


def test_parse_all_checks_job_size():
    assert len(faults.parse_all(["crash:rank=1:step=2", "bitflip:step=2"], ranks=2, steps=4)) == 2
    with pytest.raises(BadInput, match="rank 2 does not exist"):
        faults.parse_all(["crash:rank=2:step=2"], ranks=2, steps=4)
    with pytest.raises(BadInput, match="beyond --steps"):
        faults.parse_all(["sdc:rank=0:step=9"], ranks=2, steps=4)
