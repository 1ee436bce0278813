"""Campaign scenario `node_loss`: a whole node of a two-node fast-tier job is lost, and the job comes back from the
peer copies (bench/campaign.py --kinds node_loss).

Every incident is the user's DDP job with the fast tier (tests/scripts/fast_tier_job.py: local saves every
LOCAL_EVERY steps, durable saves every SAVE_EVERY) under two torchrun agents on this host sharing a c10d endpoint,
as on two nodes, NPROC workers each, each agent with its own "node-local" directory. At a step drawn from the
seed, node 1 is lost: its agent and its workers are SIGKILLed (`--fault node`, after the last local commit has
landed, so the step a restart must load is known) and its local directory is removed; a fresh launch of both
agents (a replacement node with an empty disk) trains to the end.

Judged only from what the job printed (FT-JOB lines: the sha256 of its model and optimizer at every save, of what
it loaded, the time of every step), never from scout-ckpt's own verdicts:

  expected     the newest step saved (local or durable) before the fault: nothing certified may be lost
  detected     every rank of the relaunch loaded the expected step with the digest that rank printed when it
               saved it (a resume to an older step loses certified work: not detected; to a digest that differs:
               a bad resume)
  blamed/truth the ranks whose files the relaunch fetched from a peer node / the lost node's ranks
  lost_steps   steps redone: the fault step less the step loaded
  latency_s    time to training again: from the fault (the killed worker's own clock) to the relaunch's first
               finished step; back_at_fault_step_s: to the relaunch's return to the fault step. Both include
               this campaign's relaunch of two torchrun agents (their start-up, rendezvous and imports), which a
               scheduler replacing a node would add to as well.

HEALTHY: the same job without a fault, then a relaunch that only loads: a false positive is a failed launch, a
restart, a live fault, a rejected local step, or a relaunch that does not load the last step with its digest.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "fast_tier_job.py"
NNODES, NPROC = 2, 2
STEPS, SAVE_EVERY, LOCAL_EVERY = 16, 8, 2
STEP_SLEEP = 0.1
LOST_NODE = 1  # node 0's agent hosts the rendezvous store: the lost node is never the host


def _plan(i, rng, world_sizes):
    return {"ranks": NNODES * NPROC, "step": rng.randint(3, STEPS - 1)}


def _agents(root: Path, dirs: list[Path], args: list[str], max_restarts: int, timeout: float = 900.0):
    """NNODES torchrun agents as on NNODES hosts; [(returncode, stdout, stderr)] per node, after all exit (124:
    timed out)."""
    from scout_ckpt.testing.agents import run_agents

    job = [
        root,
        "--steps",
        STEPS,
        "--save-every",
        SAVE_EVERY,
        "--local-every",
        LOCAL_EVERY,
        "--step-sleep",
        STEP_SLEEP,
        *args,
    ]
    done = run_agents(
        SCRIPT,
        job,
        nnodes=NNODES,
        nproc=NPROC,
        repo=REPO,
        max_restarts=max_restarts,
        node_env={n: {"SCOUT_TEST_LOCAL_DIR": str(d)} for n, d in enumerate(dirs)},
        first_hosts=True,
        timeout=timeout,
        timed_out_rc=124,
    )
    return [(r.returncode, r.stdout, r.stderr) for r in done]


def _lines(results) -> list[dict]:
    dec = json.JSONDecoder()
    return [dec.raw_decode(chunk)[0] for _, so, _ in results for chunk in so.split("FT-JOB ")[1:]]


def _saved(lines) -> dict[tuple[int, int], str]:
    """{(rank, step): digest} of every save (local or durable) as the job computed it: the oracle."""
    return {(e["rank"], e["step"]): e["digest"] for e in lines if e["event"] in ("local_saved", "saved")}


def _rejected_local(root: Path) -> list[int]:
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.save import local_tier_rows

    if not (root / "scout-ledger.db").exists():
        return []
    with Ledger.open(root, readonly=True) as led:
        return [r["step"] for r in local_tier_rows.rows(led) if r["state"] == "rejected"]


def _judge_loads(loads: dict[int, dict], saved: dict, expected: int) -> tuple[bool, list[str]]:
    """(every rank loaded `expected` with its saved digest, what is wrong with the loads: bad resumes)."""
    bad = [
        f"rank {r} loaded step {e['step']} ({e['tier']}) whose digest is not the one it saved"
        for r, e in sorted(loads.items())
        if e["step"] and e["digest"] != saved.get((r, e["step"]))
    ]
    bad += [
        f"rank {r} loaded step {e['step']}, after the newest step saved before the fault ({expected})"
        for r, e in sorted(loads.items())
        if e["step"] > expected
    ]
    ok = sorted(loads) == list(range(NNODES * NPROC)) and all(e["step"] == expected for e in loads.values())
    return ok and not bad, bad


def _run(inc: dict, work: Path) -> dict:
    base = work / inc["id"]
    root, dirs = base / "run", [base / f"node-disk-{i}" for i in range(NNODES)]
    fault_step = inc["step"]
    t0 = time.monotonic()
    first = _agents(
        root, dirs, ["--fault", "node", "--fault-node", str(LOST_NODE), "--fault-step", str(fault_step)], max_restarts=0
    )
    marker = root / "fault.json"
    fault = json.loads(marker.read_text()) if marker.exists() else None
    out = {
        "id": inc["id"],
        "kind": "node_loss",
        "ranks": NNODES * NPROC,
        "fault_step": fault_step,
        "job": {
            "nodes": NNODES,
            "per_node": NPROC,
            "steps": STEPS,
            "save_every": SAVE_EVERY,
            "local_every": LOCAL_EVERY,
            "step_sleep_s": STEP_SLEEP,
        },
        "truth": list(range(LOST_NODE * NPROC, (LOST_NODE + 1) * NPROC)),
        "fired": fault is not None,
        "detected": False,
        "blamed": [],
        "latency_s": None,
        "resume_step": None,
        "no_resume": True,
        "bad_resume": False,
        "bad_resume_detail": [],
        "clean_rejected": [],
    }
    if fault is None:
        out["stderr_tail"] = first[-1][2][-600:]
        return out
    lines1 = _lines(first)
    saved = _saved(lines1)
    run1 = next(e["run_id"] for e in lines1 if e["event"] == "loaded")
    before = [s for (_, s) in saved if s < fault_step]
    expected = max(before) if before else 0
    shutil.rmtree(fault["local_dir"], ignore_errors=True)  # the node and its disk are gone
    marker.unlink()
    relaunch_at = time.time()
    second = _agents(root, dirs, [], max_restarts=0)
    lines2 = _lines(second)
    loads = {e["rank"]: e for e in lines2 if e["event"] == "loaded"}
    steps = [e for e in lines2 if e["event"] == "at"]
    first_step = min((e["time"] for e in steps), default=None)
    back = min((e["time"] for e in steps if e["step"] == fault_step), default=None)
    ok, bad = _judge_loads(loads, saved, expected)
    loaded = sorted({(e["step"], e["tier"]) for e in loads.values()})
    out.update(
        run1=run1,
        expected_step=expected,
        loaded=loaded,
        rc=[r for r, _, _ in first + second],
        detected=ok,
        blamed=sorted({r for e in loads.values() for r in (e.get("fetched") or [])}),
        resume_step=loaded[0][0] if len(loaded) == 1 else None,
        no_resume=not loads,
        lost_steps=fault_step - min((e["step"] for e in loads.values()), default=0),
        latency_s=None if first_step is None else round(first_step - fault["time"], 3),
        back_at_fault_step_s=None if back is None else round(back - fault["time"], 3),
        relaunch_gap_s=round(relaunch_at - fault["time"], 3),
        finished=any(e["step"] == STEPS for e in steps) or any(e["step"] == STEPS for e in loads.values()),
        bad_resume=bool(bad),
        bad_resume_detail=bad,
        wall_s=round(time.monotonic() - t0, 1),
    )
    if any(r != 0 for r, _, _ in second):
        out["stderr_tail"] = next(se for r, _, se in second if r != 0)[-600:]
    return out


def _healthy(work: Path, seed: int) -> dict:
    root, dirs = work / "run", [work / f"node-disk-{i}" for i in range(NNODES)]
    t0 = time.monotonic()
    first = _agents(root, dirs, [], max_restarts=0)
    lines1 = _lines(first)
    saved = _saved(lines1)
    second = _agents(root, dirs, [], max_restarts=0)  # nothing left to train: loads the last step and ends
    loads = {e["rank"]: e for e in _lines(second) if e["event"] == "loaded"}
    ok, bad = _judge_loads(loads, saved, STEPS)
    runs = {e["run_id"] for e in lines1 if e["event"] == "loaded"}
    events = {"live_fault": sum(1 for e in lines1 if e["event"] == "live_fault")}
    if len(runs) > 1:
        events["restart"] = len(runs) - 1
    rejections = {"local_rejected": len(_rejected_local(root))}
    rcs = [r for r, _, _ in first + second]
    alarms = {
        "events": {k: v for k, v in events.items() if v},
        "rejections": {k: v for k, v in rejections.items() if v},
    }
    return {
        "id": "node_loss_healthy",
        "kind": "healthy",
        "mode": "torchrun-2-agents-fast-tier",
        "async": False,
        "ranks": NNODES * NPROC,
        "rc": rcs,
        "wall_s": round(time.monotonic() - t0, 1),
        "alarms": alarms,
        "false_positive": bool(alarms["events"] or alarms["rejections"]) or any(rcs) or not ok,
        "bad_resume": bool(bad),
        "bad_resume_detail": bad,
        "no_resume": not loads,
        "resume_step": min((e["step"] for e in loads.values()), default=None),
    }


def _fp(h: dict) -> bool:
    return h.get("id") == "node_loss_healthy" and h["false_positive"]


SCENARIOS = {"node_loss": {"plan": _plan, "run": _run, "false_positive": _fp}}
HEALTHY = {"control": _healthy}
