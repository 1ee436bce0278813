"""The fault campaign, small: real demo incidents (bitflip through the demo, truncate and delete on a healthy run's
copy), one healthy control, and 5 SIGKILL torture iterations of real 3-rank saves. Runs bench/campaign.py as a
process, as `make campaign` and `bench/run_all.py` do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.torchrun_errors import why_failed

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.scenario
@pytest.mark.slow
def test_campaign_quick_has_no_bad_resume_and_no_torture_violation(tmp_path):
    cmd = [
        sys.executable,
        str(REPO / "bench" / "campaign.py"),
        "--quick",
        "--json",
        "--seed",
        "3",
        "--kinds",
        "bitflip,truncate,delete",
        "--healthy",
        "1",
        "--torture",
        "5",
        "--out",
        str(tmp_path),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert p.returncode == 0, why_failed(p.stderr)
    res = json.loads(p.stdout)  # exactly one JSON object on stdout
    assert res["bad_resumes"] == 0
    assert res["torture_violations"] == 0 and res["torture"]["n_violations"] == 0
    assert res["torture"]["iterations"] >= 5 and res["torture"]["kills"] >= 1
    assert set(res["kinds"]) == {"bitflip", "truncate", "delete"}
    for kind, s in res["kinds"].items():
        for key in ("recall", "precision", "false_positives", "latency_s_median", "latency_s_p95", "n"):
            assert key in s, (kind, key)
        assert s["n"] == 1
        # byte damage to a certified step is always caught, and blamed on the rank that wrote the file
        assert s["recall"] == 1.0 and s["precision"] == 1.0, (kind, s)
    assert res["healthy"]["n"] == 1 and res["healthy"]["bad_resumes"] == 0
    assert json.loads((tmp_path / "campaign.json").read_text())["bad_resumes"] == 0
    assert "| bitflip |" in (tmp_path / "campaign.md").read_text()


def test_murphy_kinds_are_registered_and_scored_with_their_targets():
    """bench/campaign_murphy.py's kinds are campaign kinds, and score() reports wrongly_certified, good_lost and
    every incident's outcome per kind (skipped incidents included), beside the usual keys."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import campaign
    finally:
        sys.path.remove(str(REPO / "bench"))
    murphy = ("lost_ledger", "transient_eio", "enospc", "clock_skew", "gc_resave", "second_container")
    assert set(murphy) <= set(campaign.all_kinds())
    base = {"blamed": [], "truth": [], "latency_s": None, "bad_resume": False, "no_resume": False}
    incidents = [
        {
            **base,
            "id": "lost_ledger-0",
            "kind": "lost_ledger",
            "fired": True,
            "detected": True,
            "wrongly_certified": 0,
            "good_lost": 0,
            "outcome": "finished",
        },
        {
            **base,
            "id": "lost_ledger-1",
            "kind": "lost_ledger",
            "fired": True,
            "detected": False,
            "wrongly_certified": 1,
            "good_lost": 2,
            "outcome": "crashed: RuntimeError: x",
        },
        {
            **base,
            "id": "enospc-0",
            "kind": "enospc",
            "fired": False,
            "detected": False,
            "wrongly_certified": 0,
            "good_lost": 0,
            "outcome": "skipped: no tmpfs",
        },
        {**base, "id": "bitflip-0", "kind": "bitflip", "fired": True, "detected": True},
    ]
    kinds = campaign.score(incidents, [])
    assert kinds["lost_ledger"]["wrongly_certified"] == 1 and kinds["lost_ledger"]["good_lost"] == 2
    assert kinds["lost_ledger"]["outcomes"] == ["finished", "crashed: RuntimeError: x"]
    assert kinds["lost_ledger"]["n"] == 2 and kinds["lost_ledger"]["recall"] == 0.5
    assert kinds["enospc"]["outcomes"] == ["skipped: no tmpfs"] and kinds["enospc"]["n"] == 0
    assert "wrongly_certified" not in kinds["bitflip"] and "recall" in kinds["bitflip"]
