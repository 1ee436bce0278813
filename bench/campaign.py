"""Fault campaign: seeded incidents through the real demo job, scored from the ledger; then the SIGKILL torture.

`python bench/campaign.py [--quick | --smoke] [--json] [--seed N] [--out DIR] [--kinds a,b] [--per-kind N] [--torture N]`

Every incident is a real `run_demo` job (worker processes, gloo, SIGKILL, restarts; 3 or 4 ranks, each in its
own temp dir) with one `--inject` spec whose rank/step are drawn from the seed, or, for `truncate` and `delete`,
damage done here to a file of a finished healthy control run. For each incident the campaign reads back:

  detected     a ledger event of the detector's kind (sdc, hang, straggler, crash) at or after the injection
               fired, or for byte faults a rejection of the damaged step with a bytes reason
  blamed       the ranks those events (or rejection reasons) name; truth is the injected rank (for byte faults,
               the rank that wrote the damaged file, per the ledger)
  latency      first matching event time - injection fired time (demo `injections[i].fired[0].time`); for byte
               faults the duration of the certify/resume call that caught it (the demo's final certify starts
               when its last generation ends)
  resume       what `latest_clean(root)` returns afterwards, plus every `resumed_from` of the run's restarts.
               A resume is bad when it returns a step whose state holds the fault: sdc and param injected at step S
               corrupt the state saved at S (sdc from S's forward pass; param right after S's optimizer step), so
               any step >= S; for byte faults the damaged step; for any kind, a checkpoint that fails to verify.

Healthy controls (ddp sync, ddp async, fsdp+sphere) count false positives: any sdc/hang/straggler/crash/desync
event or any rejection. Scores per kind: detection recall, attribution precision/recall over ranks (micro
averaged), false positives of that kind's detector on the controls, latency median/p95. Clean checkpoints that a
detector rejected (state saved before the fault entered) are counted as `clean_rejected` (availability cost, not a
bad resume). The fleet record is scored apart (bench/campaign_fleet.py, key "fleet"): seeded persistent, one-off
and not-hardware faults over two hosts' devices, the drain list's and the suspects' precision and recall against
the placements. Writes campaign.json and campaign.md to bench/results (or --out). Exit 1 on any bad resume or
torture violation, or when a Murphy kind (bench/campaign_murphy.py) misses wrongly_certified 0 or good_lost 0.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import campaign_fleet  # noqa: E402
import torture  # noqa: E402

KINDS = ("sdc", "param", "hang", "slow", "crash", "bitflip", "truncate", "delete", "quarantine_race", "load_mismatch")
# Scenarios that run outside the demo (users' scripts under real torchrun) live in their own modules next to this
# one. Each defines SCENARIOS = {kind: {"plan": f(i, rng, world_sizes) -> dict, "run": f(inc, work) -> record,
# "false_positive": f(healthy_record) -> bool}} and may define HEALTHY = {name: f(work, seed) -> healthy record};
# records carry the keys run_load_mismatch / judge_healthy produce (healthy ones also id, mode, async, ranks). A
# module that is absent adds nothing.
EXTENSIONS = ("campaign_fsdp", "campaign_torchrun", "campaign_users", "campaign_murphy", "campaign_node_loss")
NON_DEMO = ("truncate", "delete", "quarantine_race", "load_mismatch")  # run outside the demo job
DETECTOR = {"sdc": ("sdc",), "param": ("sdc",), "hang": ("hang",), "slow": ("straggler",), "crash": ("crash",)}
ALARM_KINDS = ("sdc", "hang", "straggler", "crash", "desync")
BYTES_CODES = (
    "digest_mismatch",
    "truncated_file",
    "size_mismatch",
    "missing_file",
    "missing_dir",
    "manifest_mismatch",
    "bad_manifest",
    "unexpected_file",
)
SAVE_POINTS = ("before_write", "during_write", "after_write", "before_rename", "after_rename", "after_commit")
SDC_LAYERS = (
    "blocks.0.mlp.fc1",
    "blocks.1.attn.qkv",
    "blocks.1.mlp.fc1",
    "blocks.2.attn.proj",
    "blocks.3.mlp.fc2",
    "head",
)
HEALTHY_CONFIGS = ({"mode": "ddp"}, {"mode": "ddp", "async_save": True}, {"mode": "fsdp", "constraint": "sphere"})
STEPS, SAVE_EVERY = 24, 8  # save_every > 7: the demo's replay runs and covers its 7 targets between saves
SLOW_STEPS = 48  # the straggler rule needs 3 confirmed windows of >= 1 s and >= 3 steps
FULL_PER_KIND = 5
QUICK_PER_KIND = 1
FLEET_JOBS = {"full": 6, "quick": 3, "smoke": 1}  # two-host jobs of the fleet placements (campaign_fleet.py)


# ---- plan ---------------------------------------------------------------------------------------------------


def extensions() -> tuple[dict, dict]:
    """(scenarios by kind, healthy controls by name) of every extension module present."""
    import importlib

    scenarios, healthy = {}, {}
    for name in EXTENSIONS:
        if not (Path(__file__).resolve().parent / f"{name}.py").exists():
            continue
        mod = importlib.import_module(name)
        scenarios.update(getattr(mod, "SCENARIOS", {}))
        healthy.update({f"{name}:{k}": v for k, v in getattr(mod, "HEALTHY", {}).items()})
    return scenarios, healthy


def all_kinds() -> tuple[str, ...]:
    return KINDS + tuple(k for k in extensions()[0] if k not in KINDS)


def plan_incidents(
    counts: dict[str, int], n_healthy: int, seed: int, world_sizes: tuple[int, ...] = (3, 4)
) -> list[dict]:
    """Every incident's demo options, drawn from the seed (the same seed gives the same campaign)."""
    rng = random.Random(seed)
    plan = []
    for i in range(n_healthy):
        cfg = HEALTHY_CONFIGS[i % len(HEALTHY_CONFIGS)]
        plan.append(
            {
                "kind": "healthy",
                "id": f"healthy-{i}",
                "demo": {"ranks": rng.choice(world_sizes), "steps": STEPS, "save_every": SAVE_EVERY, **cfg},
            }
        )
    saves = list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    for kind, n in counts.items():
        for i in range(n):
            ranks = rng.choice(world_sizes)
            demo = {"ranks": ranks, "steps": STEPS, "save_every": SAVE_EVERY}
            inc = {"kind": kind, "id": f"{kind}-{i}", "demo": demo}
            r = rng.randrange(ranks)
            if kind == "sdc":
                # an element of the last position (element 0 of qkv, position 0's query, is ignored by causal
                # attention: a fault that changes nothing, which no detector can or should see)
                demo["inject"] = [
                    f"sdc:rank={r}:step={rng.randint(2, STEPS - 2)}:layer={rng.choice(SDC_LAYERS)}"
                    f":elem={-rng.randint(1, 64)}"
                ]
                demo["mode"] = "ddp"
            elif kind == "param":  # FSDP: each rank owns its shard, so only the invariants can see the flip
                demo.update(mode="fsdp", constraint="sphere")
                demo["inject"] = [f"param:rank={r}:step={rng.randint(2, STEPS - 1)}"]
            elif kind == "hang":
                demo["inject"] = [f"hang:rank={r}:step={rng.randint(3, STEPS - 1)}"]
            elif kind == "slow":
                demo["steps"] = SLOW_STEPS
                demo["inject"] = [f"slow:rank={r}:factor=3"]
            elif kind == "crash":
                at = SAVE_POINTS[(i + rng.randrange(len(SAVE_POINTS))) % len(SAVE_POINTS)]
                if at in torture.COORDINATOR_ONLY:
                    r = 0  # _publish (manifest, rename) runs on the coordinator only
                demo["async_save"] = i % 2 == 1
                demo["inject"] = [f"crash:rank={r}:step={rng.choice(saves)}:at={at}"]
            elif kind == "bitflip":
                demo["inject"] = [f"bitflip:step={rng.choice(saves[:-1])}:bit={rng.randrange(8)}"]
            elif kind in ("truncate", "delete"):
                inc["method"] = ("resume", "certify")[i % 2]
                inc["pick"] = rng.random()
                inc["demo"] = None  # done on a copy of a healthy control's directory
            elif kind == "quarantine_race":
                inc["pick"] = rng.random()
                inc["demo"] = None  # an operator racing certify on a copy of a healthy control's directory
            elif kind == "load_mismatch":
                inc["ranks"] = ranks
                inc["demo"] = None  # a user's script under real torchrun, not the demo
            elif kind in extensions()[0]:
                inc.update(extensions()[0][kind]["plan"](i, rng, world_sizes))
                inc["demo"] = None
                inc["extension"] = True
            plan.append(inc)
    return plan


