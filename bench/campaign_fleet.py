"""The fleet record's precision and recall: seeded fault placements over a fleet of two hosts, judged by the drain
list and the suspects that `scout-ckpt suspects` gives at the end, against where the faults were placed.

Every job is tests/scripts/fleet_job.py under two torchrun agents of 2 workers (SCOUT_CKPT_HOST per agent: two
hosts, four devices), all jobs writing to one fleet store. The seed draws the placements:

  bad      one device with a persistent fault (its block computes wrongly, live and replayed) in every job that
           places it: the first jobs of the plan (at least two of them where the plan has two jobs or more)
  flaky    other devices, each with a one-off fault (one live forward wrong) in one job
  data     a layer that no rank reproduces (noise on every rank): not hardware, no device to blame

Scores (`run(...)["fleet"]`): the drain list (persistent suspects) against the bad devices (`drain_precision`,
`drain_recall`); every listed suspect against every faulted device (`listed_precision`, `listed_recall`); the share
of faulted devices listed with the class of their fault (`class_accuracy`); healthy devices listed
(`healthy_listed`, target 0); devices blamed for the data job (`not_hardware_blamed`, target 0). The oracle is
the placement alone; the fleet store is read through the library that `scout-ckpt suspects` calls.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "fleet_job.py"
HOSTS = ("node-a", "node-b")
NPROC = 2
STEPS, SAVE_EVERY = 8, 4


def plan(n_jobs: int, seed: int) -> list[dict]:
    """The seeded jobs: [{"job", "fault", "host", "local_rank"}]. Half the jobs (at least one, two where
    there are two or more) place the bad device; one job in six a layer no rank reproduces (from six jobs on);
    the others one flaky device each, never the bad one."""
    rng = random.Random(seed)
    devices = [(h, r) for h in HOSTS for r in range(NPROC)]
    bad = rng.choice(devices)
    others = [d for d in devices if d != bad]
    rng.shuffle(others)
    n_bad = max(min(2, n_jobs), n_jobs // 2)
    n_data = n_jobs // 6
    out = []
    for i in range(n_jobs):
        if i < n_bad:
            fault, (host, local) = "persistent", bad
        elif i < n_bad + n_data:
            fault, (host, local) = "numerics", ("", 0)
        else:
            fault, (host, local) = "transient", others[(i - n_bad - n_data) % len(others)]
        out.append({"job": f"fleet-{i + 1}", "fault": fault, "host": host, "local_rank": local})
    return out


def _job(store: Path, root: Path, p: dict) -> bool:
    from scout_ckpt.testing import agents

    env = {n: {"SCOUT_CKPT_HOST": h, "SCOUT_CKPT_JOB": p["job"]} for n, h in enumerate(HOSTS)}
    args = [str(root), "--fleet", str(store), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
    args += ["--fault", p["fault"], "--fault-host", p["host"], "--fault-local", str(p["local_rank"])]
    results = agents.run_agents(
        SCRIPT,
        args,
        nnodes=len(HOSTS),
        nproc=NPROC,
        repo=REPO,
        max_restarts=0,
        node_env=env,
        timeout=600,
        timed_out_rc=124,
    )
    return all(r.returncode == 0 for r in results)


def score(placements: list[dict], suspects: list[dict], not_hardware: list[dict]) -> dict:
    """Pure: the scores of the module docstring, from the placements (the truth) and `suspects`' answer."""
    truth = {(p["host"], p["local_rank"]): p["fault"] for p in placements if p["fault"] != "numerics"}
    bad = {d for d, f in truth.items() if f == "persistent"}
    flaky = {d for d, f in truth.items() if f == "transient" and d not in bad}
    listed = {(s["host"], s["local_rank"]): s["class"] for s in suspects}
    drained = {d for d, c in listed.items() if c == "persistent"}
    faulted = bad | flaky
    healthy = {(h, r) for h in HOSTS for r in range(NPROC)} - faulted
    want = {**{d: "transient" for d in flaky}, **{d: "persistent" for d in bad}}
    data_jobs = {p["job"] for p in placements if p["fault"] == "numerics"}

    def ratio(a: int, b: int) -> float | None:
        return round(a / b, 3) if b else None

    return {
        "drain_precision": ratio(len(drained & bad), len(drained)),
        "drain_recall": ratio(len(drained & bad), len(bad)),
        "listed_precision": ratio(len(set(listed) & faulted), len(listed)),
        "listed_recall": ratio(len(set(listed) & faulted), len(faulted)),
        "class_accuracy": ratio(sum(1 for d in faulted if listed.get(d) == want[d]), len(faulted)),
        "healthy_listed": len(set(listed) & healthy),
        "not_hardware_verdicts": sum(1 for v in not_hardware if v.get("job") in data_jobs),
        "not_hardware_blamed": sum(1 for s in suspects if set(s.get("jobs") or []) & data_jobs),
    }


def run(n_jobs: int, seed: int, work: Path, log=lambda *a: None) -> dict:
    """Run the seeded jobs into one fleet store under `work` and score them: the campaign's "fleet" key."""
    from scout_ckpt.fleet import suspects as rule
    from scout_ckpt.fleet.store import FleetStore

    t0 = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    store = work / "fleet.db"
    placements = plan(n_jobs, seed)
    failed = []
    for n, p in enumerate(placements):
        t1 = time.monotonic()
        ok = _job(store, work / p["job"], p)
        if not ok:
            failed.append(p["job"])
        log(
            f"[fleet {n + 1}/{len(placements)}] {p['job']} {p['fault']} at {p['host']}:{p['local_rank']}: "
            f"{'ok' if ok else 'FAILED'} ({time.monotonic() - t1:.0f}s)"
        )
    verdicts: list[dict] = []
    if store.exists():
        with FleetStore.open(store, readonly=True) as s:
            verdicts = s.verdicts()
    suspects = rule.rank(verdicts)
    out = score(placements, suspects, rule.not_hardware(verdicts))
    out.update(
        jobs=len(placements),
        failed_jobs=failed,
        devices=len(HOSTS) * NPROC,
        placements=placements,
        suspects=[{k: s[k] for k in ("host", "local_rank", "class", "jobs", "score")} for s in suspects],
        wall_s=round(time.monotonic() - t0, 1),
    )
    return out


if __name__ == "__main__":  # one fleet campaign alone: python bench/campaign_fleet.py [JOBS] [SEED]
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="scout-fleet-") as tmp:
        res = run(
            int(sys.argv[1]) if len(sys.argv) > 1 else 3,
            int(sys.argv[2]) if len(sys.argv) > 2 else 0,
            Path(tmp),
            log=lambda *a: print(*a, file=sys.stderr),
        )
    print(json.dumps(res, indent=1))
