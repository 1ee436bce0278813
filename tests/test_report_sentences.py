"""The fault timeline's events lead with one plain sentence (what, which rank and host, what it means for the
checkpoints, what to do), the recorded fields after it; runs that both started at step 0 get bars of their own.
Over a real SQLite ledger."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from scout_ckpt.ledger import Ledger
from scout_ckpt.report import timeline as report
from scout_ckpt.report.page import render_html, run_bar_ys


def _ledger(root: Path) -> Path:
    t0 = time.time() - 100
    with Ledger.open(root, create=True) as lg:
        lg.begin_run("r1", world_size=2, topology={"mode": "ddp"}, policy={"require": ["bytes"]})
        lg.record_ranks("r1", [{"rank": 0, "host": "node-a", "pid": 10}, {"rank": 1, "host": "node-b", "pid": 11}])
        lg.add_event(
            "crash",
            step=40,
            ranks=[1],
            run_id="r1",
            when=t0 + 40,
            detail={
                "attribution": "first_gone",
                "seq": 40,
                "pos": 40,
                "reason": "trainer process of rank(s) [1] died first, >= 0.05s before any other rank",
            },
        )
    return root


def test_an_event_leads_with_one_sentence_naming_rank_host_meaning_and_what_to_do(tmp_path: Path):
    tl = report.timeline(_ledger(tmp_path))
    (e,) = tl["events"]
    assert e["summary"] == (
        "Rank 1 on node-b: the process died at step 40; checkpoints already certified are "
        "untouched and a save it interrupted is never resumed from. What to do: let torchrun "
        "restart the job (it resumes from the latest clean checkpoint); look at that rank's log."
    )


def test_the_observers_own_account_comes_first_among_the_fields(tmp_path: Path):
    (e,) = report.timeline(_ledger(tmp_path))["events"]
    assert list(e["detail"])[0] == "reason"


def test_the_terminal_table_shows_the_sentence_before_the_fields(tmp_path: Path):
    con = Console(width=400, record=True)
    con.print(report.render_table(report.timeline(_ledger(tmp_path))))
    text = con.export_text()
    assert text.index("Rank 1 on node-b: the process died") < text.index("attribution: first_gone")


def test_the_page_puts_the_fields_behind_a_disclosure(tmp_path: Path):
    page = render_html(report.timeline(_ledger(tmp_path)))
    assert "Rank 1 on node-b: the process died at step 40" in page
    assert "<details><summary>fields</summary>reason: trainer process" in page


def test_two_runs_that_both_started_at_step_0_get_bars_of_their_own():
    runs = [
        {"resumed_from": None, "end_step": 20},
        {"resumed_from": None, "end_step": 40},
        {"resumed_from": 40, "end_step": 60},
    ]
    ys = run_bar_ys(runs)
    assert ys[0] != ys[1] and ys[2] == 1.0
