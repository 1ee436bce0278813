"""The fault timeline over real SQLite ledgers, and its HTML page rendered by a real headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from scout_ckpt.format.layout import step_dirname
from scout_ckpt.ledger import Ledger
from scout_ckpt.report import timeline as report

CHROMIUM = shutil.which("chromium")
BYTES_PASS = {"bytes": {"status": "pass", "reasons": []}}


def _commit(ledger: Ledger, step: int, run_id: str, state: str, reasons: list[dict] | None = None) -> None:
    ledger.record_writing(step, run_id, f"a{step}", step_dirname(step))
    ledger.record_commit(
        step,
        run_id=run_id,
        path=step_dirname(step),
        nbytes=1000 + step,
        manifest_digest="m",
        files=[{"path": "__0_0.distcp", "size": 1000, "digest": "xxh3_128:00", "rank": 0}],
        evidence=BYTES_PASS,
        state=state,
        reasons=reasons or [],
    )


def _interrupted(ledger: Ledger, step: int, run_id: str, attempt: str) -> None:
    """A save of `step` begun and never committed, judged interrupted at the next start-up (no crash event)."""
    ledger.record_writing(step, run_id, attempt, step_dirname(step))
    ledger.transition(step, "rejected", [{"code": "save_interrupted"}], source="startup", expect="writing")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A run of 4 ranks with one restart: checkpoints in every state, events of every kind, replay verdicts."""
    root = tmp_path / "run"
    root.mkdir()
    t0 = time.time() - 1000
    with Ledger.open(root, create=True) as lg:
        lg.begin_run("r1", world_size=4, topology={"mode": "ddp"}, policy={"require": ["bytes"]})
        _commit(lg, 10, "r1", "certified")
        _commit(lg, 20, "r1", "committed", [{"code": "replay_missing", "kind": "replay"}])
        # consensus attributed rank 2 at step 30; the observer also reported it (must not be told twice)
        _commit(lg, 30, "r1", "rejected", [{"code": "consensus_attributed", "ranks": [2], "tensor": "blocks.1.w"}])
        lg.add_event("sdc", step=30, ranks=[2], detail={"source": "consensus"}, run_id="r1", when=t0 + 30)
        # an invariant failure with no matching event: derived
        _commit(lg, 40, "r1", "rejected", [{"code": "invariant_failed", "ranks": [1], "check": "finite"}])
        _commit(lg, 50, "r1", "certified")
        lg.set_state(50, "quarantined", [{"code": "operator", "text": "bad data"}], source="quarantine")
        _commit(lg, 60, "r1", "certified")
        lg.set_state(60, "deleted", [], source="gc")
        # the crash at step 70: a writing row with no directory, then judged interrupted; no crash event
        lg.record_writing(70, "r1", "a70", step_dirname(70))
        lg.set_state(70, "rejected", [{"code": "save_interrupted", "ranks": [3]}], source="recovery")
        # step 80: interrupted too, but the observer reported the crash itself
        lg.record_writing(80, "r1", "a80", step_dirname(80))
        lg.set_state(80, "rejected", [{"code": "save_interrupted"}], source="recovery")
        lg.add_event("crash", step=80, ranks=[0], detail={"signal": "SIGKILL"}, run_id="r1", when=t0 + 80)
        lg.record_writing(90, "r1", "a90", step_dirname(90))  # still writing

        lg.add_event(
            "hang", step=33, ranks=[1], detail={"collective": "all_reduce", "seq": 412}, run_id="r1", when=t0 + 33
        )
        lg.add_event("straggler", step=12, ranks=[3], detail={"factor": 4.1}, run_id="r1", when=t0 + 12)
        lg.add_event(
            "desync", step=44, ranks=[0, 1, 2, 3], detail={"collective": "broadcast"}, run_id="r1", when=t0 + 44
        )
        lg.add_event("health", ranks=[2], detail={"xid": 79}, run_id="r1", when=t0 + 5)  # no step
        lg.add_event("health", step=3, detail={"host": "node7", "ecc": 2}, run_id="r1", when=t0 + 3)  # no rank
        lg.add_replays(
            [
                {
                    "run_id": "r1",
                    "step": 25,
                    "recipe": "block",
                    "target": "blocks.3",
                    "status": "ATTRIBUTED",
                    "ranks": [2],
                    "duration_s": 0.01,
                    "time": t0 + 25,
                },
                {
                    "run_id": "r1",
                    "step": 25,
                    "recipe": "head",
                    "target": "head",
                    "status": "AGREE",
                    "ranks": [],
                    "time": t0 + 25.5,
                },
                {
                    "run_id": "r1",
                    "step": 27,
                    "recipe": "optimizer",
                    "target": "optimizer",
                    "status": "INCONCLUSIVE",
                    "ranks": [],
                    "time": t0 + 27,
                },
                # the observer's own sdc event for step 30 / rank 2 names no target: this replay is the same finding
                {
                    "run_id": "r1",
                    "step": 30,
                    "recipe": "block",
                    "target": "blocks.1",
                    "status": "ATTRIBUTED",
                    "ranks": [2],
                    "time": t0 + 30.5,
                },
            ]
        )
        lg.begin_run("r2", world_size=4, topology={"mode": "ddp"}, policy={"require": ["bytes"]}, resumed_from=10)
    return root


