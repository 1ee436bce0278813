"""bench/run_all.py's smoke run (make bench-smoke): which scripts it runs, how a bench's JSON is judged, and how
`--smoke` shrinks a bench while options given on the command line still win."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import _common as C  # noqa: E402
import run_all  # noqa: E402

sys.path.remove(str(REPO / "bench"))


def test_the_smoke_run_takes_every_bench_the_campaign_and_the_torture_but_no_extension_module():
    on_disk = {p.name for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_")}
    smoke = {p.name for p in run_all.bench_scripts(smoke=True)}
    full = {p.name for p in run_all.bench_scripts()}
    extensions = {n for n in on_disk if n.startswith("campaign_")}
    assert extensions and not extensions & smoke and not extensions & full  # the campaign imports them
    assert smoke == on_disk - extensions - {"run_all.py"}
    assert full == smoke - {"campaign.py", "torture.py"}
    # every key the smoke run demands belongs to a bench it runs
    assert set(run_all.CONTRACT_KEYS) <= smoke


@pytest.mark.parametrize(
    "doc, missing",
    [
        ({"ratios": {"a": 1.0}, "kinds": {"x": {"recall": 1}, "y": {"recall": 0}}}, []),
        ({"ratios": {"a": None}, "kinds": {"x": {"recall": 1}, "y": {}}}, ["kinds.*.recall"]),
        ({"ratios": {}, "kinds": {}}, ["ratios.a", "kinds.*.recall"]),
        ({"ratios": 3, "kinds": []}, ["ratios.a", "kinds.*.recall"]),
    ],
)
def test_a_documented_key_left_out_is_named(doc, missing):
    assert run_all.missing_keys(doc, ["ratios.a", "kinds.*.recall"]) == missing


def test_smoke_sizes_become_the_defaults_and_options_given_still_win():
    def parser():
        p = C.parser("x")
        p.add_argument("--steps", type=int, default=60)
        p.add_argument("--modes", default="ddp,fsdp")
        return p

    smoke = {"steps": 4, "modes": "ddp"}
    args = C.parse_args(parser(), smoke, [])
    assert (args.smoke, args.steps, args.modes) == (False, 60, "ddp,fsdp")
    args = C.parse_args(parser(), smoke, ["--smoke", "--json"])
    assert (args.smoke, args.json, args.steps, args.modes) == (True, True, 4, "ddp")
    args = C.parse_args(parser(), smoke, ["--steps", "7", "--smoke"])
    assert (args.steps, args.modes) == (7, "ddp")
    with pytest.raises(SystemExit):
        C.parse_args(parser(), smoke, ["--smoke", "--nope"])


def test_a_smoke_runs_json_says_so(capsys):
    C.emit({"ratio": 1.0}, argparse.Namespace(json=True, smoke=True), [], [])
    C.emit({"ratio": 1.0}, argparse.Namespace(json=True), [], [])
    assert capsys.readouterr().out.splitlines() == ['{"ratio": 1.0, "smoke": true}', '{"ratio": 1.0}']


@pytest.mark.parametrize(
    "target_met, word",
    [
        (True, "met"),
        (False, "missed"),
        (None, "-"),
        ({"consensus_vs_save": True, "replay_interval_1": True}, "met"),
        ({"consensus_vs_save": True, "replay_interval_1": False}, "missed"),
    ],
)
def test_a_benchs_judgement_of_its_targets_reads_as_one_word_in_the_summary(target_met, word):
    # A bench with several targets (consensus_overhead.py) judges each: the summary's row is met only when all are.
    entry = {"bench": "x.py", "status": "ok", "date": "-", "command": "python bench/x.py --json"}
    entry["target_met"] = run_all.overall_met(target_met)
    assert run_all.verdict(entry) == word
    run = dict(command="c", commit="abc", started="s", ended="e", load_start=0, load_end=0, cores=2, wall_s=1.0)
    assert f"| {word} |" in run_all.markdown([entry], run)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing


def test_a_bench_out_of_time_is_killed_with_the_workers_it_started(tmp_path):
    # A bench that times out leaves no worker loading the machine under the benches after it: the bench below
    # starts a grandchild in the background (as torchrun's agent or a forkserver would), says its pid and hangs.
    pidfile = tmp_path / "worker.pid"
    script = (
        "import subprocess, sys, time\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.1)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(w.pid))\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        # the timeout is the test's bound on the bench: the worker has started long before (its pid is read back)
        run_all.run_in_session([sys.executable, "-c", script], timeout=6)
    worker = int(pidfile.read_text())
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:  # SIGKILL is delivered, not yet reaped by init
        time.sleep(0.05)
    assert not _alive(worker)


def test_a_bench_that_returns_takes_the_workers_it_left_behind_with_it(tmp_path):
    pidfile = tmp_path / "worker.pid"
    script = (
        "import subprocess, sys\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.1)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(w.pid))\n"
        "print('{}')\n"
    )
    res = run_all.run_in_session([sys.executable, "-c", script], timeout=60)
    assert (res.returncode, res.stdout.strip()) == (0, "{}")
    worker = int(pidfile.read_text())
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker)
