"""bench/framework_save.py without its torchrun jobs (make bench-smoke runs those): a framework that cannot run here
is reported as skipped with its reason, never left out; bad options end with one line and exit 2; the figures
follow from the samples."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import framework_save as fs  # noqa: E402

sys.path.remove(str(REPO / "bench"))


def test_a_framework_not_installed_is_reported_skipped_with_its_reason(monkeypatch, capsys):
    monkeypatch.setattr(fs, "FRAMEWORKS", {"ghost": (("scout_no_such_module",), ("ghost-dist",), "ghost")})
    monkeypatch.setattr(sys, "argv", ["framework_save.py", "--json", "--frameworks", "ghost"])
    fs.main()
    doc = json.loads(capsys.readouterr().out)
    assert doc["skipped"] == {"ghost": "scout_no_such_module is not installed (pip install 'scout-ckpt[ghost]')"}
    assert doc["frameworks"]["ghost"]["versions"] == {"torch": doc["torch"], "ghost-dist": None}
    assert doc["target_met"] is False  # a figure not measured is not a figure met
    assert doc["ratios"] == {}
    assert doc["failed"] == {}
    assert len(doc["loadavg_start"]) == 3
    assert len(doc["loadavg_end"]) == 3
    assert doc["command"] == "python bench/framework_save.py --json --frameworks ghost"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--frameworks", "deepspeed,nope"], "error: unknown framework nope (known: deepspeed, megatron, "),
        (["--sizes", "huge"], "error: --sizes takes tiny, large (got 'huge')"),
        (["--rounds", "0"], "error: --rounds must be at least 1"),
        (["--warmup", "-1"], "error: --warmup must be at least 0"),
    ],
)
def test_bad_options_end_with_one_line_and_exit_2(flags, message):
    p = subprocess.run(
        [sys.executable, "bench/framework_save.py", "--json", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr.startswith(message) and p.stderr.count("\n") == 1


def test_the_figures_follow_from_the_samples():
    r = fs.summarize(
        {
            "samples_s": {"framework": [1.0, 2.0, 4.0], "scout": [1.5, 2.0, 6.0]},
            "cpu_s": {"framework": 0.5, "scout": 1.0},
            "state_bytes_per_rank": 1,
        }
    )
    assert (r["framework_s"], r["scout_s"], r["ratio"]) == (2.0, 2.0, 1.0)
    assert r["beyond_framework_s"] == 0.5  # the median of the paired differences 0.5, 0.0, 2.0
    assert r["spread_s"]["scout"] == {"min": 1.5, "max": 6.0, "mad": 0.5}
    assert r["cpu_vs_framework"] == 2.0
