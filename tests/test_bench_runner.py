"""bench/run_all.py's smoke run (make bench-smoke): which scripts it runs, how a bench's JSON is judged, and how
`--smoke` shrinks a bench while options given on the command line still win."""

from __future__ import annotations

import argparse
import sys

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