# ---- reading a run back -------------------------------------------------------------------------------------


def _ledger_view(root: Path) -> dict:
    from scout_ckpt.ledger import Ledger

    with Ledger.open(root, readonly=True) as led:
        return {
            "certifications": led.certifications(),
            "runs": led.runs(),
            "files": {c["step"]: led.files(c["step"]) for c in led.checkpoints()},
            "checkpoints": led.checkpoints(),
            "events": led.events(),
        }


def _resume(root: Path) -> tuple[dict | None, float]:
    """latest_clean(root) as restart tooling calls it, and how long it took."""
    from scout_ckpt.ops.recovery import NoCleanCheckpoint, latest_clean

    t0 = time.monotonic()
    try:
        lc = latest_clean(root)
    except NoCleanCheckpoint as e:
        lc = {"step": None, "reasons": e.reasons, "skipped": (e.reasons[0].get("skipped") or [])}
    return lc, time.monotonic() - t0


def _verifies(root: Path, step: int) -> bool:
    from scout_ckpt import policy
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.ops.recovery import verify_checkpoint

    with Ledger.open(root, readonly=True) as led:
        return verify_checkpoint(root, led, step)["status"] == policy.PASS


def _bytes_rejections(view: dict, step: int | None = None) -> list[dict]:
    out = []
    for c in view["certifications"]:
        if c["state"] != "rejected" or (step is not None and c["step"] != step):
            continue
        reasons = [r for r in c["reasons"] or [] if isinstance(r, dict) and r.get("code") in BYTES_CODES]
        if reasons:
            out.append({**c, "bytes_reasons": reasons})
    return out


