"""A flip in a trainable FSDP2 shard between two saves (#25 item 0b), under real `torchrun`, 2 gloo ranks.

The job (tests/scripts/fsdp_interval_job.py) is PyTorch's FSDP2 example shape with a frozen base weight beside the
trainable ones and the Checkpointer's defaults, saving every 5 steps. The flip is one low mantissa bit of one
element of rank 1's local shard of a trainable weight, after an optimizer step that no save follows. The at-rest
check at save time cannot see it (the next updates fold it in); the interval check between optimizer steps does:
by default it compares every local tensor in every interval (save/evidence/at_rest.py, INTERVAL_PARTS = 1), so a
flip in any tensor after any step is seen. The oracle is the job's own full-state sha256 and a run without the flip: the flipped run must
never certify a state the healthy run does not reach."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.torchrun_errors import why_failed

SCRIPT = REPO / "tests" / "scripts" / "fsdp_interval_job.py"
PARAM, INDEX = "blocks.0.fc2.weight", 11  # an early trainable weight: in run 0 of rank 1's tensors


def run_job(root, *args, restarts=1, timeout=900):
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.5",
        str(SCRIPT),
        str(root),
        *map(str, args),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    recs = [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines() if line.startswith("SCOUT-FSDP ")]
    return p, recs


def cli(*args) -> dict:
    p = subprocess.run(
        [sys.executable, "-m", "scout_ckpt.cli", *map(str, args), "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
        check=False,
    )
    return json.loads(p.stdout)


def saved(recs, attempt) -> dict[int, dict]:
    return {r["step"]: r for r in recs if r["event"] == "saved" and r["attempt"] == attempt and r["rank"] == 0}


def covered(recs, rank) -> list[str]:
    return next(r["covered"] for r in recs if r["event"] == "runs" and r["rank"] == rank)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    p, recs = run_job(tmp_path_factory.mktemp("healthy") / "run", "--steps", 15, "--save-every", 5)
    assert p.returncode == 0, why_failed(p.stderr)
    return recs


@pytest.mark.scenario
def test_a_flip_between_two_saves_is_caught_ends_the_generation_and_the_restart_matches_a_healthy_run(
    tmp_path, healthy
):
    ok = saved(healthy, 0)
    assert {s: v["state"] for s, v in ok.items()} == {5: "certified", 10: "certified", 15: "certified"}
    root = tmp_path / "run"
    p, recs = run_job(root, "--steps", 15, "--save-every", 5, "--flip", f"1:12:{PARAM}:{INDEX}", "--show-runs", 12)
    assert p.returncode == 0, why_failed(p.stderr)
    assert PARAM in covered(recs, 1)  # the schedule covers this tensor between steps 12 and 13
    first = saved(recs, 0)
    assert first[10]["digest"] == ok[10]["digest"] and first[10]["state"] == "certified"  # before the flip
    raised = [r for r in recs if r["event"] == "saved" and r["attempt"] == 0 and r["step"] == 15]
    assert sorted(r["rank"] for r in raised) == [0, 1] and all(r["raised"] for r in raised)  # every rank
    for r in raised:
        assert r["state"] == "rejected"
        (why,) = [x for x in r["reasons"] if x["code"] == "at_rest_changed"]
        assert why["ranks"] == [1] and why["tensors"] == [PARAM], why
        assert why["between_steps"] == [{"tensor": PARAM, "after_step": 12, "before_step": 13}], why
    loaded = next(r for r in recs if r["event"] == "loaded" and r["attempt"] == 1)
    assert (loaded["step"], loaded["digest"]) == (10, first[10]["digest"])  # the latest clean step, as saved
    again = saved(recs, 1)
    assert again[15]["state"] == "certified" and again[15]["digest"] == ok[15]["digest"]  # the healthy run's
    out = cli("ls", root)
    assert {c["step"]: c["state"] for c in out["checkpoints"]} == {5: "certified", 10: "certified", 15: "certified"}
    assert "rejected" in [h["state"] for h in cli("explain", root, 15)["history"]]
    assert cli("resume", root, "--latest-clean")["step"] == 15


@pytest.mark.scenario
@pytest.mark.parametrize(
    "step,param,index",
    [(13, PARAM, INDEX), (14, "head.bias", 5)],
    ids=["run1-of-4-after-13", "last-tensor-after-14"],
)
def test_a_flip_after_any_step_in_any_tensor_is_never_certified(tmp_path, healthy, step, param, index):
    """With the defaults every local tensor is compared in every interval: a flip after step 13 in a tensor of
    the first quarter, or after step 14 in the last tensor (places the former four-run schedule never looked at),
    ends the generation at the save of 15; the restart resumes from 10 and certifies the healthy run's 15."""
    ok = saved(healthy, 0)
    root = tmp_path / "run"
    p, recs = run_job(
        root, "--steps", 15, "--save-every", 5, "--flip", f"1:{step}:{param}:{index}", "--show-runs", step
    )
    assert p.returncode == 0, why_failed(p.stderr)
    assert param in covered(recs, 1)  # the default interval check covers every tensor after every step
    first = saved(recs, 0)
    assert first[10]["digest"] == ok[10]["digest"] and first[10]["state"] == "certified"  # before the flip
    raised = [r for r in recs if r["event"] == "saved" and r["attempt"] == 0 and r["step"] == 15]
    assert sorted(r["rank"] for r in raised) == [0, 1] and all(r["raised"] for r in raised)
    for r in raised:
        assert r["state"] == "rejected"
        (why,) = [x for x in r["reasons"] if x["code"] == "at_rest_changed"]
        assert why["ranks"] == [1] and why["tensors"] == [param], why
        assert why["between_steps"] == [{"tensor": param, "after_step": step, "before_step": step + 1}], why
    again = saved(recs, 1)
    assert again[15]["state"] == "certified" and again[15]["digest"] == ok[15]["digest"]  # the healthy run's
    certified = {c["step"] for c in cli("ls", root)["checkpoints"] if c["state"] == "certified"}
    assert certified == {5, 10, 15}
    assert cli("resume", root, "--latest-clean")["step"] == 15
    at_rest = cli("explain", root, 15)["evidence"]["at_rest"]
    assert at_rest["between_steps"] == "every local tensor, in every interval between optimizer steps", at_rest


