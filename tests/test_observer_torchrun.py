"""The observer on a user's DDP and FSDP2 scripts under real `torchrun --max-restarts` (CPU/gloo ranks).

One torchrun job goes through several faults, one per generation (tests/scripts/observed_job.py --faults):
each abort or crash ends the generation, torchrun starts the next, which resumes from the newest clean step.
Every verdict is read back through `scout-ckpt report --json`, the operator's view. Timings are printed, and
asserted only against the process-group timeout (the machine is shared: never a tight bound).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.placement import place

SCRIPT = REPO / "tests" / "scripts" / "observed_job.py"
# Longer than a whole torchrun run may take (its subprocess timeout, 900 s): a hang the observer did not abort
# outlives the run and fails it, so a finished run proves each hang was ended by the abort, with no duration
# asserted.
PG_TIMEOUT = 1200.0
STALL_S = 3.0
SAVE_EVERY = 5  # observed_job.py's default


def newest_save_before(step: int) -> int:
    """The step a generation whose fault struck inside `step` resumes from: its save never ran."""
    return SAVE_EVERY * ((step - 1) // SAVE_EVERY)


def fault_plan(request, kinds: list[str], world: int, straggler: bool) -> tuple[str, list, list[int]]:
    """One fault per generation, each at a rank and step placed by the seed: any rank; a step 6 to 10 steps after
    the generation's resume (past its first save and DDP's first steps, so the fault's step never is the resume's
    and the last step every rank finished is one of this generation's). Then, if asked, a straggler for the rest
    of the run. Returns the --faults text, the placements, and the resume step of every generation."""
    plan, pls, resumed = [], [], [0]
    for attempt, kind in enumerate(kinds):
        pl = place(request, ranks=range(world), steps=range(resumed[-1] + 6, resumed[-1] + 11))
        plan.append(f"{attempt}:{kind}:{pl.rank}:{pl.step}")
        pls.append(pl)
        resumed.append(newest_save_before(pl.step))
    if straggler:
        pl = place(request, ranks=range(world))
        plan.append(f"{len(kinds)}:straggler:{pl.rank}:0")
        pls.append(pl)
    return ",".join(plan), pls, resumed


pytestmark = [pytest.mark.slow, pytest.mark.timing]  # timing: `make stress` runs it under load


def torchrun(root: Path, nproc: int, restarts: int, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.5",
        str(SCRIPT),
        str(root),
        "--stall-s",
        str(STALL_S),
        "--pg-timeout",
        str(PG_TIMEOUT),
        "--action",
        "abort",
        *args,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def report(root: Path) -> dict:
    rc, out, err = run_cli("report", root, "--json")
    assert rc == 0, err
    return json.loads(out)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def faults(root: Path) -> dict[int, dict]:
    return {f["attempt"]: f for f in (json.loads(p.read_text()) for p in root.glob("fault-*.json"))}


def back_to_training_s(root: Path, attempt: int) -> float:
    """From the fault in generation `attempt` to the next generation's first finished step."""
    t_fault = faults(root)[attempt]["time"]
    nxt = [p["time"] for p in jsonl(root / "progress.jsonl") if p["attempt"] == attempt + 1]
    return min(nxt) - t_fault


def last_generation_busy(root: Path) -> dict:
    """What the straggler rules saw in the last generation, per rank: (steps, busy seconds, step seconds, median
    compute per step from the step stamps, the wait for a CPU left out: observer/cpuwait.py); printed when a
    straggler is missed."""
    from statistics import median

    channels = sorted((root / "reports" / ".observer").iterdir(), key=lambda p: p.stat().st_mtime)
    rows = {}
    for p in channels[-1].glob("status-*.json"):
        row = json.loads(p.read_text())
        compute = [a - left - waited for _s, left, a, waited in row.get("stamps") or []]
        rows[row["rank"]] = (
            row["n_steps"],
            round(row["busy_sum"], 3),
            round(row["dur_sum"], 3),
            round(median(compute), 4) if compute else None,
        )
    return rows