def _alarms(result: dict, view: dict) -> dict:
    """Everything a healthy run should not have: alarm events by kind, rejections by code."""
    ev: dict[str, int] = {}
    for e in result["events"]:
        if e["kind"] in ALARM_KINDS:
            ev[e["kind"]] = ev.get(e["kind"], 0) + 1
    rej: dict[str, int] = {}
    for c in view["certifications"]:
        if c["state"] == "rejected":
            for r in c["reasons"] or []:
                code = r.get("code") if isinstance(r, dict) else str(r)
                rej[code] = rej.get(code, 0) + 1
    return {"events": ev, "rejections": rej}


def fault_entry_step(kind: str, fired: list[dict]) -> int | None:
    """The first checkpoint step whose state holds the fault (None: the fault never enters the state): the step
    of the first fired record (sdc: from that step's forward pass; param: after that step's optimizer step; the
    demo defers a param flip to the first save step at or after the requested one and records the actual step)."""
    return min(f["step"] for f in fired) if kind in ("sdc", "param") else None


def _holds_fault(view: dict, step: int, entry: int, fired: list[dict]) -> bool:
    """Does the checkpoint now at `step` (>= the fault's entry step) hold the fault? It does when the run that
    wrote it is one the fault fired in, or one that resumed from a checkpoint at or after the entry step written
    by such a run. A restart that resumed from before the fault, in a run where the fault did not fire again,
    writes clean state at the same step numbers (a one-shot flip fires once). Unknown writers count as holding."""
    runs = view["runs"]
    starts = [(r.get("started") or 0, r["id"]) for r in runs]
    fired_runs = set()
    for f in fired:
        live = [rid for t, rid in starts if t <= f["time"]]
        if live:
            fired_runs.add(live[-1])
    writer = {c["step"]: c.get("run_id") for c in view["checkpoints"]}
    by_id = {r["id"]: r for r in runs}

    def carries(run_id, depth=0):
        if run_id is None or run_id not in by_id or depth > len(runs):
            return True
        if run_id in fired_runs:
            return True
        frm = by_id[run_id].get("resumed_from")
        return frm is not None and frm >= entry and carries(writer.get(frm), depth + 1)

    return carries(writer.get(step))


def judge_demo(inc: dict, result: dict) -> dict:
    """Score one demo incident from its result and its ledger."""
    root = Path(result["dir"])
    kind = inc["kind"]
    inj = result["injections"][0]
    fired = sorted(inj["fired"], key=lambda f: f["time"])
    out = {
        "id": inc["id"],
        "kind": kind,
        "spec": inj["spec"],
        "ranks": result["ranks"],
        "mode": result["mode"],
        "async": result["async_save"],
        "wall_s": result["wall_s"],
        "restarts": result["restarts"],
        "completed": result["completed"],
        "fired": bool(fired),
    }
    if not (root / "scout-ledger.db").exists():
        out.update(
            detected=False,
            blamed=[],
            truth=[],
            latency_s=None,
            bad_resume=False,
            resume_step=None,
            no_resume=True,
            fired=False,
            note="no ledger: every generation died before its first save",
        )
        return out
    lc, _ = _resume(root)
    view = _ledger_view(root)  # after latest_clean (which may record failures)
    out["resume_step"] = lc["step"]
    resumed = [r["resumed_from"] for r in view["runs"][1:]]
    out["restart_resumed_from"] = resumed
    if not fired:
        out.update(detected=False, blamed=[], truth=[], latency_s=None, bad_resume=False, note="did not fire")
        return out
    t_fire = fired[0]["time"]
    truth = [inj["rank"]] if inj.get("rank") is not None else []
    blamed: set[int] = set()
    t_detect = None
    if kind in DETECTOR:
        # Attribution is judged on the first detection (the events of its step): later alarms of a fault that
        # was let run on (NaNs spreading to every rank's shard) are its consequences, listed as blamed_later.
        hits = sorted(
            (
                e
                for e in result["events"]
                if e["kind"] in DETECTOR[kind] and e["time"] is not None and e["time"] >= t_fire - 0.05
            ),
            key=lambda e: e["time"],
        )
        out["events"] = [
            {
                "kind": e["kind"],
                "ranks": e["ranks"],
                "step": e["step"],
                "t": round(e["time"] - t_fire, 3),
                "source": (e.get("detail") or {}).get("source"),
            }
            for e in hits
        ][:12]
        if hits:
            t_detect = hits[0]["time"]
            blamed.update(r for e in hits if e["step"] == hits[0]["step"] for r in e["ranks"] or [])
            out["blamed_later"] = sorted({r for e in hits for r in e["ranks"] or []} - blamed)
        latency = None if t_detect is None else t_detect - t_fire
        detected = t_detect is not None
    else:  # bitflip: the damaged step must be rejected for its bytes
        step = fired[0]["step"]
        rel = fired[0].get("file", "")
        name = rel.split("/", 1)[-1]
        writer = next((f.get("rank") for f in view["files"].get(step, []) if f["path"] == name), None)
        truth = [writer if writer is not None else 0]
        rej = _bytes_rejections(view, step)
        detected = bool(rej)
        latency = None
        if rej:
            first = min(rej, key=lambda c: c["time"])
            for r in first["bytes_reasons"]:
                if r.get("rank") is not None:
                    blamed.add(r["rank"])
            if first["source"] == "certify":  # the supervisor's final certify began when the job ended
                start = result["generations"][-1]["ended"]
            else:  # caught by a restarted job's load: from that generation's start
                start = max(
                    (g["started"] for g in result["generations"] if g["started"] <= first["time"]), default=t_fire
                )
            latency = first["time"] - start
            out["caught_by"] = first["source"]
    out.update(
        detected=detected, blamed=sorted(blamed), truth=truth, latency_s=None if latency is None else round(latency, 3)
    )
    # resumes
    bad = []
    entry = fault_entry_step(kind, fired)
    damaged = fired[0]["step"] if kind == "bitflip" else None
    candidates = ([("latest_clean", lc["step"])] if lc["step"] is not None else []) + [
        ("restart", s) for s in resumed if s is not None
    ]
    for who, s in candidates:
        if entry is not None and s >= entry and _holds_fault(view, s, entry, fired):
            bad.append(f"{who} returned step {s}, whose state holds the {kind} injected at step {entry}")
        if damaged is not None and s == damaged and who == "latest_clean":
            bad.append(f"{who} returned the bit-flipped step {s}")
        if who == "latest_clean" and not _verifies(root, s):
            bad.append(f"{who} returned step {s}, which does not verify")
    if damaged is not None:  # a restart that loaded the damaged step after the flip
        flip_t = t_fire
        for run in view["runs"][1:]:
            if run["resumed_from"] == damaged and (run.get("started") or 0) >= flip_t:
                bad.append(f"a restart loaded the bit-flipped step {damaged}")
    out["bad_resume"] = bool(bad)
    out["bad_resume_detail"] = bad
    out["no_resume"] = lc["step"] is None
    # clean checkpoints rejected: steps before the fault entered the state, rejected for fault reasons
    if entry is not None:
        final = {c["step"]: c for c in view["checkpoints"]}
        out["clean_rejected"] = sorted(s for s, c in final.items() if s < entry and c["state"] == "rejected")
    alarms = _alarms(result, view)
    mine = set(DETECTOR.get(kind, ()))
    out["collateral_events"] = {k: v for k, v in alarms["events"].items() if k not in mine}
    return out


