"""Campaign scenarios run under real torchrun: a user's DDP or FSDP2 script with the observer (CPU/gloo ranks).

Loaded by bench/campaign.py (`--kinds tr_hang,tr_slow,tr_desync,tr_crash`). Every incident is one
`torchrun --standalone --max-restarts 1` job of tests/scripts/observed_job.py with one fault in its first
generation, DDP and FSDP2 alternating. The observer is configured as a user would: `stall_s` and `action` only
(the straggler rule, the poll and exchange intervals and the count sampling are the product's defaults):

  tr_hang     a rank blocks forever before its backward or inside its optimizer step (alternating); the
              observers name it, `action="abort"` ends the generation, torchrun restarts it from the newest clean
              step. latency_s: from the hang to the restarted generation's first finished step (training
              again), against the process-group timeout (`pg_timeout_s`); detect_s: to the ledger event.
  tr_slow     a rank computes 3x as long every step (tr_slow_2x, tr_slow_1.5x: 2x and 1.5x); a `straggler`
              event must name it. latency_s: from its first slow step to the event.
  tr_desync   a rank issues one all_reduce the others do not (a rank-dependent branch); a `desync` must name it.
  tr_crash    a rank is SIGKILLed mid-run (2 and 3 ranks alternating); a `crash` event must be in the ledger
              after the restart (3 ranks: attributed by strict majority; 2 ranks: recorded by the next
              generation, unattributed, first_stopped naming the rank).

Judged from the ledger's events (the rank named) and from what the job itself wrote (tests/scripts/observed_job.py:
fault-N.json when the fault happened, progress.jsonl per step, attempts.jsonl per generation with the step it
resumed from). A resume is bad when a restart resumed from a step after the fault's, or when `latest_clean`
returns a step that does not verify. HEALTHY: the same script, no fault, DDP and FSDP2: any hang, desync, crash or
straggler event there is a false positive.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _campaign_common as C  # noqa: E402

REPO = C.REPO
SCRIPT = REPO / "tests" / "scripts" / "observed_job.py"
PG_TIMEOUT_S = 120.0
STALL_S = 3.0
SAVE_EVERY = 5
COMPUTE_S = 0.05  # per step, on top of the tiny model's own compute, so a slow rank's extra time is real
SLOW_STEPS = 100  # the straggler rule needs 3 confirmed windows of >= 1 s and >= 6 steps (arrival skew)
STEPS = 20
ALARMS = ("hang", "desync", "crash", "straggler", "sdc")
HANGS = ("hang-before-backward", "hang-in-optimizer")


def _models(i: int) -> str:
    return ("ddp", "fsdp")[i % 2]


def _plan_hang(i, rng, world_sizes):
    return {
        "model": _models(i),
        "ranks": 3,
        "fault": HANGS[(i // 2) % 2],
        "rank": rng.randrange(3),
        "step": rng.randint(6, 14),
        "steps": STEPS,
    }


def _plan_slow(factor):
    def plan(i, rng, world_sizes):
        return {
            "model": _models(i),
            "ranks": 3,
            "fault": "straggler",
            "rank": rng.randrange(3),
            "step": 0,
            "steps": SLOW_STEPS,
            "factor": factor,
        }

    return plan


def _plan_desync(i, rng, world_sizes):
    return {
        "model": _models(i),
        "ranks": 3,
        "fault": "extra-collective",
        "rank": rng.randrange(3),
        "step": rng.randint(6, 14),
        "steps": STEPS,
    }


def _plan_crash(i, rng, world_sizes):
    ranks = (3, 2)[i % 2]  # 3 ranks: a strict majority names the rank; 2: the next generation records it
    return {
        "model": _models(i // 2),
        "ranks": ranks,
        "fault": "kill",
        "rank": rng.randrange(1, ranks),
        "step": rng.randint(6, 14),
        "steps": STEPS,
    }


def _torchrun(root: Path, nproc: int, args: list[str], timeout: float = 900.0) -> tuple[int, float, str]:
    return C.torchrun(
        SCRIPT,
        root,
        nproc,
        [
            "--stall-s",
            str(STALL_S),
            "--pg-timeout",
            str(PG_TIMEOUT_S),
            "--action",
            "abort",
            "--save-every",
            str(SAVE_EVERY),
            *args,
        ],
        restarts=1,
        timeout=timeout,
    )


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _run(kind: str, detector: tuple[str, ...]):
    def run(inc: dict, work: Path) -> dict:
        root = work / inc["id"]
        args = [
            "--model",
            inc["model"],
            "--steps",
            str(inc["steps"]),
            "--faults",
            f"0:{inc['fault']}:{inc['rank']}:{inc['step']}",
        ]
        if inc["fault"] == "straggler":
            args += ["--compute-s", str(COMPUTE_S), "--slow-factor", str(inc["factor"])]
        else:
            args += ["--compute-s", "0.01"]
        rc, wall, err = _torchrun(root, inc["ranks"], args)
        fault = next((json.loads(p.read_text()) for p in root.glob("fault-0.json")), None)
        out = {
            "id": inc["id"],
            "kind": kind,
            "model": inc["model"],
            "ranks": inc["ranks"],
            "fault": inc["fault"],
            "truth": [inc["rank"]],
            "fired": fault is not None,
            "rc": rc,
            "wall_s": round(wall, 1),
            "pg_timeout_s": PG_TIMEOUT_S,
            "stall_s": STALL_S,
        }
        if inc.get("factor"):
            out["factor"] = inc["factor"]
        if rc != 0:
            out["stderr_tail"] = err[-600:]
        hits, blamed, detect = C.score(C.ledger(root)[0], detector, fault)
        out["events"] = [
            {
                "kind": e["kind"],
                "ranks": e["ranks"],
                "step": e["step"],
                "t": round(e["time"] - fault["time"], 3) if fault else None,
                "source": (e.get("detail") or {}).get("source"),
                "first_stopped": (e.get("detail") or {}).get("first_stopped"),
                "slowdown": (e.get("detail") or {}).get("slowdown"),
            }
            for e in hits
        ][:8]
        latency = detect
        attempts = _jsonl(root / "attempts.jsonl")
        resumed = [a["resumed_from"] for a in attempts[1:]]
        if kind == "tr_hang" and fault is not None:
            nxt = [p["time"] for p in _jsonl(root / "progress.jsonl") if p["attempt"] == 1]
            latency = (min(nxt) - fault["time"]) if nxt else None
        resume_step, bad = C.resume(root)
        if fault is not None and inc["fault"] != "straggler":
            bad += [
                f"a restart resumed from step {s}, after the fault at step {inc['step']}"
                for s in resumed
                if s >= inc["step"]
            ]
        out.update(
            detected=bool(hits),
            blamed=blamed,
            latency_s=None if latency is None else round(latency, 3),
            detect_s=None if detect is None else round(detect, 3),
            restart_resumed_from=resumed,
            finished=max((p["step"] for p in _jsonl(root / "progress.jsonl")), default=0) == inc["steps"],
            resume_step=resume_step,
            bad_resume=bool(bad),
            bad_resume_detail=bad,
            no_resume=resume_step is None,
        )
        if kind == "tr_hang":
            out["back_to_training_s"] = out["latency_s"]
        return out

    return run


def _healthy(model: str):
    def make(work: Path, seed: int) -> dict:
        root = work
        rc, wall, _err = _torchrun(root, 3, ["--model", model, "--steps", "40", "--compute-s", str(COMPUTE_S)])
        counts = C.alarm_counts(C.ledger(root)[0], ALARMS)
        resume_step, bad = C.resume(root)
        attempts = _jsonl(root / "attempts.jsonl")
        return {
            "id": f"tr_healthy-{model}",
            "kind": "healthy",
            "mode": f"torchrun-{model}",
            "async": False,
            "ranks": 3,
            "rc": rc,
            "wall_s": round(wall, 1),
            "restarts": max(0, len(attempts) - 1),
            "alarms": {"events": counts, "rejections": {}},
            "false_positive": bool(counts) or rc != 0 or len(attempts) > 1,
            "bad_resume": bool(bad),
            "no_resume": resume_step is None,
            "resume_step": resume_step,
        }

    return make


def _fp(kinds: tuple[str, ...]):
    return lambda h: any(h["alarms"]["events"].get(k) for k in kinds)


SCENARIOS = {
    "tr_hang": {"plan": _plan_hang, "run": _run("tr_hang", ("hang",)), "false_positive": _fp(("hang", "desync"))},
    "tr_slow": {"plan": _plan_slow(3.0), "run": _run("tr_slow", ("straggler",)), "false_positive": _fp(("straggler",))},
    "tr_slow_2x": {
        "plan": _plan_slow(2.0),
        "run": _run("tr_slow_2x", ("straggler",)),
        "false_positive": _fp(("straggler",)),
    },
    "tr_slow_1.5x": {
        "plan": _plan_slow(1.5),
        "run": _run("tr_slow_1.5x", ("straggler",)),
        "false_positive": _fp(("straggler",)),
    },
    "tr_desync": {"plan": _plan_desync, "run": _run("tr_desync", ("desync",)), "false_positive": _fp(("desync",))},
    "tr_crash": {"plan": _plan_crash, "run": _run("tr_crash", ("crash",)), "false_positive": _fp(("crash",))},
}

HEALTHY = {"ddp": _healthy("ddp"), "fsdp": _healthy("fsdp")}