def observer_events(rep: dict, hung_in_optimizer: list) -> list[dict]:
    """The report's events in time order. A rank that hangs inside its optimizer step at a save step leaves the
    others inside that save (neither DDP's nor FSDP2's optimizer step has a collective), so the abort interrupts
    the save: the report tells that generation's end once, as the hang (report/timeline.py), and lists no crash
    for the interrupted save."""
    events = sorted(rep["events"], key=lambda e: e["time"])
    assert not [e for e in events if e["detail"].get("save_interrupted")], (hung_in_optimizer, events)
    return events


def run_ids(rep: dict) -> list[str]:
    """The generations (runs) in the order they started."""
    return [r["id"] for r in sorted(rep["runs"], key=lambda r: r["started"])]


def test_fsdp2_ranks_inside_a_save_while_a_peer_hangs_in_its_optimizer_are_no_desync(tmp_path):
    """The table the FSDP2 scenario's observers saw (seed 237106): ranks 0 and 1 finished step 10 and wait in the
    save's gather, off the watched groups; rank 2 hangs in its optimizer step, its latest traced collective the
    backward's reduce-scatter at native position 90, which ranks 0 and 1 issued too. Their heartbeats keep
    position 90 and say their fingerprint is a later one's (OFF_WATCH): no position says "native" against rank
    2's fingerprint, and after stall_s it is a hang of rank 2, not a desync. Read back through a real heartbeat."""
    from scout_ckpt.observer.heartbeat import Heartbeat, HeartbeatReader
    from scout_ckpt.observer.verdicts import attribute

    hb = Heartbeat.create(str(tmp_path / "hb"))
    hb.enter(108, 0xA, pos=90)  # the reduce-scatter, on a watched group
    hb.leave(108)
    hb.enter(109, 0xB)  # the save's gather, off them
    snap = HeartbeatReader(str(tmp_path / "hb")).snapshot()
    assert (snap.pos_enter, snap.off_watch, snap.fp_enter, snap.in_coll) == (90, True, 0xB, True)
    hb.leave(109)
    hb.enter(110, 0xC, pos=91)  # the next forward's all-gather: its fingerprint is position 91's again
    snap = HeartbeatReader(str(tmp_path / "hb")).snapshot()
    assert (snap.pos_enter, snap.off_watch) == (91, False)
    hb.close()

    def row(rank, seq, fp, *, in_coll, off_watch, phase, step, age):
        return {
            "rank": rank,
            "state": "running",
            "step": step,
            "seq": seq,
            "fp": fp,
            "in_coll": in_coll,
            "in_side": False,
            "error": False,
            "phase": phase,
            "cseq": 90,
            "pos": 90,
            "off_watch": off_watch,
            "age_s": age,
        }

    for age in (2.0, 4.0):  # before and after stall_s (3 s)
        rows = {
            0: row(0, 109, "9051", in_coll=True, off_watch=True, phase="checkpoint", step=10, age=age),
            1: row(1, 109, "9051", in_coll=True, off_watch=True, phase="checkpoint", step=10, age=age),
            2: row(2, 108, "2b12", in_coll=False, off_watch=False, phase="optimizer", step=9, age=age),
        }
        verdict = attribute(rows, 3, 3.0)
        assert (verdict or {}).get("kind") != "desync", verdict
        if age > 3.0:
            assert verdict["kind"] == "hang" and verdict["ranks"] == [2], verdict
    # the rule needs the kept position: with 0 there (as for a rank that never traced a watched collective)
    # ranks 0 and 1 read as "native" at 90 against rank 2's fingerprint, a desync
    rows = {r: {**v, "off_watch": False, "pos": v["pos"] if r == 2 else 0} for r, v in rows.items()}
    assert attribute(rows, 3, 3.0)["kind"] == "desync"


