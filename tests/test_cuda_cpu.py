"""What of the GPU proof runs without a GPU: the `cuda` marker's skip and SCOUT_REQUIRE_GPU, `scripts/gpu_check.py`
refusing in one line, its launch plan behind a fake device count, the NVML parsing on recorded outputs
(tests/data/nvml/), replay's determinism note, the signature bench's device path on the host, and the check's
own jobs under real torchrun on CPU (the same code the device runs, with `--device cpu`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.py"
FIXTURES = REPO / "tests" / "data" / "nvml"


def _gpu_check():
    """scripts/gpu_check.py as a module (it is a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


# ---- the marker and the refusal ----------------------------------------------------------------------------------


@pytest.mark.skipif("_has_cuda()", reason="a CUDA device is present: the cuda tests run instead")
@pytest.mark.parametrize("require", [False, True])
def test_the_cuda_tests_skip_with_their_reason_and_fail_under_scout_require_gpu(require):
    env = _env()
    env.pop("SCOUT_REQUIRE_GPU", None)
    if require:
        env["SCOUT_REQUIRE_GPU"] = "1"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "tests/test_cuda.py",
            "-k",
            "nvml_reads_the_real_device or flipped_bit",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    if require:
        assert p.returncode == 1, p.stdout[-2000:]
        assert "2 failed" in p.stdout and "SCOUT_REQUIRE_GPU=1 but no CUDA device" in p.stdout
    else:
        assert p.returncode == 0, p.stdout[-2000:]
        assert "2 skipped" in p.stdout and "no CUDA device (torch" in p.stdout


@pytest.mark.skipif("_has_cuda()", reason="a CUDA device is present")
def test_without_a_gpu_the_check_says_so_in_one_line_and_exits_2():
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--no-install"], capture_output=True, text=True, cwd=REPO, env=_env(), timeout=300
    )
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("gpu-check: no CUDA device here")
    assert "Traceback" not in p.stderr


@pytest.mark.skipif("_has_cuda()", reason="a CUDA device is present")
def test_make_gpu_check_without_a_gpu_fails_with_the_checks_one_line():
    p = subprocess.run(
        ["make", "-s", "gpu-check", f"GPU_PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=300,
    )
    assert p.returncode != 0
    assert p.stdout == ""
    ours = [line for line in p.stderr.splitlines() if line.startswith("gpu-check:")]
    assert len(ours) == 1 and "no CUDA device here" in ours[0] and "Traceback" not in p.stderr


def test_a_bad_stage_is_refused_in_one_line():
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--only", "nope"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=300,
    )
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "unknown stage 'nope'" in p.stderr


# ---- the launch plan behind a fake device count ------------------------------------------------------------------


def test_two_processes_on_one_gpu_share_it_over_gloo():
    plan = _gpu_check().launch_plan(2, "cuda", device_count=1)
    assert plan == {"backend": "gloo", "devices": ["cuda:0", "cuda:0"], "shared": True}


def test_processes_spread_over_the_gpus_round_robin():
    plan = _gpu_check().launch_plan(3, "cuda", device_count=2)
    assert plan["devices"] == ["cuda:0", "cuda:1", "cuda:0"] and plan["backend"] == "gloo" and plan["shared"]


def test_one_process_per_gpu_does_not_share():
    assert _gpu_check().launch_plan(2, "cuda", device_count=2)["shared"] is False


def test_no_gpu_is_refused_and_cpu_needs_none():
    gc = _gpu_check()
    with pytest.raises(gc.Refused, match="no CUDA device"):
        gc.launch_plan(1, "cuda", device_count=0)
    assert gc.launch_plan(2, "cpu", device_count=0)["devices"] == ["cpu", "cpu"]


def test_the_torchrun_command_runs_this_script_as_its_job():
    cmd = _gpu_check().torchrun_command(2, 1, ["/r", "--device", "cuda"])
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and cmd[cmd.index("--max-restarts") + 1] == "1"
    assert cmd[-5:] == [str(SCRIPT), "job", "/r", "--device", "cuda"]


def test_the_jobs_tagged_lines_are_read_back_from_mixed_output():
    got = _gpu_check().tagged('noise\n[rank1]: GPU-CHECK {"event": "saved", "step": 4}\nGPU-CHECK {bad\n')
    assert got == [{"event": "saved", "step": 4}]
    # two ranks' records on one line of the shared pipe (seen in a run at load 5): both are read
    two = 'GPU-CHECK {"event": "saved", "rank": 1, "step": 8}GPU-CHECK {"event": "saved", "rank": 0, "step": 8}\n'
    assert _gpu_check().tagged(two) == [
        {"event": "saved", "rank": 1, "step": 8},
        {"event": "saved", "rank": 0, "step": 8},
    ]


# ---- NVML parsing on recorded outputs ----------------------------------------------------------------------------