def judge_healthy(inc: dict, result: dict) -> dict:
    root = Path(result["dir"])
    lc, _ = _resume(root)
    view = _ledger_view(root)
    alarms = _alarms(result, view)
    out = {
        "id": inc["id"],
        "kind": "healthy",
        "ranks": result["ranks"],
        "mode": result["mode"],
        "async": result["async_save"],
        "constraint": result["constraint"],
        "wall_s": result["wall_s"],
        "restarts": result["restarts"],
        "completed": result["completed"],
        "alarms": alarms,
        "resume_step": lc["step"],
        "certified": [c["step"] for c in result["checkpoints"] if c["state"] == "certified"],
    }
    out["false_positive"] = bool(alarms["events"] or alarms["rejections"] or result["restarts"])
    out["bad_resume"] = lc["step"] is not None and not _verifies(root, lc["step"])
    out["no_resume"] = lc["step"] is None
    return out


def run_byte_fault(inc: dict, healthy_dir: Path, work: Path) -> dict:
    """Truncate or delete one recorded file of a certified step in a copy of a healthy run, then certify/resume."""
    from scout_ckpt.ops.certify import certify

    root = work / inc["id"]
    shutil.copytree(healthy_dir, root)
    view = _ledger_view(root)
    certified = sorted(c["step"] for c in view["checkpoints"] if c["state"] == "certified")
    out = {
        "id": inc["id"],
        "kind": inc["kind"],
        "method": inc["method"],
        "fired": bool(certified),
        "source_run": healthy_dir.name,
    }
    if not certified:
        out.update(
            detected=False,
            blamed=[],
            truth=[],
            latency_s=None,
            bad_resume=False,
            note="the healthy run had no certified step to damage",
        )
        return out
    # resume: damage the newest certified step (the one a restart would take); certify: any certified step
    step = certified[-1] if inc["method"] == "resume" else certified[int(inc["pick"] * len(certified))]
    files = sorted(view["files"][step], key=lambda f: f["path"])
    f = files[int(inc["pick"] * len(files))]
    path = root / next(c["path"] for c in view["checkpoints"] if c["step"] == step) / f["path"]
    if inc["kind"] == "truncate":
        with open(path, "r+b") as fh:
            fh.truncate(max(0, f["size"] // 2))
    else:
        path.unlink()
    out.update(step=step, file=f["path"], truth=[f["rank"] if f.get("rank") is not None else 0])
    t0 = time.monotonic()
    if inc["method"] == "resume":
        lc, dt = _resume(root)
        detected = any(s["step"] == step for s in lc.get("skipped") or [])
    else:
        res = certify(root)
        dt = time.monotonic() - t0
        detected = any(c["step"] == step and c["state"] == "rejected" for c in res)
        lc, _ = _resume(root)
    view = _ledger_view(root)
    blamed = sorted(
        {r["rank"] for c in _bytes_rejections(view, step) for r in c["bytes_reasons"] if r.get("rank") is not None}
    )
    bad = []
    if lc["step"] == step:
        bad.append(f"latest_clean returned the damaged step {step}")
    elif lc["step"] is not None and not _verifies(root, lc["step"]):
        bad.append(f"latest_clean returned step {lc['step']}, which does not verify")
    out.update(
        detected=detected,
        blamed=blamed,
        latency_s=round(dt, 4),
        resume_step=lc["step"],
        bad_resume=bool(bad),
        bad_resume_detail=bad,
        no_resume=lc["step"] is None,
    )
    return out


def run_quarantine_race(inc: dict, healthy_dir: Path, work: Path) -> dict:
    """An operator quarantines the newest certified step while `certify` is hashing it (the CLI, from another
    process, at certify's first progress tick). The promise: certify's verdict does not overwrite the quarantine
    and `latest_clean` never returns the step."""
    import subprocess

    from scout_ckpt.ops.certify import certify

    root = work / inc["id"]
    shutil.copytree(healthy_dir, root)
    view = _ledger_view(root)
    certified = sorted(c["step"] for c in view["checkpoints"] if c["state"] == "certified")
    out = {
        "id": inc["id"],
        "kind": inc["kind"],
        "fired": bool(certified),
        "truth": [],
        "blamed": [],
        "source_run": healthy_dir.name,
    }
    if not certified:
        out.update(detected=False, latency_s=None, bad_resume=False, note="no certified step to quarantine")
        return out
    step = certified[-1]
    fired = {}

    def tick(_n):
        if not fired:
            fired["t"] = time.monotonic()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "scout_ckpt.cli",
                    "quarantine",
                    str(root),
                    str(step),
                    "--reason",
                    "campaign race",
                ],
                check=True,
                capture_output=True,
            )

    t0 = time.monotonic()
    certify(root, [step], progress_factory=lambda total: tick)
    dt = time.monotonic() - t0
    lc, _ = _resume(root)
    state = next(c["state"] for c in _ledger_view(root)["checkpoints"] if c["step"] == step)
    bad = [f"latest_clean returned the quarantined step {step}"] if lc["step"] == step else []
    out.update(
        step=step,
        raced=bool(fired),
        detected=state == "quarantined",
        latency_s=round(dt, 4),
        resume_step=lc["step"],
        bad_resume=bool(bad),
        bad_resume_detail=bad,
        no_resume=lc["step"] is None,
    )
    return out


