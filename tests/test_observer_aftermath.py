"""What a previous generation left unfinished, settled by the next one (observer/aftermath.py), on hand-made
side channels: clean, already reported, unfinished (attributed and not), still being written; exactly once."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from scout_ckpt.ledger import Ledger
from scout_ckpt.observer import aftermath

pytestmark = pytest.mark.timing  # its outcome depends on timing: `make stress` runs it under load

HOST = os.uname().nodename
DEAD_PID = 4_194_000  # above the default pid_max: no such process


def channel(base, run_id, rows: dict[int, dict], claims=()):
    ch = base / run_id
    (ch / "claims").mkdir(parents=True)
    for r in range(3):
        (ch / f"observer-{r}.json").write_text(json.dumps({"world_size": 3, "run_id": run_id, "rank": r}))
    for r, row in rows.items():
        full = {
            "rank": r,
            "observer_pid": DEAD_PID,
            "host": HOST,
            "state": "gone",
            "step": 7,
            "phase": "step",
            "seq": 9,
            "fp": "aa",
            "error": False,
            "t_update": 100.0 + r,
            "gone_at": None,
            "wall": time.time(),
            "pid": 1000 + r,
            **row,
        }
        (ch / f"status-{r}.json").write_text(json.dumps(full))
    for i, kind in enumerate(claims):
        (ch / "claims" / f"{kind}-{i}.json").write_text(json.dumps({"kind": kind}))
    return ch


def settle(base, current="now"):
    written = []
    pending = aftermath.settle(base, current, lambda *a, **k: written.append(a + (k.get("when"),)), HOST)
    return pending, written


def test_clean_and_reported_runs_leave_no_event(tmp_path):
    channel(tmp_path, "clean", {r: {"state": "closed"} for r in range(3)})
    channel(tmp_path, "reported", {r: {} for r in range(3)}, claims=["hang"])
    pending, written = settle(tmp_path)
    assert pending == 0 and written == []
    assert json.loads((tmp_path / "clean" / "settled.json").read_text())["outcome"] == "clean"
    assert json.loads((tmp_path / "reported" / "settled.json").read_text())["kinds"] == ["hang"]


def test_unfinished_run_attributed_by_victims_and_recorded_once(tmp_path):
    channel(tmp_path, "prev", {0: {"error": True}, 1: {"seq": 8}, 2: {"error": True}})
    pending, written = settle(tmp_path)
    assert pending == 0 and len(written) == 1
    kind, ranks, step, detail, key, run_id, _when = written[0]
    assert (kind, ranks, run_id) == ("crash", [1], "prev")
    assert detail["source"] == "previous_generation" and detail["attribution"] == "strict_majority"
    assert settle(tmp_path) == (0, [])  # settled exactly once


def test_unfinished_run_without_final_words_is_unattributed_first_stopped_first(tmp_path):
    # the observers died with their trainers (whole-node kill): rows still say running
    channel(
        tmp_path,
        "prev",
        {
            0: {"state": "running", "t_update": 105.0},
            1: {"state": "running", "t_update": 101.0},
            2: {"state": "running", "t_update": 103.0},
        },
    )
    _, written = settle(tmp_path)
    kind, ranks, _step, detail, _key, _run, when = written[0]
    assert (kind, ranks, detail["attribution"]) == ("crash", [], "unattributed")
    assert when == 101.0  # stamped with when the first rank stopped, not when the next generation settled it
    assert detail["first_stopped"] == [1] and [row["rank"] for row in detail["progress"]] == [1, 2, 0]


def test_a_run_whose_observers_may_still_write_waits(tmp_path):
    channel(tmp_path, "live", {0: {"host": "elsewhere", "wall": time.time()}, 1: {}, 2: {}})
    pending, written = settle(tmp_path)
    assert pending == 1 and written == [] and not (tmp_path / "live" / "settled.json").exists()
    channel(tmp_path, "now", {0: {}, 1: {}, 2: {}})  # the current run itself is never settled
    assert settle(tmp_path)[0] == 1 and not (tmp_path / "now" / "settled.json").exists()


def test_daemon_writes_the_previous_runs_crash_to_the_ledger(tmp_path):
    """The real observer process of a new run's rank 0 settles the earlier channel and writes the event."""
    from scout_ckpt.observer.daemon import Observer, channel_dir

    Ledger.open(tmp_path, create=True).close()
    channel(channel_dir(tmp_path, "x").parent, "prev", {0: {"error": True}, 1: {}, 2: {"error": True}})
    obs = Observer.start(tmp_path, rank=0, world_size=1, run_id="next", stall_s=600.0, poll_s=0.05, trace=False)
    try:
        deadline = time.monotonic() + 30
        events = []
        while time.monotonic() < deadline and not events:
            with Ledger.open(tmp_path, readonly=True) as led:
                events = led.events()
            time.sleep(0.1)
    finally:
        obs.stop()
    assert [(e["kind"], e["ranks"], e["run_id"]) for e in events] == [("crash", [1], "prev")]


