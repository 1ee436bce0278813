"""Campaign extension (bench/campaign.py imports it): FSDP2 incidents on a user's plain script under real torchrun,
with no invariant configured -- only the Checkpointer's defaults (shard update replay, at-rest check) can see them.

Kinds:
  fsdp_param  one bit of one element of one rank's local shard flips in memory, right after the optimizer step of
              a save step (what the at-rest check is for); random rank, parameter, element and bit (half of the
              draws among the 4 lowest mantissa bits, the rest anywhere but the sign)
  fsdp_optim  from a random step on, one rank's live optimizer update of one element of its shard lands one ulp
              off (a faulty ALU; persistent while the process lives)
In both, the faulty rank is SIGKILLed a few steps later and torchrun restarts the job (`--max-restarts 1`), which
resumes from the newest certified checkpoint.

Judged with the job's own oracle (examples/train_fsdp.py prints the sha256 of its full state at every save and
after loading): bad resume = the restart loaded a step at or after the fault (its state holds the fault) or a state
whose digest differs from the one printed when that step was saved. Detected: fsdp_param, the save right after
the flip was rejected with `at_rest_changed`; fsdp_optim, an `sdc` event from the shard replay. Blamed: the ranks
those name. HEALTHY: plain FSDP2 runs (2 and 3 ranks) with a rank SIGKILLed mid-run: any sdc event or rejection,
or a checkpoint left uncertified, is a false positive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "train_fsdp.py"
STEPS, SAVE_EVERY = 20, 4
SAVES = tuple(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
# examples/train_fsdp.py's model at its defaults (d 32, 2 blocks, vocab 64): every parameter's name
PARAMS = (
    "embedding.weight",
    *(f"blocks.{b}.{m}.{k}" for b in range(2) for m in ("norm", "fc1", "fc2") for k in ("weight", "bias")),
    "head.weight",
    "head.bias",
)
SHARD_CODES = (
    "at_rest_changed",
    "shard_update_mismatch",
    "shard_recompute_mismatch",
    "shard_replay_inconclusive",
    "shard_replay_failed",
)


def _job(root: Path, ranks: int, args: list, timeout: float = 900.0) -> tuple[subprocess.CompletedProcess, list, float]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.5",
        str(SCRIPT),
        str(root),
        "--steps",
        str(STEPS),
        "--save-every",
        str(SAVE_EVERY),
        *map(str, args),
    ]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    recs = [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines() if line.startswith("SCOUT-FSDP ")]
    return p, recs, time.monotonic() - t0


def _cli(*args) -> dict:
    p = subprocess.run(
        [sys.executable, "-m", "scout_ckpt.cli", *map(str, args), "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
        check=False,
    )
    try:
        return json.loads(p.stdout)
    except ValueError:
        return {}


def _alarms(root: Path) -> dict:
    """{"events": {kind: n}, "rejections": {code: n}} from the ledger, through the command line; rejections
    include those in a step's history (a rejected attempt re-saved clean after the restart)."""
    events: dict[str, int] = {}
    for e in _cli("report", root).get("events", []):
        if e["kind"] in ("sdc", "hang", "straggler", "desync"):
            events[e["kind"]] = events.get(e["kind"], 0) + 1
    rejections: dict[str, int] = {}
    for c in _cli("ls", root).get("checkpoints", []):
        for r in c.get("reasons") or []:
            rejections[r["code"]] = rejections.get(r["code"], 0) + 1
    return {"events": events, "rejections": rejections}


def _resume_judgement(recs: list, fault_step: int | None) -> tuple[int | None, list[str]]:
    saved = {(r["attempt"], r["step"]): r["digest"] for r in recs if r["event"] == "saved"}
    loaded = [r for r in recs if r["event"] == "loaded" and r["attempt"] == 1]
    if not loaded:
        return None, []
    step, digest = loaded[0]["step"], loaded[0]["digest"]
    bad = []
    if step and fault_step is not None and step >= fault_step:
        bad.append(f"the restart resumed from step {step}, whose state holds the fault of step {fault_step}")
    if step and digest != saved.get((0, step)):
        bad.append(f"the state loaded at step {step} differs from the one the job saved (its own digest)")
    return step, bad


def _record(
    inc: dict,
    p,
    recs: list,
    wall: float,
    detected: bool,
    blamed: list[int],
    t_detect: float | None,
    fault_step: int | None,
) -> dict:
    fault = next((r for r in recs if r["event"] == "fault"), None)
    resume_step, bad = _resume_judgement(recs, fault_step)
    latency = round(t_detect - fault["t"], 3) if (fault and t_detect is not None) else None
    return {
        "id": inc["id"],
        "kind": inc["kind"],
        "fired": fault is not None,
        "truth": [inc["rank"]],
        "blamed": sorted(set(blamed)),
        "detected": detected,
        "latency_s": latency,
        "resume_step": resume_step,
        "bad_resume": bool(bad),
        "bad_resume_detail": bad,
        "no_resume": resume_step in (None, 0),
        "ranks": inc["ranks"],
        "fault": fault,
        "rc": p.returncode,
        "wall_s": round(wall, 1),
        "stderr_tail": p.stderr[-1500:] if p.returncode else "",
    }