def test_timeline_shape_order_and_derived_events(root: Path):
    tl = report.timeline(root)
    json.dumps(tl)  # the --json document serialises as is
    assert set(tl) >= {"events", "checkpoints", "runs"}
    for e in tl["events"]:
        assert set(e) >= {"kind", "ranks", "step", "time", "detail"}
        assert isinstance(e["ranks"], list) and isinstance(e["detail"], dict)
    times = [e["time"] for e in tl["events"]]
    assert times == sorted(times)
    assert {e["kind"] for e in tl["events"]} == {"sdc", "hang", "straggler", "crash", "desync", "health"}

    sdc = [(e["step"], e["ranks"], e["source"]) for e in tl["events"] if e["kind"] == "sdc"]
    assert (25, [2], "replay") in sdc  # replay ATTRIBUTED -> sdc
    assert (27, [], "replay") in sdc  # replay INCONCLUSIVE -> sdc, marked
    assert (40, [1], "checkpoint") in sdc  # invariant_failed -> sdc naming the rank
    assert [s for s in sdc if s[0] == 30] == [(30, [2], "events")]  # consensus verdict deduped with the event
    assert len(sdc) == 4
    inconclusive = next(e for e in tl["events"] if e["kind"] == "sdc" and e["step"] == 27)
    assert inconclusive["detail"]["inconclusive"] is True and inconclusive["detail"]["target"] == "optimizer"
    attributed = next(e for e in tl["events"] if e["kind"] == "sdc" and e["step"] == 25)
    assert attributed["detail"]["recipe"] == "block" and attributed["detail"]["target"] == "blocks.3"

    crashes = {e["step"]: e for e in tl["events"] if e["kind"] == "crash"}
    assert set(crashes) == {70, 80}
    assert crashes[70]["ranks"] == [3] and crashes[70]["detail"]["save_interrupted"] is True
    assert crashes[80]["source"] == "events" and crashes[80]["ranks"] == [0]  # no derived duplicate

    states = {c["step"]: (c["state"], c["label"]) for c in tl["checkpoints"]}
    assert states[10] == ("certified", "certified") and states[50] == ("quarantined", "quarantined")
    assert states[60] == ("deleted", "deleted") and states[70] == ("rejected", "interrupted")
    assert states[90] == ("writing", "writing")
    assert [c["step"] for c in tl["checkpoints"]] == sorted(states)
    assert [r["id"] for r in tl["runs"]] == ["r1", "r2"] and tl["runs"][1]["resumed_from"] == 10
    assert tl["summary"]["sdc"] == 4 and tl["summary"]["health"] == 2


def test_timeline_accepts_an_open_ledger_and_never_writes(root: Path):
    db = root / "scout-ledger.db"
    before = db.stat().st_mtime_ns
    with Ledger.open(root, readonly=True) as lg:
        assert report.timeline(lg)["events"] == report.timeline(root)["events"]
    assert db.stat().st_mtime_ns == before


def test_render_table(root: Path):
    tl = report.timeline(root)
    console = Console(width=200, record=True, color_system=None)
    console.print(report.render_table(tl))
    text = console.export_text()
    for word in ("sdc", "hang", "straggler", "crash", "desync", "health", "blocks.3", "save interrupted"):
        assert word in text
    assert "inconclusive" in text


def test_html_is_self_contained(root: Path, tmp_path: Path):
    out = report.write_html(report.timeline(root), tmp_path / "timeline.html")
    page = out.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "http://" not in page and "https://" not in page
    assert "data:image/png;base64," in page
    assert "<table" in page and "blocks.3" in page and "interrupted" in page
    assert not list(tmp_path.glob(".timeline.html.tmp-*"))  # the atomic write left no temp file