def _source(name: str):
    from scout_ckpt.observer.health import NvmlHealthSource, RecordedNvml

    return NvmlHealthSource(0, nvml=RecordedNvml(str(FIXTURES / f"{name}.json")))


def _polls(name: str, n: int) -> list[list[tuple]]:
    src = _source(name)
    return [[(e["metric"], e["old"], e["new"], e["severity"]) for e in src.poll()] for _ in range(n)]


def test_a_healthy_h100_reports_nothing():
    assert _polls("h100_healthy", 3) == [[], [], []]


def test_a_healthy_h100s_readings_are_parsed():
    src = _source("h100_healthy")
    src.poll()
    assert src._last["temperature"] == 33 and src._last["temp_slowdown"] == 89
    assert src._last["remap_pending"] == 0 and src._last["ecc_uncorrected_volatile"] == 0
    assert sum(k.startswith("nvlink") for k in src._last) == 18 * 4  # 18 links up, 4 counters each


def test_uncorrectable_ecc_then_a_pending_remap_are_reported_with_their_severity():
    assert _polls("a100_ecc_then_remap", 3) == [
        [],
        [("ecc_uncorrected_volatile", 0, 2, "fatal"), ("ecc_uncorrected_aggregate", 0, 2, "warning")],
        [
            ("remap_uncorrectable_rows", 0, 2, "warning"),
            ("remap_pending", 0, 1, "warning"),
            ("nvlink3_dl_replay", 0, 5, "warning"),
        ],
    ]


def test_metrics_a_consumer_gpu_lacks_are_dropped_at_the_first_poll():
    src = _source("rtx_no_ecc_no_nvlink")
    assert src.poll() == [] and src.poll() == []
    assert {"ecc_uncorrected_volatile", "ecc_uncorrected_aggregate", "remap"} <= src._unsupported
    assert all(f"nvlink{i}" in src._unsupported for i in range(36))
    assert src._last["temperature"] == 46


def test_a_gpu_falling_off_the_bus_is_one_fatal_event_then_silence():
    assert _polls("h100_lost", 3) == [[], [("gpu_lost", 0, 1, "fatal")], []]


def test_temperature_crossing_the_thresholds_and_back():
    assert _polls("h100_overheating", 4) == [
        [],
        [("temperature", 70, 90, "warning")],
        [("temperature", 90, 93, "fatal")],
        [("temperature", 93, 80, "info")],
    ]


def test_no_driver_means_no_source():
    src = _source("no_driver")
    assert not src.available and src.poll() == []


def test_an_error_code_without_a_subclass_drops_the_metric_like_any_nvml_error():
    from scout_ckpt.observer.health import NvmlHealthSource, RecordedNvml

    rec = json.loads((FIXTURES / "h100_healthy.json").read_text())
    for c in rec["calls"]:
        if c["call"].startswith("nvmlDeviceGetRemappedRows"):
            c.pop("result")
            c["error"] = "NVMLError"  # pynvml raises the base class for a code it has no subclass for
    src = NvmlHealthSource(0, nvml=RecordedNvml(rec))
    assert src.poll() == [] and "remap" in src._unsupported


def test_a_recording_of_a_recording_replays_to_the_same_events():
    """The recorder the device run wraps around pynvml, here around a replayed H100: what it records replays the
    same (the device run's recording is a fixture of this form)."""
    from scout_ckpt.observer.health import NvmlHealthSource, NvmlRecorder, RecordedNvml

    rec = NvmlRecorder(RecordedNvml(str(FIXTURES / "a100_ecc_then_remap.json")))
    first = NvmlHealthSource(0, nvml=rec)
    seen = [first.poll() for _ in range(3)]
    again = NvmlHealthSource(0, nvml=RecordedNvml(json.loads(json.dumps(rec.recording(device_name="x")))))
    assert [again.poll() for _ in range(3)] == seen and any(seen)


# ---- replay's determinism note -----------------------------------------------------------------------------------


def test_the_comparison_is_named_per_device_and_settings():
    from scout_ckpt.replay import determinism as d

    assert d.settings("cpu").comparison == d.CPU
    base = dict(
        device="cuda",
        deterministic_algorithms=True,
        warn_only=False,
        cublas_workspace=":4096:8",
        cudnn_deterministic=True,
        cudnn_benchmark=False,
    )
    assert d.Settings(**base).comparison == d.CUDA_DETERMINISTIC
    for off in (
        {"deterministic_algorithms": False},
        {"warn_only": True},
        {"cublas_workspace": None},
        {"cudnn_benchmark": True},
        {"cudnn_deterministic": False},
        {"cublas_workspace": ":1:1"},
    ):
        assert d.Settings(**{**base, **off}).comparison == d.CUDA_DEFAULT, off


