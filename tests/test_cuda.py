"""The suite's CUDA tests: scout-ckpt's device paths on a real GPU.

Every test here is marked `cuda`: skipped where torch sees no CUDA device (the reason says so), a failure under
SCOUT_REQUIRE_GPU=1 (tests/conftest.py), which `make gpu-check` sets. Their oracles are the host's computation of
the same signature, the live step's own signatures, NVML's own readings and the state the test wrote.
"""

from __future__ import annotations

import datetime
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from tests.conftest import REPO  # noqa: E402

pytestmark = pytest.mark.cuda


def _block(d: int = 128) -> nn.Module:
    from scout_ckpt.demo.model import Block

    torch.manual_seed(0)
    return Block(d, 4).cuda()


def test_a_device_tensors_signature_is_computed_on_the_device_and_equals_the_hosts():
    from scout_ckpt.consensus.signatures import batch_signatures, replica_signatures

    t = torch.randn(3_000_001, generator=torch.Generator().manual_seed(1))
    on_device = replica_signatures([t.cuda()])
    assert torch.equal(on_device, batch_signatures([t]))  # the additive signature, computed on the device
    assert not torch.equal(on_device, replica_signatures([t]))  # not the host's xxh3: the device path ran


def test_a_flipped_bit_on_the_device_changes_the_signature():
    from scout_ckpt.consensus.signatures import replica_signatures

    t = torch.randn(1 << 20, device="cuda")
    before = replica_signatures([t])
    t.view(torch.int32)[12345] ^= 1
    assert not torch.equal(before, replica_signatures([t]))


def test_a_transformer_block_on_the_device_replays_its_live_step_100_times_bit_for_bit():
    from scout_ckpt.replay.repeat import repeat_check

    x = torch.randn(8, 64, 128, device="cuda", requires_grad=True)
    res = repeat_check(_block(), (x,), 100)
    assert res["self_check_failed"] == {} and res["replays_differ"] == 0, res


def test_the_comparison_names_the_settings_the_device_ran_under():
    from scout_ckpt.replay import determinism

    deterministic = determinism.settings("cuda").deterministic
    expected = determinism.CUDA_DETERMINISTIC if deterministic else determinism.CUDA_DEFAULT
    assert determinism.comparison("cuda") == expected


def test_a_fault_of_the_live_forward_on_the_device_fails_every_replays_self_check():
    from scout_ckpt.replay.repeat import repeat_check

    block = _block()
    calls = []

    def once(m, a, out):  # the live forward only: the replays' calls come after it
        calls.append(1)
        return out + 1e-3 if len(calls) == 1 else None

    block.mlp.fc2.register_forward_hook(once)
    x = torch.randn(8, 64, 128, device="cuda", requires_grad=True)
    res = repeat_check(block, (x,), 5)
    assert res["self_check_failed"] == {"output": 5}


def test_strict_deterministic_settings_sign_the_live_gradients_on_the_device():
    """In a fresh process: determinism.enable(warn_only=False) before the first matmul, then the live gradients are
    signed and 100 replays reproduce them."""
    code = (
        "import torch, json; from scout_ckpt.replay import determinism as d; s = d.enable(warn_only=False); "
        "from tests.test_cuda import _block; x = torch.randn(8, 64, 128, device='cuda', requires_grad=True); "
        "from scout_ckpt.replay.repeat import repeat_check; r = repeat_check(_block(), (x,), 100); "
        "print(json.dumps([s.comparison, r]))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    import json

    comparison, res = json.loads(p.stdout.strip().splitlines()[-1])
    assert comparison == "bitwise (cuda, deterministic settings)"
    assert res["grad_note"] is None and any(k.startswith("grad_param:") for k in res["live_signed"])
    assert res["self_check_failed"] == {} and res["replays_differ"] == 0, res


def test_nvml_reads_the_real_device():
    from scout_ckpt.observer.health import NvmlHealthSource

    src = NvmlHealthSource(0)
    assert src.available
    assert isinstance(src.poll(), list)
    assert "temperature" in src._last


@pytest.mark.parametrize("async_save", [False, True])
def test_cuda_state_saved_and_loaded_in_one_process_is_the_state_saved(tmp_path, async_save):
    """One rank (gloo, a FileStore), the model and AdamW's state on the device: the loaded state equals the state
    at the save, tensor for tensor, after training moved it on (async: staged from device memory)."""
    import torch.distributed as dist

    from scout_ckpt import Checkpointer, ModelOptimizerState

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def train():
            loss = model(torch.randn(16, 32, device="cuda")).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

        ckpt = Checkpointer(
            tmp_path / "run", model=model, optimizer=opt, consensus=False, observer=False, async_save=async_save
        )
        state = {"app": ModelOptimizerState(model, opt)}
        train()
        ckpt.save(1, state)
        ckpt.close()
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        saved_avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
        train()
        ckpt = Checkpointer(tmp_path / "run", model=model, optimizer=opt, consensus=False, observer=False)
        assert ckpt.load_latest_clean(state) == 1
        ckpt.close()
        assert all(v.is_cuda for v in model.state_dict().values())
        assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
        assert all(torch.equal(a, opt.state[p]["exp_avg"]) for a, p in zip(saved_avg, model.parameters()))
    finally:
        dist.destroy_process_group()