def test_empty_ledger(tmp_path: Path):
    Ledger.open(tmp_path, create=True).close()
    tl = report.timeline(tmp_path)
    assert tl["events"] == [] and tl["checkpoints"] == [] and tl["runs"] == []
    Console(width=120, file=open("/dev/null", "w")).print(report.render_table(tl))
    page = report.write_html(tl, tmp_path / "empty.html").read_text()
    assert "no events" in page


def test_ten_thousand_checkpoints(tmp_path: Path):
    """Bulk rows as a long run leaves them; the report must stay usable (no timing asserted)."""
    with Ledger.open(tmp_path, create=True) as lg:
        lg.begin_run("big", world_size=64, topology={}, policy={"require": ["bytes"]})
        states = ("certified", "committed", "rejected", "deleted", "quarantined")
        with lg.write():
            lg.db["checkpoints"].insert_all(
                {
                    "step": s,
                    "run_id": "big",
                    "state": states[s % 5] if s % 7 else "certified",
                    "path": step_dirname(s),
                    "bytes": 10,
                    "started": 1e9 + s,
                    "committed": 1e9 + s + 0.5,
                    "updated": 1e9 + s + 0.5,
                    "reasons": json.dumps([{"code": "consensus_attributed", "ranks": [s % 64]}] if s % 5 == 2 else []),
                }
                for s in range(1, 10_001)
            )
            lg.db["events"].insert_all(
                {
                    "time": 1e9 + s,
                    "run_id": "big",
                    "kind": ("hang", "straggler", "health")[s % 3],
                    "step": s,
                    "ranks": json.dumps([s % 64]),
                    "detail": "{}",
                }
                for s in range(1, 10_001, 50)
            )
    tl = report.timeline(tmp_path)
    assert len(tl["checkpoints"]) == 10_000
    assert sum(e["kind"] == "sdc" for e in tl["events"]) == 2000
    page = report.write_html(tl, tmp_path / "big.html").read_text()
    assert page.count("<tr>") >= 10_000


def test_report_never_imports_torch(root: Path, tmp_path: Path):
    code = (
        "import sys, scout_ckpt.report.timeline as r\n"
        f"tl = r.timeline({str(root)!r})\n"
        "from rich.console import Console; Console(file=open('/dev/null','w')).print(r.render_table(tl))\n"
        f"r.write_html(tl, {str(tmp_path / 'p.html')!r})\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def _need_chromium() -> None:
    """In CI (CI=true; .ci/run installs chromium with apt-get) a missing chromium is a failure; elsewhere a skip."""
    if CHROMIUM is not None:
        return
    how = "apt-get install -y chromium"
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"chromium is not installed, and CI must check the report in a real browser: {how}")
    pytest.skip(f"chromium is not installed (outside CI; {how})")