def test_replays_are_strict_on_cuda_and_as_before_on_the_host():
    from scout_ckpt.replay import determinism as d

    assert d.replay_warn_only("cuda:0") is False and d.replay_warn_only("cpu") is True


def test_a_replay_on_the_host_runs_warn_only_and_restores_the_callers_settings(one_thread):
    import torch

    from scout_ckpt.replay.execute import replay_mode

    seen = []
    with replay_mode(torch.device("cpu"), True):
        seen.append(
            (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
        )
    assert seen == [(True, True)]
    assert not torch.are_deterministic_algorithms_enabled()


def test_enable_sets_what_it_documents_in_a_fresh_process():
    code = (
        "import os, torch, json; from scout_ckpt.replay import determinism as d; s = d.enable(); "
        "print(json.dumps([os.environ['CUBLAS_WORKSPACE_CONFIG'], torch.are_deterministic_algorithms_enabled(), "
        "torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, s.comparison]))"
    )
    env = _env()
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout) == [":4096:8", True, True, False, "bitwise (cpu)"]


@pytest.fixture
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _block():
    import torch

    from scout_ckpt.demo.model import Block

    torch.manual_seed(0)
    return Block(32, 4)


def test_repeat_check_on_the_host_finds_no_difference_in_a_healthy_block(one_thread):
    import torch

    from scout_ckpt.replay.repeat import repeat_check

    res = repeat_check(_block(), (torch.randn(2, 8, 32, requires_grad=True),), 3)
    assert res["self_check_failed"] == {} and res["replays_differ"] == 0 and res["comparison"] == "bitwise (cpu)"
    assert any(k.startswith("grad_param:") for k in res["live_signed"])


def test_repeat_check_names_a_fault_of_the_live_step_in_every_replay(one_thread):
    import torch

    from scout_ckpt.replay.repeat import repeat_check

    block, calls = _block(), []
    block.mlp.fc1.register_forward_hook(lambda m, a, out: (calls.append(1), out + 1e-3 if len(calls) == 1 else None)[1])
    res = repeat_check(block, (torch.randn(2, 8, 32, requires_grad=True),), 3)
    assert res["self_check_failed"] == {"output": 3}


def test_a_replay_row_and_the_saves_evidence_say_what_the_comparison_rested_on():
    from scout_ckpt.replay import rows
    from scout_ckpt.replay.schedule import coverage

    header = {0: [0.1, 1.0, 1.0, 4.0], 1: [0.1, 1.0, 1.0, 4.0]}
    sig = [[1, 2]]
    import torch

    row = rows.replay_row(8, ("block", "blocks.0"), None, ["output[0]"], header, 0, torch.tensor([sig, sig]), 0, [0, 1])
    assert row["detail"]["comparison"] == "bitwise (cpu)"
    bad = {**row, "status": "ATTRIBUTED", "ranks": [1]}
    ev = coverage([bad], [("block", "blocks.0")], step=8)
    assert ev["reasons"][0]["comparison"] == "bitwise (cpu)" and ev["comparison"] == ["bitwise (cpu)"]


# ---- the bench's device path, on the host ------------------------------------------------------------------------


def test_the_signature_bench_measures_against_a_device_copy_in_the_same_run():
    p = subprocess.run(
        [sys.executable, "bench/signature_throughput.py", "--device", "cpu", "--json", "--mb", "8", "--repeats", "2"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout)
    assert got["ratio"] == got["ratios"]["signature_vs_copy_bandwidth"]
    assert got["bandwidth_gb_per_s"] == got["gb_per_s"]["copy (device to device)"] > 0
    assert got["target_met"] is None  # no goal on the host


# ---- the check's own jobs, on CPU under real torchrun --------------------------------------------------------------


def _stages(tmp_path: Path, only: str) -> dict:
    out = tmp_path / "results.json"
    p = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--no-install",
            "--only",
            only,
            "--out",
            str(out),
            "--budget-s",
            "1400",
            "--replays",
            "10",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=1500,
    )
    res = json.loads(out.read_text())
    assert p.returncode == (0 if res["ok"] else 1)
    return res["stages"]


@pytest.mark.scenario
def test_the_one_process_job_resumes_exactly_and_a_flipped_bit_is_walked_past(tmp_path):
    st = _stages(tmp_path, "resume_1,bitflip")
    assert st["resume_1"]["ok"], st["resume_1"]
    assert st["bitflip"]["ok"], st["bitflip"]


@pytest.mark.scenario
def test_the_two_process_job_resumes_exactly_and_an_sdc_is_caught_by_replay(tmp_path):
    st = _stages(tmp_path, "resume_2,sdc,replay")
    assert st["resume_2"]["ok"], st["resume_2"]
    assert st["sdc"]["ok"], st["sdc"]
    assert st["replay"]["ok"], st["replay"]
