"""Campaign scenarios on users' scripts with the defaults, under real torchrun (CPU/gloo ranks).

Loaded by bench/campaign.py (`--kinds hang2,straggler_before_forward,live_sdc`). Each incident is one
`torchrun --standalone` job of a user-shaped script, the observer and replay as a user configures them: nothing
of the straggler rule is tuned, no poll or exchange interval is set; the only observer option given is `stall_s`
(and `action`), which the documentation leaves to the user (30 s, the value a user's script here carries):

  hang2     tests/scripts/user_ddp_job.py on 2 ranks (a DDP MLP), `ObserverOptions(stall_s=30, action="abort")`:
            one rank, drawn per incident, blocks forever at a place drawn per incident (before forward, inside
            forward, before backward, inside the optimizer step; an Event wait or a sleep) at a drawn step. A
            `hang` event must name it, the abort must end the generation, torchrun's restart must finish the job.
            latency_s: from the fault to the event.
  straggler_before_forward
            user_ddp_job.py on 2, 3 or 4 ranks (drawn), `ObserverOptions(stall_s=30, action="report")`, 150
            steps, a save every 50: one rank's data loader takes 3x as long as the others' every step (before
            its forward). A `straggler` event must name it. latency_s: from its first slow step to the event.
  live_sdc  tests/scripts/live_fault_job.py, a DDP MLP with dropout and a user's math hook, `replay=True`, 2 or 3
            ranks: a forward hook on one rank adds 1e-3 to one channel of a block's output, either in the live
            forward of one save's step only (intermittent) or at every call from a drawn step on (persistent,
            the replays of that rank included). A save must be rejected with a replay reason at or after the
            fault, attributed to the rank (with 2 ranks too: every rank's self-check replays its own capture of
            the save step against its own live step, docs/replay.md), so an intermittent fault on any rank,
            the save's replay source or not, is checked at that save. latency_s: from the fault to that
            rejection.

Judged from what the job itself did (its ROOT/fault.json: the rank, the place, the step and the time the fault
struck) against the ledger. HEALTHY: user_ddp_job.py on 2 ranks and live_fault_job.py on 3 ranks, no fault: any
hang, desync, crash or straggler event, or any rejected save, is a false positive.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _campaign_common as C  # noqa: E402

REPO = C.REPO
USER_DDP = REPO / "tests" / "scripts" / "user_ddp_job.py"
LIVE = REPO / "tests" / "scripts" / "live_fault_job.py"
STALL_S = 30.0  # the user's choice (user_ddp_job.py's default observer option)
HANG_PLACES = ("before-forward", "in-forward", "before-backward", "in-optimizer")
HANG_STEPS, HANG_SAVE_EVERY = 30, 10
SLOW_STEPS, SLOW_SAVE_EVERY = 150, 50  # the shape: 150 steps, a save every 50
LIVE_STEPS, LIVE_SAVE_EVERY = 12, 4
LIVE_MODULES = ("blocks.0", "blocks.1", "blocks.2")
ALARMS = ("hang", "desync", "crash", "straggler", "sdc")
REPLAY_CODES = ("replay_sdc", "replay_inconclusive")


_torchrun, _ledger, _resume = C.torchrun, C.ledger, C.resume


def _fault(root: Path) -> dict | None:
    try:
        return json.loads((root / "fault.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# ---- plans ----------------------------------------------------------------------------------------------------


def _plan_hang2(i, rng, world_sizes):
    return {
        "ranks": 2,
        "rank": rng.randrange(2),
        "where": rng.choice(HANG_PLACES),
        "how": rng.choice(("event", "sleep")),
        "step": rng.randint(6, HANG_STEPS - 5),
    }


def _plan_straggler(i, rng, world_sizes):
    ranks = (2, 3, 4)[i % 3]
    return {"ranks": ranks, "rank": rng.randrange(ranks), "factor": 3.0}


def _plan_live(i, rng, world_sizes):
    ranks = (3, 2)[i % 2]
    persistent = (i // 2) % 2 == 1
    saves = list(range(LIVE_SAVE_EVERY, LIVE_STEPS + 1, LIVE_SAVE_EVERY))
    step = rng.randint(2, LIVE_STEPS - 1) if persistent else rng.choice(saves)
    return {
        "ranks": ranks,
        "rank": rng.randrange(ranks),
        "step": step,
        "module": rng.choice(LIVE_MODULES),
        "persistent": persistent,
    }


# ---- runs -----------------------------------------------------------------------------------------------------


def _observer_run(kind: str, detector: str):
    def run(inc: dict, work: Path) -> dict:
        root = work / inc["id"]
        if kind == "hang2":
            args = [
                "--steps",
                str(HANG_STEPS),
                "--save-every",
                str(HANG_SAVE_EVERY),
                "--work-s",
                "0.01",
                "--observer",
                json.dumps({"stall_s": STALL_S, "action": "abort"}),
                "--hang-rank",
                str(inc["rank"]),
                "--hang-where",
                inc["where"],
                "--hang-how",
                inc["how"],
                "--hang-step",
                str(inc["step"]),
            ]
            restarts = 1
        else:
            args = [
                "--steps",
                str(SLOW_STEPS),
                "--save-every",
                str(SLOW_SAVE_EVERY),
                "--observer",
                json.dumps({"stall_s": STALL_S, "action": "report"}),
                "--slow-rank",
                str(inc["rank"]),
                "--slow-where",
                "data",
                "--slow-factor",
                str(inc["factor"]),
            ]
            restarts = 0
        rc, wall, err = _torchrun(USER_DDP, root, inc["ranks"], args, restarts=restarts)
        fault = _fault(root)
        events, _cks, runs = _ledger(root)
        hits, blamed, latency = C.score(events, (detector,), fault)
        resume_step, bad = _resume(root)
        out = {
            "id": inc["id"],
            "kind": kind,
            "ranks": inc["ranks"],
            "truth": [inc["rank"]],
            "fired": fault is not None,
            "rc": rc,
            "wall_s": round(wall, 1),
            "stall_s": STALL_S,
            "detected": bool(hits),
            "blamed": blamed,
            "latency_s": None if latency is None else round(latency, 3),
            "events": [
                {
                    "kind": e["kind"],
                    "ranks": e["ranks"],
                    "step": e["step"],
                    "t": round((e["time"] or 0) - fault["time"], 3) if fault else None,
                }
                for e in events
                if e["kind"] in ALARMS
            ][:8],
            "generations": len(runs),
            "resume_step": resume_step,
            "bad_resume": bool(bad),
            "bad_resume_detail": bad,
            "no_resume": resume_step is None,
        }
        out.update({k: inc[k] for k in ("where", "how", "step", "factor") if k in inc})
        if kind == "hang2":  # the abort ended the first generation and the restart finished the job
            out["restarted_and_finished"] = rc == 0 and len(runs) >= 2
        if rc != 0:
            out["stderr_tail"] = err[-600:]
        return out

    return run


def _live_run(inc: dict, work: Path) -> dict:
    root = work / inc["id"]
    args = [
        "--model",
        "mlp",
        "--steps",
        str(LIVE_STEPS),
        "--save-every",
        str(LIVE_SAVE_EVERY),
        "--math-hook",
        "--fault-rank",
        str(inc["rank"]),
        "--fault-step",
        str(inc["step"]),
        "--fault-module",
        inc["module"],
        "--out",
        str(root) + ".records",
        *(["--persistent"] if inc["persistent"] else []),
    ]
    rc, wall, err = _torchrun(LIVE, root, inc["ranks"], args)
    fault = _fault(root)
    _events, cks, _runs = _ledger(root)
    caught = []
    for c in sorted(cks, key=lambda c: c["step"]):
        if fault is None or c["step"] < fault["step"]:
            continue
        reasons = [
            r
            for r in (c["replay"].get("reasons") or []) + (c.get("reasons") or [])
            if isinstance(r, dict) and r.get("code") in REPLAY_CODES
        ]
        if c["state"] == "rejected" and reasons:
            caught.append((c, reasons))
    first = caught[0] if caught else None
    blamed = sorted({r for x in (first[1] if first else []) for r in x.get("ranks") or []})
    when = (first[0].get("updated") or first[0].get("committed")) if first else None
    latency = (when - fault["time"]) if first and when else None
    records = []
    for r in range(inc["ranks"]):
        try:
            records.append(json.loads((Path(str(root) + ".records") / f"rank{r}.json").read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            pass
    out = {
        "id": inc["id"],
        "kind": "live_sdc",
        "ranks": inc["ranks"],
        "truth": [inc["rank"]],
        "fired": fault is not None,
        "rc": rc,
        "wall_s": round(wall, 1),
        "step": inc["step"],
        "module": inc["module"],
        "persistent": inc["persistent"],
        "detected": bool(first),
        "blamed": blamed,
        "latency_s": None if latency is None else round(latency, 3),
        "caught_at": first[0]["step"] if first else None,
        "codes": sorted({x["code"] for x in first[1]}) if first else [],
        "live_checked": {c["step"]: c["replay"].get("live_checked_ranks") for c in cks},
        "live_state_corrupt": sorted({rec.get("live_state_corrupt") for rec in records} - {None}),
    }
    resume_step, bad = _resume(root)
    # a resume is bad when latest_clean hands out a step at or after the fault (its state carries the fault)
    if fault is not None and resume_step is not None and resume_step >= fault["step"]:
        bad.append(f"latest_clean returned step {resume_step}, at or after the fault at step {fault['step']}")
    out.update(resume_step=resume_step, bad_resume=bool(bad), bad_resume_detail=bad, no_resume=resume_step is None)
    if rc != 0:
        out["stderr_tail"] = err[-600:]
    return out


# ---- healthy controls -------------------------------------------------------------------------------------------


def _healthy_record(name: str, mode: str, ranks: int, root: Path, rc: int, wall: float) -> dict:
    events, cks, runs = _ledger(root)
    counts = C.alarm_counts(events, ALARMS)
    rejections: dict[str, int] = {}
    for c in cks:
        if c["state"] == "rejected":
            for r in c.get("reasons") or []:
                if isinstance(r, dict):
                    rejections[r.get("code")] = rejections.get(r.get("code"), 0) + 1
    resume_step, bad = _resume(root)
    return {
        "id": name,
        "kind": "healthy",
        "mode": mode,
        "async": False,
        "ranks": ranks,
        "rc": rc,
        "wall_s": round(wall, 1),
        "generations": len(runs),
        "alarms": {"events": counts, "rejections": rejections},
        "false_positive": bool(counts) or bool(rejections) or rc != 0,
        "bad_resume": bool(bad),
        "no_resume": resume_step is None,
        "resume_step": resume_step,
    }


def _healthy_user_ddp(work: Path, seed: int) -> dict:
    rc, wall, _ = _torchrun(USER_DDP, work, 2, ["--steps", "100", "--save-every", "50"])
    return _healthy_record("users-healthy-ddp2", "torchrun-user-ddp", 2, work, rc, wall)


def _healthy_live(work: Path, seed: int) -> dict:
    rc, wall, _ = _torchrun(
        LIVE,
        work,
        3,
        [
            "--model",
            "mlp",
            "--steps",
            str(LIVE_STEPS),
            "--save-every",
            str(LIVE_SAVE_EVERY),
            "--math-hook",
            "--out",
            str(work) + ".records",
        ],
    )
    return _healthy_record("users-healthy-live3", "torchrun-live-mlp", 3, work, rc, wall)


def _fp_events(*kinds):
    return lambda h: any(h["alarms"]["events"].get(k) for k in kinds)


def _fp_replay(h: dict) -> bool:
    return any(h["alarms"]["rejections"].get(c) for c in REPLAY_CODES + ("live_state_corrupt",))


SCENARIOS = {
    "hang2": {
        "plan": _plan_hang2,
        "run": _observer_run("hang2", "hang"),
        "false_positive": _fp_events("hang", "desync"),
    },
    "straggler_before_forward": {
        "plan": _plan_straggler,
        "run": _observer_run("straggler_before_forward", "straggler"),
        "false_positive": _fp_events("straggler"),
    },
    "live_sdc": {"plan": _plan_live, "run": _live_run, "false_positive": _fp_replay},
}

HEALTHY = {"user_ddp": _healthy_user_ddp, "live_mlp": _healthy_live}
