"""How a refusal reaches the person running a job: one line, not a traceback per rank (errors.one_line_refusals,
installed by the Checkpointer and every integration), and LiveStateCorrupt's text saying its reason once."""

from __future__ import annotations

import os
import subprocess
import sys

from scout_ckpt.errors import LiveStateCorrupt
from tests.conftest import REPO

SCRIPT = """
from scout_ckpt.errors import one_line_refusals
from scout_ckpt.errors import StartRefused
one_line_refusals()
raise StartRefused("ROOT: no certified checkpoint, but 2 saved tag(s) exist. Fix: accept_single_owner=True")
"""


def _run(env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SCOUT_CKPT_TRACEBACK"}
    env.update(PYTHONPATH=str(REPO), **env_extra)
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)


def test_an_uncaught_start_refusal_is_one_line_naming_cause_and_fix():
    p = _run({"RANK": "0"})
    assert p.returncode == 1 and p.stderr == (
        "scout-ckpt: StartRefused: ROOT: no certified checkpoint, but 2 saved "
        "tag(s) exist. Fix: accept_single_owner=True\n"
    ), p.stderr


def test_the_other_ranks_stay_silent_about_a_refusal_every_rank_raises_alike():
    p = _run({"RANK": "1"})
    assert p.returncode == 1 and p.stderr == "", p.stderr


def test_scout_ckpt_traceback_keeps_the_traceback():
    p = _run({"RANK": "0", "SCOUT_CKPT_TRACEBACK": "1"})
    assert p.returncode == 1 and p.stderr.startswith("Traceback"), p.stderr


def test_live_state_corrupt_says_an_integrations_reason_once():
    e = LiveStateCorrupt(4, {"live_fault": ["consensus_inconclusive"], "reasons": [{"code": "consensus_inconclusive"}]})
    assert "(consensus_inconclusive);" in str(e) and str(e).count("consensus_inconclusive") == 1


def test_live_state_corrupt_names_the_kind_and_the_codes_where_they_differ():
    e = LiveStateCorrupt(4, {"live_fault": ["consensus"], "reasons": [{"code": "consensus_attributed"}]})
    assert "(consensus: consensus_attributed);" in str(e)