@pytest.mark.scenario
@pytest.mark.scenario_ci  # the CI tier's straggler (and a user's DDP job hanging at 3 ranks, desync, crash)
def test_ddp_job_hangs_desync_crash_and_straggler_under_torchrun(tmp_path, request):
    """3 ranks, DDP: a rank hangs before backward; then a rank issues an extra all_reduce; then a rank is
    SIGKILLed; then a rank hangs inside its optimizer step; then a rank computes 3x as long every step (ranks and
    steps placed by the seed). Each is named, each aborted generation is resumed from the newest clean step, and
    the job finishes."""
    plan, pls, resumed = fault_plan(
        request, ["hang-before-backward", "extra-collective", "kill", "hang-in-optimizer"], 3, straggler=True
    )
    p_hang, p_desync, p_kill, p_opt, p_slow = pls
    root = tmp_path / "run"
    torchrun(root, 3, 4, "--model", "ddp", "--steps", "70", "--compute-s", "0.05", "--faults", plan)
    attempts = jsonl(root / "attempts.jsonl")
    assert [a["resumed_from"] for a in attempts] == resumed, (pls, attempts)
    assert {a["attached"] for a in attempts} == {"counted"}, pls  # no DDP comm hook: its all-reduces are counted
    assert max(p["step"] for p in jsonl(root / "progress.jsonl")) == 70, pls
    rep = report(root)
    events = observer_events(rep, [p_opt])
    kinds = [(e["kind"], e["ranks"]) for e in events]
    assert kinds == [
        ("hang", [p_hang.rank]),
        ("desync", [p_desync.rank]),
        ("crash", [p_kill.rank]),
        ("hang", [p_opt.rank]),
        ("straggler", [p_slow.rank]),
    ], (pls, kinds, last_generation_busy(root))
    hang, desync, crash, hang_opt, straggler = events
    assert hang["detail"]["attribution"] == "strict_majority" and hang["detail"]["action"] == "abort", pls
    assert "injected_hang_before_backward" in hang["detail"]["stacks"][str(p_hang.rank)], pls
    assert hang["step"] == p_hang.step - 1, (pls, hang)  # the last step every rank finished
    counts = {row["rank"]: row["cseq"] for row in hang["detail"]["progress"]}
    others = {c for r, c in counts.items() if r != p_hang.rank}
    # DDP's bucket all-reduces are counted (natively): the others issued the ones the hung rank never did
    assert len(others) == 1 and others.pop() > counts[p_hang.rank] > 0, (pls, counts)
    assert desync["detail"]["attribution"] == "strict_majority", pls
    assert crash["step"] == p_kill.step - 1, (pls, crash)
    assert "injected_hang_in_optimizer" in hang_opt["detail"]["stacks"][str(p_opt.rank)], pls
    assert {row["rank"]: row["phase"] for row in hang_opt["detail"]["progress"]}[p_opt.rank] == "optimizer", pls
    # 3x its whole step: named by its compute per step from the step stamps (the optimizer's step to the next
    # forward), exact, not by the sampled arrival (was named in 2 of 4 runs at 25 Hz)
    assert straggler["detail"]["measure"] == "compute_stamps" and straggler["detail"]["slowdown"] > 1.5, (
        pls,
        straggler,
    )
    # each fault in its own generation; the straggler only in the last, where its rank was slow
    assert [e["run_id"] for e in events] == run_ids(rep), pls
    for attempt, ev in ((0, hang), (3, hang_opt)):
        took = back_to_training_s(root, attempt)
        detect = ev["time"] - faults(root)[attempt]["time"]
        print(
            f"\nDDP hang ({faults(root)[attempt]['fault']}): detected and aborted after {detect:.1f}s "
            f"(stall_s {STALL_S}); training again after {took:.1f}s"
        )
        # the order the records give: the fault, then the observer's event, then the next generation training
        assert faults(root)[attempt]["time"] < ev["time"] < faults(root)[attempt]["time"] + took, pls