def test_the_interval_check_in_one_process_sees_its_run_and_reports_at_the_next_save():
    """The guard alone (a plain model, AdamW, one process), as the Checkpointer runs it between saves
    (every=None): a flip between two optimizer steps in the run that interval covers is reported by the next
    check, naming the tensor and the interval; one outside it is not; a legitimate write announced by resign()
    is not a fault; healthy steps find nothing."""
    import torch

    from scout_ckpt import policy
    from scout_ckpt.save.evidence.at_rest import INTERVAL_PARTS, AtRestGuard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = AtRestGuard(opt, model, every=None, interval_parts=4)  # the partial schedule, still an option

    def step():
        model(torch.randn(4, 16)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    def run_of(s):
        names, tensors = guard._tensors()
        return [names[i] for i in guard.part_of(names, tensors, s)]

    def flip(name):
        with torch.no_grad():
            dict(model.named_parameters())[name].view(-1).view(torch.int32)[3] ^= 1

    for _ in range(6):
        step()
    assert guard.findings == [] and INTERVAL_PARTS == 1 and guard.interval_parts == 4
    assert sorted(sum((run_of(s) for s in range(4)), [])) == sorted(guard._tensors()[0])  # 4 runs cover all
    s = guard._steps
    target = next(n for n in run_of(s) if ":" not in n)  # a parameter in the run after step s
    flip(target)
    step()
    step()
    assert guard.findings == [{"tensor": target, "after_step": s, "before_step": s + 1}]
    guard.arm_next()
    step()
    ev = guard.check(guard._steps)
    assert ev["status"] == policy.FAIL
    assert ev["reasons"][0]["tensors"] == [target] and ev["reasons"][0]["between_steps"][0]["after_step"] == s
    step()
    assert guard.check(guard._steps)["status"] != policy.FAIL  # reported once, then forgotten
    s = guard._steps
    outside = next(n for n in guard._tensors()[0] if ":" not in n and n not in run_of(s))
    flip(outside)  # unseen: not in this interval's run
    step()
    assert guard.findings == []
    s = guard._steps
    with torch.no_grad():
        dict(model.named_parameters())[run_of(s)[0]].mul_(0.5)  # a legitimate write (a projection) ...
    guard.resign()  # ... announced
    step()
    assert guard.findings == []
    guard.close()


def test_the_default_interval_check_sees_a_flip_in_any_tensor_after_any_step():
    """The default guard (every local tensor in every interval): a flip of one low mantissa bit in each tensor in
    turn, parameters and optimizer state alike, each after a different step, is found before the next step, and
    a healthy step between them finds nothing."""
    import torch

    from scout_ckpt.save.evidence.at_rest import AtRestGuard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = AtRestGuard(opt, model, every=None)

    def step():
        model(torch.randn(4, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    step()
    names, tensors = guard._tensors()
    by_name = dict(zip(names, tensors))
    flippable = [n for n in names if by_name[n].dim() > 0]  # "step" is a scalar count: flipped below as well
    assert len(flippable) == 18
    for name in [*flippable, "0.weight:step"]:
        s = guard._steps
        with torch.no_grad():
            by_name[name].view(-1).view(torch.int32)[0] ^= 1
        step()
        assert guard.findings == [{"tensor": name, "after_step": s, "before_step": s + 1}], name
        guard.findings = []
        step()
        assert guard.findings == []
    guard.close()


def test_the_default_interval_check_sees_a_flip_in_the_last_byte_of_every_tensor():
    """Full coverage reaches the end of every tensor, not only its first element: one bit of the last byte of each
    local tensor (first the guard's very last one: the last parameter's last optimizer state, AdamW's step count),
    flipped after a step, is found before the next step, and a healthy step after it finds nothing. The flip is
    checked on the tensor's own bytes (the oracle: the state really changed), not through the guard."""
    import torch

    from scout_ckpt.save.evidence.at_rest import AtRestGuard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = AtRestGuard(opt, model, every=None)

    def step():
        model(torch.randn(4, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    step()
    names, tensors = guard._tensors()
    assert names[-1] == "1.bias:step"  # the last tensor the guard signs: the last parameter's last state
    for name, t in [(names[-1], tensors[-1]), *zip(names, tensors)]:
        raw = t.view(-1).view(torch.uint8)  # the tensor's own bytes; the last one is its highest-addressed
        before = raw[-1].item()
        s = guard._steps
        with torch.no_grad():
            raw[-1] ^= 0x01
        assert raw[-1].item() != before  # the state really changed
        step()
        assert guard.findings == [{"tensor": name, "after_step": s, "before_step": s + 1}], name
        guard.findings = []
        step()
        assert guard.findings == []
    guard.close()