def run_load_mismatch(inc: dict, work: Path) -> dict:
    """A user's DDP script under real torchrun (examples/train_ddp.py): rank 1 is SIGKILLed at step 12; after the
    restart the loaded values of checkpoint 10 differ from what was saved (one bit, after dcp.load). The promise:
    10 is rejected `load_mismatch`, the same load walks back to 5, and the job finishes; judged by the digests the
    job printed when it saved and loaded."""
    import os
    import subprocess

    root = work / inc["id"]
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(inc["ranks"]),
        "--max-restarts",
        "2",
        "--monitor-interval",
        "0.5",
        str(repo / "examples" / "train_ddp.py"),
        str(root),
        "--steps",
        "16",
        "--save-every",
        "5",
        "--crash-rank",
        "1",
        "--crash-step",
        "12",
        "--corrupt-load",
        "10",
        "--record",
    ]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    dt = time.monotonic() - t0
    events = [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines() if line.startswith("SCOUT-EXAMPLE ")]
    saved = {(e["attempt"], e["step"]): e["digest"] for e in events if e["event"] == "saved"}
    loaded = [e for e in events if e["event"] == "loaded" and e["attempt"] == 1]
    view = _ledger_view(root) if (root / "scout-ledger.db").exists() else {"checkpoints": [], "events": []}
    mism = [e for e in view.get("events", []) if e["kind"] == "load_mismatch" and e.get("step") == 10]
    resumed = loaded[0]["step"] if loaded else None
    bad = []
    if resumed == 10:
        bad.append("the restart resumed from the corrupted load of step 10")
    elif resumed is not None and loaded[0]["digest"] != saved.get((0, resumed)):
        bad.append(f"the restart resumed from {resumed} with state other than what was saved")
    return {
        "id": inc["id"],
        "kind": inc["kind"],
        "fired": True,
        "truth": [],
        "blamed": [],
        "step": 10,
        "detected": bool(mism) and p.returncode == 0,
        "latency_s": round(dt, 2),
        "resume_step": resumed,
        "bad_resume": bool(bad),
        "bad_resume_detail": bad,
        "no_resume": resumed is None,
        "rc": p.returncode,
    }


# ---- scoring ------------------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return round(v[lo] + (v[hi] - v[lo]) * (k - lo), 3)


def _fp_of(kind: str, h: dict) -> bool:
    """Did kind's detector fire on healthy control h?"""
    ev, rej = h["alarms"]["events"], h["alarms"]["rejections"]
    if kind == "sdc":
        return bool(
            ev.get("sdc")
            or rej.get("replay_sdc")
            or rej.get("consensus_attributed")
            or rej.get("consensus_inconclusive")
        )
    if kind == "param":
        return bool(rej.get("invariant_failed") or rej.get("at_rest_changed"))
    if kind in ("quarantine_race", "load_mismatch"):
        return False  # no detector runs on a healthy control for these
    ext = extensions()[0].get(kind)
    if ext is not None:
        return bool(ext["false_positive"](h))
    if kind == "hang":
        return bool(ev.get("hang") or ev.get("desync"))
    if kind == "slow":
        return bool(ev.get("straggler"))
    if kind == "crash":
        return bool(ev.get("crash"))
    return any(rej.get(c) for c in BYTES_CODES)