# ---- fsdp_param -------------------------------------------------------------------------------------------------


def plan_param(i, rng, world_sizes) -> dict:
    ranks = rng.choice(world_sizes)
    bit = rng.randrange(4) if rng.random() < 0.5 else rng.randrange(31)
    return {
        "ranks": ranks,
        "rank": rng.randrange(ranks),
        "step": rng.choice(SAVES[1:-2]),
        "param": rng.choice(PARAMS),
        "index": round(rng.random(), 6),
        "bit": bit,
        "kill_after": rng.randint(1, 3),
    }


def run_param(inc: dict, work: Path) -> dict:
    root = work / inc["id"]
    flip = f"{inc['rank']}:{inc['step']}:{inc['param']}:{inc['index']}:{inc['bit']}"
    p, recs, wall = _job(root, inc["ranks"], ["--flip", flip, "--kill-after-fault", inc["kill_after"]])
    save = next((r for r in recs if r["event"] == "saved" and r["attempt"] == 0 and r["step"] == inc["step"]), None)
    reasons = (save or {}).get("reasons") or []
    blamed = [k for r in reasons if r["code"] in SHARD_CODES for k in r.get("ranks") or []]
    detected = bool(save) and save["state"] == "rejected" and bool(blamed)
    return _record(inc, p, recs, wall, detected, blamed, save["t"] if detected else None, inc["step"])


# ---- fsdp_optim -------------------------------------------------------------------------------------------------


def plan_optim(i, rng, world_sizes) -> dict:
    ranks = rng.choice(world_sizes)
    return {
        "ranks": ranks,
        "rank": rng.randrange(ranks),
        "step": rng.randint(2 * SAVE_EVERY + 1, 3 * SAVE_EVERY),
        "param": rng.choice([n for n in PARAMS if n.endswith("weight")]),
        "index": round(rng.random(), 6),
        "kill_after": 6,
    }


def run_optim(inc: dict, work: Path) -> dict:
    root = work / inc["id"]
    fault = f"{inc['rank']}:{inc['step']}:{inc['param']}:{inc['index']}"
    p, recs, wall = _job(root, inc["ranks"], ["--update-fault", fault, "--kill-after-fault", inc["kill_after"]])
    sdc = [
        e
        for e in _cli("report", root).get("events", [])
        if e["kind"] == "sdc" and (e.get("detail") or {}).get("source") == "shard_replay"
    ]
    blamed = [k for e in sdc for k in e.get("ranks") or []]
    t_detect = min((e["time"] for e in sdc if e.get("time") is not None), default=None)
    return _record(inc, p, recs, wall, bool(sdc) and bool(blamed), blamed, t_detect, inc["step"])


# ---- healthy controls -------------------------------------------------------------------------------------------


def _healthy(ranks: int):
    def run(work: Path, seed: int) -> dict:
        root = work
        p, recs, wall = _job(
            root, ranks, ["--seed", seed % 1000, "--crash-rank", ranks - 1, "--crash-step", 2 * SAVE_EVERY + 2]
        )
        alarms = _alarms(root)
        states = {c["step"]: c["state"] for c in _cli("ls", root).get("checkpoints", [])}
        resume_step, bad = _resume_judgement(recs, None)
        lc = _cli("resume", root, "--latest-clean")
        uncertified = sorted(s for s, st in states.items() if st != "certified")
        rejected_at_save = [r["step"] for r in recs if r["event"] == "saved" and r["state"] != "certified"]
        return {
            "id": f"healthy-fsdp-{ranks}ranks",
            "kind": "healthy",
            "mode": "fsdp",
            "async": False,
            "ranks": ranks,
            "alarms": alarms,
            "false_positive": bool(
                alarms["events"] or alarms["rejections"] or uncertified or rejected_at_save or p.returncode
            ),
            "bad_resume": bool(bad),
            "bad_resume_detail": bad,
            "no_resume": lc.get("step") is None,
            "resume_step": lc.get("step"),
            "restart_resumed_from": resume_step,
            "uncertified": uncertified,
            "rejected_at_save": rejected_at_save,
            "rc": p.returncode,
            "wall_s": round(wall, 1),
        }

    return run


def _fp_param(h: dict) -> bool:
    rej = h["alarms"]["rejections"]
    return bool(rej.get("at_rest_changed") or h.get("rejected_at_save") or h.get("uncertified"))


def _fp_optim(h: dict) -> bool:
    rej = h["alarms"]["rejections"]
    return bool(h["alarms"]["events"].get("sdc") or any(rej.get(c) for c in SHARD_CODES if c != "at_rest_changed"))


SCENARIOS = {
    "fsdp_param": {"plan": plan_param, "run": run_param, "false_positive": _fp_param},
    "fsdp_optim": {"plan": plan_optim, "run": run_optim, "false_positive": _fp_optim},
}
HEALTHY = {"fsdp2": _healthy(2), "fsdp3": _healthy(3)}
