"""The judge's stacks for a hang at a stopped rank (observer/daemon.py `_judge`, observer/stacks.py `collect`), on
synthetic status rows as the daemon reads them: pure, no processes, the judge's clock passed in.

A SIGSTOPped trainer cannot dump its stacks; its own observer records why (at once, no signal). On a loaded host
that record can reach the judge after the judge has seen the stall: the judge then waits for it as it waits for
a running rank's dump, and past that wait the row's own state ("stopped") says why there is no dump. Never "no
stack dump captured" for a rank whose observer reports it stopped.
"""

from __future__ import annotations

from types import SimpleNamespace

from scout_ckpt.observer import node_summary as ns
from scout_ckpt.observer import stacks
from scout_ckpt.observer.aggregator import NodeRole
from scout_ckpt.observer.daemon import Daemon
from scout_ckpt.observer.incidents import Incidents

STALL_S, WAIT_S = 5.0, 2.0


def _rows(stopped_record: bool) -> dict[int, dict]:
    """Ranks 0 and 1 wait in collective #10 of step 4; rank 2's trainer is stopped before it (collective #9)."""
    rows = {
        r: {
            "rank": r,
            "state": "running",
            "live": True,
            "age_s": STALL_S + 1,
            "in_coll": True,
            "in_side": False,
            "phase": "forward",
            "step": 4,
            "seq": 10,
            "cseq": 0,
            "fp": "0" * 16,
            "hb": [7, 0],
            "stacks": None,
        }
        for r in range(3)
    }
    rows[2].update(state="stopped", in_coll=False, seq=9, hb=[5, 0])
    if stopped_record:
        rows[2]["stacks"] = {"hb": [5, 0], "reason": stacks.stopped_text()}
    return rows


def _judge(tmp_path) -> tuple[Daemon, list[dict]]:
    """A Daemon with only what `_judge` reads (no trainer, no heartbeat), its events kept in a list."""
    d = Daemon.__new__(Daemon)
    published: list[dict] = []
    d.cfg, d.rank, d.world, d.channel = {"action": "report"}, 0, 3, tmp_path
    d.stall_s, d.stacks_wait_s, d.crash_confirm_s, d.pending = STALL_S, WAIT_S, 1.0, {}
    d.stragglers = SimpleNamespace(update=lambda now, rows: [])
    d.incidents = Incidents(d.cfg, 0, tmp_path / "claims")
    d.incidents.write_event = lambda kind, ranks, step, detail, key: published.append(
        {"kind": kind, "ranks": ranks, "detail": detail}
    )
    return d, published


def test_the_judge_waits_for_a_stopped_ranks_record_and_then_names_why_it_has_no_dump(tmp_path):
    d, published = _judge(tmp_path)
    d._judge(100.0, _rows(stopped_record=False))  # the stopped rank's observer has not written its record yet
    assert published == []  # waited for, as a running rank's dump is
    d._judge(100.0 + WAIT_S / 2, _rows(stopped_record=True))
    assert [(e["kind"], e["ranks"]) for e in published] == [("hang", [2])]
    assert published[0]["detail"]["stacks"] == {"2": stacks.stopped_text()}


def test_past_the_wait_the_rows_state_says_the_rank_is_stopped(tmp_path):
    d, published = _judge(tmp_path)
    d._judge(100.0, _rows(stopped_record=False))
    d._judge(100.0 + WAIT_S + 0.1, _rows(stopped_record=False))  # the record never came (a starved observer)
    assert [(e["kind"], e["ranks"]) for e in published] == [("hang", [2])]
    assert published[0]["detail"]["stacks"] == {"2": stacks.stopped_text()}


def test_the_hierarchys_root_names_a_stopped_rank_stopped_not_gone(tmp_path):
    """The root of the hierarchy judges node summaries (observer/node_summary.py): a stopped rank's record rides in
    its node's summary, and with or without it the rank is reported stopped, not "gone or silent"."""
    d, published = _judge(tmp_path)
    role = NodeRole.__new__(NodeRole)
    role.d, role.transport = d, SimpleNamespace(bump_claims=lambda: None)
    for record, claims in ((True, "a"), (False, "b")):
        d.incidents.claims, d.pending = tmp_path / claims, {}
        d.incidents.claims.mkdir()
        rows = _rows(stopped_record=record)
        parts = [
            ns.summarize(0, "host0", 0, 1, 1, {r: rows[r] for r in (0, 1)}, STALL_S),
            ns.summarize(1, "host1", 2, 2, 1, {2: rows[2]}, STALL_S),
        ]
        role.judge(100.0, ns.merge(parts))
        role.judge(100.0 + WAIT_S + 0.1, ns.merge(parts))
    assert [(e["kind"], e["ranks"], e["detail"]["stacks"]) for e in published] == [
        ("hang", [2], {"2": stacks.stopped_text()}),
        ("hang", [2], {"2": stacks.stopped_text()}),
    ]


def test_collect_names_stopped_gone_and_missing_ranks_apart(tmp_path):
    got = stacks.collect(
        [0, 1, 2, 3],
        {3: {"hb": [1, 0], "reason": "no stack dump within 1.0s (state S)"}},
        lambda r: r == 0,
        "process is gone",
        tmp_path,
        stopped=lambda r: r == 1,
    )
    assert got == {
        "0": "process is gone",
        "1": stacks.stopped_text(),
        "2": "no stack dump captured",
        "3": "no stack dump within 1.0s (state S)",
    }