def score(incidents: list[dict], healthy: list[dict]) -> dict:
    kinds = {}
    for kind in dict.fromkeys(i["kind"] for i in incidents):
        mine = [i for i in incidents if i["kind"] == kind and i.get("fired")]
        det = [i for i in mine if i["detected"]]
        tp = sum(len(set(i["blamed"]) & set(i["truth"])) for i in det)
        n_blamed = sum(len(i["blamed"]) for i in det)
        n_truth = sum(len(i["truth"]) for i in mine)
        lat = [i["latency_s"] for i in det if i["latency_s"] is not None]
        kinds[kind] = {
            "n": len(mine),
            "not_fired": sum(1 for i in incidents if i["kind"] == kind and not i.get("fired")),
            "detected": len(det),
            "recall": round(len(det) / len(mine), 3) if mine else None,
            "precision": round(tp / n_blamed, 3) if n_blamed else None,
            "attribution_recall": round(tp / n_truth, 3) if n_truth else None,
            "false_positives": sum(1 for h in healthy if _fp_of(kind, h)),
            "latency_s_median": round(statistics.median(lat), 3) if lat else None,
            "latency_s_p95": _pct(lat, 0.95),
            "bad_resumes": sum(1 for i in mine if i.get("bad_resume")),
            "no_resume": sum(1 for i in mine if i.get("no_resume")),
            "clean_rejected": sum(len(i.get("clean_rejected") or []) for i in mine),
        }
        murphy = [i for i in incidents if i["kind"] == kind and "wrongly_certified" in i]
        if murphy:  # faults of the world (campaign_murphy): targets 0 and 0; every incident's outcome, skips too
            kinds[kind].update(
                wrongly_certified=sum(i["wrongly_certified"] for i in murphy),
                good_lost=sum(i["good_lost"] for i in murphy),
                fresh_start_over_checkpoints=sum(i.get("fresh_start_over_checkpoints", 0) for i in murphy),
                outcomes=[i.get("outcome") for i in murphy],
            )
    return kinds


# ---- driver -------------------------------------------------------------------------------------------------