def test_a_run_a_supervisor_already_diagnosed_gets_no_second_event(tmp_path):
    channel(tmp_path, "prev", {0: {"error": True}, 1: {}, 2: {"error": True}})
    asked = []
    written = []
    aftermath.settle(
        tmp_path,
        "now",
        lambda *a, **k: written.append(a + (k.get("when"),)),
        HOST,
        reported_elsewhere=lambda run_id, t_from: asked.append(run_id) or True,
    )
    assert asked == ["prev"] and written == []
    assert json.loads((tmp_path / "prev" / "settled.json").read_text())["kinds"] == ["elsewhere"]


def test_the_side_channel_lives_under_the_reports_dir_of_the_layout():
    """observer/channel.py restates the reports folder so the observer process need not import format/: the two
    must name the same folder, or the next generation would look for earlier runs where none are written."""
    from scout_ckpt.format.layout import REPORTS_DIR
    from scout_ckpt.observer import channel

    assert channel.REPORTS_DIR == REPORTS_DIR
    assert channel.channel_dir("/r", "x") == Path("/r") / REPORTS_DIR / ".observer" / "x"


def test_a_one_rank_jobs_crash_names_its_only_rank_live_and_after_the_restart(tmp_path):
    """A 1-rank job has no peer to outvote: its trainer gone without a clean close (and without a collective
    failure, which a lone rank cannot suffer from a peer) is its crash, named by its own observer; a generation
    that ended that way is recorded by the next one naming the rank too."""
    from scout_ckpt.observer.verdicts import attribute

    gone = {
        "rank": 0,
        "state": "gone",
        "step": 5,
        "seq": 0,
        "fp": "00",
        "error": False,
        "age_s": 1.0,
        "in_coll": False,
        "phase": "idle",
    }
    v = attribute({0: gone}, 1, stall_s=60.0)
    assert (v["kind"], v["ranks"], v["step"], v["attribution"]) == ("crash", [0], 5, "only_rank")
    assert attribute({0: {**gone, "state": "closed"}}, 1, stall_s=60.0) is None  # a clean close is no crash
    ch = tmp_path / "solo"
    (ch / "claims").mkdir(parents=True)
    (ch / "observer-0.json").write_text(json.dumps({"world_size": 1, "run_id": "solo", "rank": 0}))
    (ch / "status-0.json").write_text(
        json.dumps(
            {
                **gone,
                "observer_pid": DEAD_PID,
                "host": HOST,
                "t_update": 100.0,
                "gone_at": 101.0,
                "wall": time.time(),
                "pid": 1000,
            }
        )
    )
    pending, written = settle(tmp_path)
    assert pending == 0 and [(w[0], w[1], w[2]) for w in written] == [("crash", [0], 5)]
    assert written[0][-1] == 101.0  # stamped with when the rank died


def test_another_hosts_clock_never_decides_whether_its_observer_still_writes(tmp_path, monkeypatch):
    """Nothing is ordered by another host's clock: a row from another host is judged by its heartbeat as seen
    from here. Its clock an hour behind made a live observer look dead (its run settled as a crash while it was
    still writing); an hour ahead kept a dead one 'alive' for the hour."""
    behind = channel(
        tmp_path, "behind", {0: {"host": "elsewhere", "wall": time.time() - 3600, "beat": 1}, 1: {}, 2: {}}
    )
    ahead = channel(
        tmp_path / "b", "ahead", {0: {"host": "elsewhere", "wall": time.time() + 3600, "beat": 7}, 1: {}, 2: {}}
    )
    seen: dict = {}
    # this host's monotonic clock, injected: it moves only when the test says so, however loaded the machine
    clock = [1000.0]
    monkeypatch.setattr(aftermath, "time", SimpleNamespace(monotonic=lambda: clock[0], time=time.time))

    def settle_with(base):
        written = []
        pending = aftermath.settle(base, "now", lambda *a, **k: written.append(a), HOST, quiet_s=0.5, seen=seen)
        return pending, written

    for beat in range(2, 17):  # 1.5 s of this host's clock, three quiet periods: the live one beats throughout
        assert settle_with(tmp_path) == (1, []), "an observer still beating was judged gone"
        row = json.loads((behind / "status-0.json").read_text())
        (behind / "status-0.json").write_text(json.dumps({**row, "beat": beat}))
        clock[0] += 0.1
    assert not (behind / "settled.json").exists()
    # the other one never beat again: pending only until its heartbeat has been still for quiet_s here
    assert settle_with(tmp_path / "b")[0] == 1  # first seen now: it may still be writing
    clock[0] += 0.4
    assert settle_with(tmp_path / "b")[0] == 1  # still for less than quiet_s
    clock[0] += 0.2
    pending, written = settle_with(tmp_path / "b")
    assert pending == 0 and [w[0] for w in written] == ["crash"]
    assert json.loads((ahead / "settled.json").read_text())["outcome"] == "unfinished"