def test_html_renders_in_headless_chromium(root: Path, tmp_path: Path):
    import matplotlib.pyplot as plt
    import numpy as np

    _need_chromium()

    page = report.write_html(report.timeline(root), tmp_path / "timeline.html")
    shot = tmp_path / "shot.png"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        f"--screenshot={shot}",
        "--window-size=1200,900",
        page.resolve().as_uri(),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.exists(), res.stderr[-2000:]
    img = plt.imread(str(shot))
    assert img.shape[0] >= 800 and img.shape[1] >= 1100
    rgb = np.round(img[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    colours = np.unique(rgb, axis=0)
    assert len(colours) > 50  # text, markers, antialiasing: not blank
    non_white = (rgb < 245).any(axis=1).mean()
    assert non_white > 0.02
    # the picture drew: some clearly green (certified) and clearly red (rejected / sdc) pixels on screen
    r, g, b = (rgb[:, i].astype(int) for i in range(3))
    assert ((g > 120) & (g - r > 60) & (g - b > 60)).sum() > 20
    assert ((r > 170) & (r - g > 100) & (r - b > 100)).sum() > 20


def test_every_attempt_and_run_incarnation_is_in_the_timeline(tmp_path: Path):
    """Step 20 was interrupted by a crash in run 1, run 2 resumed from 10 and saved 20 again: both attempts of 20
    appear (the first as interrupted, not current), and each run says where it resumed and what it saved."""
    root = tmp_path / "run"
    root.mkdir()
    with Ledger.open(root, create=True) as lg:
        lg.begin_run("20261130T000000-aaaa0001", world_size=2, topology={"mode": "ddp"}, policy={"require": ["bytes"]})
        lg.record_writing(10, "20261130T000000-aaaa0001", "aaaa0001-1", step_dirname(10))
        lg.record_commit(
            10,
            run_id="20261130T000000-aaaa0001",
            path=step_dirname(10),
            nbytes=1,
            manifest_digest="m",
            files=[],
            evidence=BYTES_PASS,
            state="certified",
            reasons=[],
            attempt="aaaa0001-1",
        )
        _interrupted(lg, 20, "20261130T000000-aaaa0001", "aaaa0001-2")
        lg.begin_run(
            "20261130T000100-bbbb0002",
            world_size=2,
            topology={"mode": "ddp"},
            policy={"require": ["bytes"]},
            resumed_from=10,
        )
        lg.record_writing(20, "20261130T000100-bbbb0002", "bbbb0002-1", step_dirname(20))
        lg.record_commit(
            20,
            run_id="20261130T000100-bbbb0002",
            path=step_dirname(20),
            nbytes=1,
            manifest_digest="m",
            files=[],
            evidence=BYTES_PASS,
            state="certified",
            reasons=[],
            attempt="bbbb0002-1",
        )
    tl = report.timeline(root)
    tries = [(a["step"], a["label"], a["current"], a["run_id"]) for a in tl["attempts"]]
    assert tries == [
        (10, "certified", True, "20261130T000000-aaaa0001"),
        (20, "interrupted", False, "20261130T000000-aaaa0001"),
        (20, "certified", True, "20261130T000100-bbbb0002"),
    ]
    runs = {r["id"]: (r["resumed_from"], r["first_step"], r["last_step"]) for r in tl["runs"]}
    assert runs == {"20261130T000000-aaaa0001": (None, 10, 20), "20261130T000100-bbbb0002": (10, 20, 20)}
    page = report.render_html(tl)
    assert "interrupted then certified" in page and "step 10" in page and "{" not in page.split("<h2>Events")[1]
    # without an observer, the interrupted attempt is the only record of the crash: the text view says it too
    assert [(e["kind"], e["step"]) for e in tl["events"]] == [("crash", 20)], tl["events"]
    console = Console(width=200, record=True, color_system=None)
    console.print(report.render_table(tl))
    text = console.export_text()
    assert "1 events: crash 1" in text and "save interrupted" in text, text
    assert "2 run(s)" in text and "resumed from step 10" in text, text


def test_event_details_read_as_sentences_with_dates_and_durations():
    """A crash recorded by the next generation: one clause per rank, wall times as dates, durations in units,
    no all-zero fingerprints."""
    from scout_ckpt.ops.views import detail_text, time_text

    t = 1796171392.33
    text = detail_text(
        {
            "source": "previous_generation",
            "stall_s": 75.0,
            "first_stopped": [1],
            "progress": [
                {"rank": 1, "state": "gone", "step": 7, "phase": "step", "fp": "0000000000000000", "gone_at": t},
                {
                    "rank": 0,
                    "state": "gone",
                    "step": 7,
                    "phase": "forward",
                    "fp": "00000000000000a1",
                    "last_heartbeat": t,
                },
            ],
        }
    )
    assert f"rank 1: state gone; step 7; phase step; gone at {time_text(t)}" in text, text
    assert f"| rank 0: state gone; step 7; phase forward; fp 00000000000000a1; last heartbeat {time_text(t)}" in text
    assert "stall s: 1 min 15 s" in text and "0000000000000000" not in text and "1.8e+09" not in text


def test_explain_says_which_replicas_disagreed_on_which_target_and_step():
    from scout_ckpt.ops.views import explain_lines

    out = {
        "step": 20,
        "state": "rejected",
        "policy": {"require": ["replay"]},
        "reasons": [],
        "events": [],
        "evidence": {
            "replay": {
                "status": "inconclusive",
                "source": "save",
                "recorded": None,
                "reasons": [
                    {
                        "code": "replay_inconclusive",
                        "ranks": [0, 1],
                        "target": "h.1",
                        "recipe": "block",
                        "step": 18,
                        "live_step": True,
                    }
                ],
                "live_checked_ranks": [1],
                "live_rotation": "every rank's live step within 2 saves",
                "coverage": {"h.0": 18, "h.1": None},
                "confirmed_after": {"h.0": 20, "h.1": None},
            }
        },
    }
    text = "\n".join(explain_lines(out, "ROOT/step-00000020", time.time(), lambda s: s))
    assert "h.1" in text and "replicas DISAGREED at step 18" in text and "no strict majority among ranks 0,1" in text
    assert "NOT COVERED" not in text and "awaiting its first replay" not in text, text
    assert "not with the live step" in text and "live step checked: rank(s) 1 (every rank's live step within 2" in text


def _svg_group(svg: str, gid: str) -> str:
    m = re.search(rf'<g id="{re.escape(gid)}">(.*?)\n   </g>', svg, re.S)
    assert m, f"no mark {gid!r} in the picture"
    return m.group(1)


def _bar_x(svg: str, gid: str) -> tuple[float, float]:
    """The x extent of a run's bar (a two-point path) in the SVG's own coordinates."""
    xs = [float(x) for x in re.findall(r"[ML] ([-\d.]+) [-\d.]+", _svg_group(svg, gid))]
    return min(xs), max(xs)


def _marks_x(svg: str, gid: str) -> list[float]:
    return sorted(float(x) for x in re.findall(r'<use [^>]*\bx="([-\d.]+)"', _svg_group(svg, gid)))


def test_a_runs_bar_ends_where_it_died_not_at_its_last_save(tmp_path: Path):
    """Run 1 saved 10 and 20, then rank 1 died at step 27 (the crash the next generation recorded); run 2
    resumed from 20 and saved 30. The document says where run 1 died, and in the picture its bar ends at the
    crash's mark, past its last checkpoint; run 2, which did not die, ends at its last save."""
    root = tmp_path / "run"
    root.mkdir()
    t0 = time.time() - 100
    with Ledger.open(root, create=True) as lg:
        lg.begin_run("r1", world_size=2, topology={"mode": "ddp"}, policy={"require": ["bytes"]})
        _commit(lg, 10, "r1", "certified")
        _commit(lg, 20, "r1", "certified")
        lg.add_event("crash", step=27, ranks=[1], detail={"attribution": "first_gone"}, run_id="r1", when=t0 + 27)
        lg.begin_run("r2", world_size=2, topology={"mode": "ddp"}, policy={"require": ["bytes"]}, resumed_from=20)
        _commit(lg, 30, "r2", "certified")
    tl = report.timeline(root)
    runs = {r["id"]: r for r in tl["runs"]}
    assert (runs["r1"]["last_step"], runs["r1"]["end_step"]) == (20, 27)
    assert runs["r1"]["died"] == {"kind": "crash", "step": 27, "time": pytest.approx(t0 + 27), "ranks": [1]}
    assert (runs["r2"]["last_step"], runs["r2"]["end_step"], runs["r2"]["died"]) == (30, 30, None)

    svg = report.render_svg(tl).decode()
    saved = _marks_x(svg, "checkpoints-certified")  # steps 10, 20, 30, left to right
    crash = _marks_x(svg, "kind-crash")
    assert len(saved) == 3 and len(crash) == 1
    start1, end1 = _bar_x(svg, "run-1")
    start2, end2 = _bar_x(svg, "run-2")
    assert end1 == pytest.approx(crash[0], abs=0.01) and end1 > saved[1] + 1  # past its last save, at the crash
    assert start2 == pytest.approx(saved[1], abs=0.01) and end2 == pytest.approx(saved[2], abs=0.01)
    assert "died at step 27" in report.render_html(tl)


def test_a_save_interrupted_by_the_observers_abort_is_not_a_second_fault(tmp_path: Path):
    """Run 1 saved 10; rank 1 hung at step 13 and the observer aborted the job while the others were inside the
    save of step 14. The report tells one incident, the hang, and keeps the save's attempt as interrupted; a
    save interrupted in run 2, which no recorded incident ended, is still the crash it is."""
    root = tmp_path / "run"
    root.mkdir()
    t0 = time.time() - 100
    with Ledger.open(root, create=True) as lg:
        lg.begin_run("r1", world_size=3, topology={"mode": "ddp"}, policy={"require": ["bytes"]})
        _commit(lg, 10, "r1", "certified")
        lg.add_event(
            "hang",
            step=13,
            ranks=[1],
            detail={"attribution": "strict_majority", "action": "abort"},
            run_id="r1",
            when=t0 + 14,
        )
        _interrupted(lg, 14, "r1", "r1-2")
        lg.begin_run("r2", world_size=3, topology={"mode": "ddp"}, policy={"require": ["bytes"]}, resumed_from=10)
        _interrupted(lg, 20, "r2", "r2-1")
    tl = report.timeline(root)
    assert [(e["kind"], e["step"], e["run_id"]) for e in tl["events"]] == [("hang", 13, "r1"), ("crash", 20, "r2")]
    assert [(a["step"], a["label"]) for a in tl["attempts"]] == [
        (10, "certified"),
        (14, "interrupted"),
        (20, "interrupted"),
    ], tl["attempts"]