def run_campaign(
    counts: dict[str, int],
    n_healthy: int,
    seed: int,
    torture_iters: int,
    out_dir: Path,
    chain_len: int = 10,
    world_sizes: tuple[int, ...] = (3, 4),
) -> dict:
    from scout_ckpt.demo import run_demo

    t0 = time.monotonic()
    plan = plan_incidents(counts, n_healthy, seed, world_sizes)
    incidents, healthy = [], []
    with tempfile.TemporaryDirectory(prefix="scout-campaign-") as tmp:
        work = Path(tmp)
        healthy_dirs: list[Path] = []
        for n, inc in enumerate(plan):
            if inc["demo"] is None:
                continue
            kw = dict(inc["demo"])
            t1 = time.monotonic()
            result = run_demo(work / inc["id"], quiet=True, seed=seed, timeout_s=420.0, **kw)
            if inc["kind"] == "healthy":
                rec = judge_healthy(inc, result)
                healthy.append(rec)
                healthy_dirs.append(Path(result["dir"]))
                C.log(
                    f"[{n + 1}/{len(plan)}] {inc['id']} {kw.get('mode')} ranks={kw['ranks']} "
                    f"{'async' if kw.get('async_save') else 'sync'}: "
                    f"{'FALSE POSITIVE ' + json.dumps(rec['alarms']) if rec['false_positive'] else 'clean'}"
                    f" resume={rec['resume_step']} ({time.monotonic() - t1:.0f}s)"
                )
            else:
                rec = judge_demo(inc, result)
                incidents.append(rec)
                C.log(
                    f"[{n + 1}/{len(plan)}] {inc['id']} {rec['spec']} ranks={kw['ranks']}"
                    f"{' async' if kw.get('async_save') else ''}: detected={rec['detected']} "
                    f"blamed={rec['blamed']} truth={rec['truth']} latency={rec['latency_s']} "
                    f"resume={rec['resume_step']}{' BAD RESUME' if rec.get('bad_resume') else ''}"
                    f" ({time.monotonic() - t1:.0f}s)"
                )
        ext_scenarios, ext_healthy = extensions()
        planned = {inc["kind"] for inc in plan if inc.get("extension")}
        if planned:
            for name, make in ext_healthy.items():
                if not planned & set(getattr(__import__(name.split(":")[0]), "SCENARIOS", {})):
                    continue  # a module's healthy controls run only when one of its kinds does
                t1 = time.monotonic()
                rec = make(work / name.replace(":", "-"), seed)
                healthy.append(rec)
                C.log(
                    f"{rec['id']}: {'FALSE POSITIVE ' + json.dumps(rec['alarms']) if rec['false_positive'] else 'clean'}"
                    f" resume={rec.get('resume_step')} ({time.monotonic() - t1:.0f}s)"
                )
        for inc in plan:
            if inc["demo"] is not None:
                continue
            if inc.get("extension"):
                t1 = time.monotonic()
                rec = ext_scenarios[inc["kind"]]["run"](inc, work)
                incidents.append(rec)
                C.log(
                    f"{inc['id']}: detected={rec['detected']} blamed={rec.get('blamed')} truth={rec.get('truth')} "
                    f"latency={rec.get('latency_s')} resume={rec.get('resume_step')}"
                    f"{' BAD RESUME' if rec.get('bad_resume') else ''}"
                    f"{' outcome=' + str(rec['outcome']) if 'outcome' in rec else ''} ({time.monotonic() - t1:.0f}s)"
                )
                continue
            if inc["kind"] == "load_mismatch":
                rec = run_load_mismatch(inc, work)
                incidents.append(rec)
                C.log(
                    f"{inc['id']}: detected={rec['detected']} resumed from {rec['resume_step']}"
                    f"{' BAD RESUME' if rec.get('bad_resume') else ''} ({rec['latency_s']}s)"
                )
                continue
            if not healthy_dirs:
                C.fail(f"{inc['kind']} needs a healthy control run (give --healthy >= 1)")
            src = healthy_dirs[int(inc["pick"] * 1000) % len(healthy_dirs)]
            if inc["kind"] == "quarantine_race":
                rec = run_quarantine_race(inc, src, work)
                incidents.append(rec)
                C.log(
                    f"{inc['id']} step {rec.get('step')}: quarantine held={rec['detected']} "
                    f"resume={rec.get('resume_step')}{' BAD RESUME' if rec.get('bad_resume') else ''}"
                )
                continue
            rec = run_byte_fault(inc, src, work)
            incidents.append(rec)
            C.log(
                f"{inc['id']} ({inc['method']}) step {rec.get('step')} {rec.get('file')}: "
                f"detected={rec['detected']} blamed={rec['blamed']} truth={rec['truth']} "
                f"resume={rec.get('resume_step')}{' BAD RESUME' if rec.get('bad_resume') else ''}"
            )
    campaign_s = time.monotonic() - t0
    tort = torture.run_torture(torture_iters, seed, chain_len) if torture_iters > 0 else None
    if tort:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "torture.json").write_text(json.dumps(tort, indent=1, default=str))
    kinds_scores = score(incidents, healthy)
    bad = sum(1 for i in incidents + healthy if i.get("bad_resume"))
    healthy_summary = {
        "n": len(healthy),
        "false_positives": sum(1 for h in healthy if h["false_positive"]),
        "no_resume": sum(1 for h in healthy if h["no_resume"]),
        "bad_resumes": sum(1 for h in healthy if h["bad_resume"]),
    }
    result = {
        "kinds": kinds_scores,
        "bad_resumes": bad,
        "healthy": healthy_summary,
        "false_positive_runs": healthy_summary["false_positives"],
        "torture": {k: v for k, v in tort.items() if k != "detail"} if tort else None,
        "torture_violations": tort["n_violations"] if tort else 0,
        "incidents": incidents,
        "healthy_runs": healthy,
        "params": {
            "seed": seed,
            "per_kind": counts,
            "healthy": n_healthy,
            "world_sizes": list(world_sizes),
            "steps": STEPS,
            "save_every": SAVE_EVERY,
            "slow_steps": SLOW_STEPS,
            "torture_iterations": torture_iters,
            **C.load_note(),
        },
        "campaign_s": round(campaign_s, 1),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    return result


def table_rows(res: dict) -> list[list]:
    rows = []
    for kind, s in res["kinds"].items():
        rows.append(
            [
                kind,
                s["n"],
                s["recall"],
                s["precision"],
                s["attribution_recall"],
                s["false_positives"],
                s["latency_s_median"],
                s["latency_s_p95"],
                s["bad_resumes"],
                s["no_resume"],
                s["clean_rejected"],
            ]
        )
    h = res["healthy"]
    rows.append(
        ["healthy", h["n"], "-", "-", "-", h["false_positives"], "-", "-", h["bad_resumes"], h["no_resume"], "-"]
    )
    return rows


HEADERS = [
    "kind",
    "n",
    "recall",
    "precision",
    "attr_recall",
    "false_pos",
    "latency_med_s",
    "latency_p95_s",
    "bad_resumes",
    "no_resume",
    "clean_rejected",
]


def markdown(res: dict) -> str:
    lines = [
        f"# Fault campaign (seed {res['params']['seed']}, {res['wall_s']:.0f} s)",
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "---|" * len(HEADERS),
    ]
    for r in table_rows(res):
        lines.append("| " + " | ".join(C.fmt(c) if c is not None else "-" for c in r) + " |")
    lines += ["", f"bad resumes: {res['bad_resumes']}"]
    t = res["torture"]
    if t:
        lines += ["", "## SIGKILL torture", "", "| | |", "|---|---|"]
        lines += [f"| {a} | {b} |" for a, b in torture.rows(t)]
        lines += [f"- VIOLATION {v}" for v in t["violations"]]
    missed = [i for i in res["incidents"] if i.get("fired") and not i["detected"]]
    if missed:
        lines += ["", "## Missed incidents", ""] + [
            f"- {i['id']}: {i.get('spec') or i.get('file')} (ranks {i.get('ranks')})" for i in missed
        ]
    fps = [h for h in res["healthy_runs"] if h["false_positive"]]
    if fps:
        lines += ["", "## False positives on healthy controls", ""] + [
            f"- {h['id']} ({h['mode']}{', async' if h['async'] else ''}, {h['ranks']} ranks): {json.dumps(h['alarms'])}"
            for h in fps
        ]
    murphy = {k: s for k, s in res["kinds"].items() if "wrongly_certified" in s}
    if murphy:
        lines += [
            "",
            "## Faults of the world (targets: wrongly_certified 0, good_lost 0)",
            "",
            "| kind | n | wrongly_certified | good_lost | outcomes |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {k} | {s['n']} | {s['wrongly_certified']} | {s['good_lost']} | {'; '.join(map(str, s['outcomes']))} |"
            for k, s in murphy.items()
        ]
    bads = [i for i in res["incidents"] + res["healthy_runs"] if i.get("bad_resume")]
    if bads:
        lines += ["", "## Bad resumes", ""] + [f"- {i['id']}: {i.get('bad_resume_detail')}" for i in bads]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = C.parser("Fault campaign: seeded incidents through the demo job, scored; plus the SIGKILL torture")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_PER_KIND} incident per kind, 5 torture iterations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="directory for campaign.json/.md (default bench/results)")
    p.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"comma-separated subset of {','.join(all_kinds())} (default: the demo's and byte kinds)",
    )
    p.add_argument(
        "--per-kind",
        type=int,
        default=None,
        help=f"incidents per kind (default {FULL_PER_KIND}, --quick {QUICK_PER_KIND})",
    )
    p.add_argument("--healthy", type=int, default=None, help="healthy control runs (default 6, --quick 1)")
    p.add_argument(
        "--torture",
        type=int,
        default=None,
        help="SIGKILLs the torture must land (default 100, --quick 5); details in torture.json",
    )
    p.add_argument(
        "--fleet-jobs",
        type=int,
        default=None,
        help=f"two-host jobs of the fleet precision/recall report (default {FLEET_JOBS['full']}, --quick "
        f"{FLEET_JOBS['quick']}, --smoke {FLEET_JOBS['smoke']}; 0 where --kinds is given: a campaign of chosen kinds)",
    )
    # --smoke (make bench-smoke): one incident of a user's script under torchrun, no healthy control, no torture
    # (bench/torture.py --smoke runs that), one fleet job; every extension module is still imported by the --kinds
    # check
    smoke = {"kinds": "load_mismatch", "per_kind": 1, "healthy": 0, "torture": 0, "quick": True}
    args = C.parse_args(p, {**smoke, "fleet_jobs": FLEET_JOBS["smoke"]}, argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in all_kinds()]
    if unknown:
        C.fail(f"--kinds: unknown {', '.join(unknown)} (one of {', '.join(all_kinds())})")
    per_kind = args.per_kind if args.per_kind is not None else (QUICK_PER_KIND if args.quick else FULL_PER_KIND)
    n_healthy = args.healthy if args.healthy is not None else (1 if args.quick else 6)
    torture_iters = args.torture if args.torture is not None else (5 if args.quick else 100)
    chosen = any(a == "--kinds" or a.startswith("--kinds=") for a in (sys.argv[1:] if argv is None else argv))
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    fleet_jobs = args.fleet_jobs if args.fleet_jobs is not None else 0 if chosen else FLEET_JOBS[size]
    if per_kind < 1 or n_healthy < 0 or torture_iters < 0 or fleet_jobs < 0:
        C.fail("--per-kind must be >= 1, --healthy, --torture and --fleet-jobs >= 0")
    if n_healthy < 1 and {"truncate", "delete"} & set(kinds):
        C.fail("truncate/delete damage a healthy control run: give --healthy >= 1")
    # crash alternates sync and async saves: at least one of each
    counts = {k: max(per_kind, 2) if k == "crash" else per_kind for k in kinds}
    # --quick: 3 ranks only (4 processes on 2 cores cost half as much again) to stay well inside run_all's cap
    out = args.out or C.results_dir()
    res = run_campaign(counts, n_healthy, args.seed, torture_iters, out, world_sizes=(3,) if args.quick else (3, 4))
    res["params"]["quick"] = args.quick
    if fleet_jobs:
        with tempfile.TemporaryDirectory(prefix="scout-campaign-fleet-") as tmp:
            res["fleet"] = campaign_fleet.run(fleet_jobs, args.seed, Path(tmp), log=C.log)
    res["params"]["fleet_jobs"] = fleet_jobs
    out.mkdir(parents=True, exist_ok=True)
    (out / "campaign.json").write_text(json.dumps(res, indent=1, sort_keys=True, default=str))
    (out / "campaign.md").write_text(markdown(res))
    C.emit(res, args, table_rows(res), HEADERS, title=f"fault campaign (seed {args.seed}, {res['wall_s']:.0f} s)")
    if not args.json:
        print(f"\nbad resumes: {res['bad_resumes']}")
        if res.get("fleet"):
            f = res["fleet"]
            print(
                f"fleet ({f['jobs']} jobs, {f['devices']} devices): drain precision {f['drain_precision']} recall "
                f"{f['drain_recall']}, listed precision {f['listed_precision']} recall {f['listed_recall']}, "
                f"class accuracy {f['class_accuracy']}, healthy listed {f['healthy_listed']}"
            )
        for k, s in res["kinds"].items():
            if "wrongly_certified" in s:
                print(
                    f"{k}: wrongly_certified={s['wrongly_certified']} good_lost={s['good_lost']} "
                    f"outcome={'; '.join(map(str, s['outcomes']))}"
                )
        if res["torture"]:
            print()
            C.print_table(torture.rows(res["torture"]), ["torture", "value"])
            for v in res["torture"]["violations"]:
                print("VIOLATION", v)
        print(f"\nwrote {out / 'campaign.json'} and {out / 'campaign.md'}")
    murphy_missed = any(s.get("wrongly_certified") or s.get("good_lost") for s in res["kinds"].values())
    return 1 if res["bad_resumes"] or res["torture_violations"] or murphy_missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