@pytest.mark.scenario
def test_fsdp2_job_hangs_desync_and_straggler_under_torchrun(tmp_path, request):
    """3 ranks, FSDP2 (fully_shard per layer): a rank hangs inside its optimizer step; then a rank issues an
    extra all_reduce; then a rank hangs before its backward; then a rank computes 3x as long every step (ranks
    and steps placed by the seed)."""
    plan, pls, resumed = fault_plan(
        request, ["hang-in-optimizer", "extra-collective", "hang-before-backward"], 3, straggler=True
    )
    p_opt, p_desync, p_bwd, p_slow = pls
    root = tmp_path / "run"
    torchrun(root, 3, 3, "--model", "fsdp", "--steps", "50", "--compute-s", "0.05", "--faults", plan)
    attempts = jsonl(root / "attempts.jsonl")
    assert [a["resumed_from"] for a in attempts] == resumed, (pls, attempts)
    assert {a["attached"] for a in attempts} == {"fsdp2"}, pls
    assert max(p["step"] for p in jsonl(root / "progress.jsonl")) == 50, pls
    rep = report(root)
    events = observer_events(rep, [p_opt])
    kinds = [(e["kind"], e["ranks"]) for e in events]
    assert kinds == [
        ("hang", [p_opt.rank]),
        ("desync", [p_desync.rank]),
        ("hang", [p_bwd.rank]),
        ("straggler", [p_slow.rank]),
    ], (pls, kinds, last_generation_busy(root))
    hang, _desync, hang_bwd, straggler = events
    assert "injected_hang_in_optimizer" in hang["detail"]["stacks"][str(p_opt.rank)], pls
    table = {row["rank"]: row for row in hang["detail"]["progress"]}
    assert table[p_opt.rank]["phase"] == "optimizer", (pls, table)
    others = [r for r in range(3) if r != p_opt.rank]
    # FSDP2's all-gathers are traced, and counted; at a save step the others wait in the save's gather, traced
    # but off the watched groups: one traced collective more, no native one more
    assert table[others[0]]["seq"] == table[others[1]]["seq"] > table[p_opt.rank]["seq"] > 0, (pls, table)
    cseq = [table[others[0]]["cseq"], table[others[1]]["cseq"], table[p_opt.rank]["cseq"]]
    if p_opt.step % SAVE_EVERY == 0:
        assert cseq[0] == cseq[1] == cseq[2] > 0, (pls, table)
    else:
        assert cseq[0] == cseq[1] > cseq[2] > 0, (pls, table)
    assert "injected_hang_before_backward" in hang_bwd["detail"]["stacks"][str(p_bwd.rank)], pls
    assert straggler["detail"]["slowdown"] > 1.5, (pls, straggler)  # busy time: FSDP2's waits are traced
    assert [e["run_id"] for e in events] == run_ids(rep), pls
    for attempt, ev in ((0, hang), (2, hang_bwd)):
        took = back_to_training_s(root, attempt)
        print(f"\nFSDP2 hang ({faults(root)[attempt]['fault']}): training again after {took:.1f}s")
        # the order the records give: the fault, then the observer's event, then the next generation training
        assert faults(root)[attempt]["time"] < ev["time"] < faults(root)[attempt]["time"] + took, pls


@pytest.mark.scenario
@pytest.mark.scenario_ci  # 15-30 s on 2 cores: CI runs it in its scenario tier, keeping make test within 15 min
def test_sigkilled_rank_of_two_is_a_crash_after_the_restart(tmp_path, request):
    """2 ranks: no strict majority can name the killed rank, but the next generation records the run its
    predecessor left unfinished: a crash, unattributed, the killed rank first to stop heartbeating (rank and
    step, after the first save, placed by the seed)."""
    pl = place(request, ranks=range(2), steps=range(SAVE_EVERY + 1, 13))
    root = tmp_path / "run"
    torchrun(root, 2, 1, "--model", "ddp", "--steps", "12", "--faults", f"0:kill:{pl.rank}:{pl.step}")
    events = report(root)["events"]
    assert [(e["kind"], e["ranks"]) for e in events] == [("crash", [])], (pl, events)
    detail = events[0]["detail"]
    assert detail["source"] == "previous_generation" and detail["attribution"] == "unattributed", (pl, detail)
    assert detail["first_stopped"] == [pl.rank] and events[0]["step"] == pl.step - 1, (pl, events)
    assert jsonl(root / "attempts.jsonl")[1]["resumed_from"] == newest_save_before(pl.step), pl
