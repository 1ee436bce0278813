"""Crash-consistency torture: SIGKILL a random rank at a random instant of sync and async saves, over and over.

`python bench/torture.py [--kills N] [--seed N] [--json] [--out DIR] [--smoke]` (also run by `bench/campaign.py`).

Each chain is one checkpoint root that a 3-rank job (scout_ckpt.testing.launch.run_ranks, a small MLP, AdamW, explicit
all-reduce, so training is bitwise deterministic in the step number) keeps restarting on, as a crash loop would:
every iteration loads the latest clean checkpoint, trains, saves a few times (sync or async, with or without
retention) and has one random rank SIGKILLed, either from the Checkpointer's fault_hook at a random save point
or by a timer thread at a random delay after a save began (which may land anywhere: staging, upload, commit,
retention, or training after it). After every iteration the parent checks, without torch:

  - the ledger opens; every `step-*` directory is either committed/certified and verifies against the ledger,
    or a `writing` row with an intact manifest of the same attempt (the next start completes it), or a row that
    is never resumed (rejected/deleted/quarantined);
  - `latest_clean` returns a checkpoint that verifies, skips nothing (no certified checkpoint went bad), and
    never goes backwards;
  - the restarted job loaded exactly the state that was saved at that step (full-state digest against the digest
    taken before that save, which is deterministic because training is).

Each chain ends with a clean run whose saves must certify, then `certify` of every step. Any violation is
listed and makes the exit status 1.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

WORLD = 3
WIDTH = 64
ALL_POINTS = ("before_write", "during_write", "after_write", "before_rename", "after_rename", "after_commit")
COORDINATOR_ONLY = ("before_rename", "after_rename")  # _publish runs on rank 0 only
NEVER_RESUMED = ("rejected", "deleted", "quarantined")


# ---- the rank function (module level: the forkserver children import it as `torture.torture_rank`) ---------


def _digest(model, opt) -> str:
    import torch
    import xxhash

    h = xxhash.xxh3_128()

    def feed(prefix, obj):
        if isinstance(obj, dict):
            for k in sorted(obj, key=str):
                feed(f"{prefix}/{k}", obj[k])
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                feed(f"{prefix}/{i}", v)
        elif isinstance(obj, torch.Tensor):
            t = obj.detach().contiguous()
            h.update(f"{prefix}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(f"{prefix}={obj!r}".encode())

    feed("model", model.state_dict())
    feed("optim", opt.state_dict()["state"])
    return h.hexdigest()


def torture_rank(rank: int, world: int, root: str, refs: str, plan: dict) -> dict:
    """One incarnation of the job. `plan`: iteration, async, keep, victim (None: no kill), how (hook|timer),
    point, kill_save (index of the save to kill in), delay_s, saves, between."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from scout_ckpt.checkpointer import Checkpointer
    from scout_ckpt.save.app_state import ModelOptimizerState
    from scout_ckpt.testing.faults import fault_points

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"app": ModelOptimizerState(model, opt)}
    victim = plan["victim"] == rank
    target = {"step": None, "fired": False}

    def die(where: str):
        target["fired"] = True
        Path(refs, f"killed-{plan['iteration']}.json").write_text(
            json.dumps({"rank": rank, "where": where, "time": time.time()})
        )
        os.kill(os.getpid(), signal.SIGKILL)

    def hook(point: str, step: int) -> None:
        if not victim or plan["how"] != "hook" or step != target["step"] or target["fired"]:
            return
        # a rank that writes no data file never reaches during_write: it dies at after_write instead
        if point == plan["point"] or (point == "after_write" and plan["point"] == "during_write"):
            die(f"hook:{point}")

    with fault_points(hook):
        ckpt = Checkpointer(root, model=model, optimizer=opt, async_save=plan["async"], keep=plan["keep"], timeout_s=30)
    start = ckpt.load_latest_clean(state) or 0
    if rank == 0:
        Path(refs, f"loaded-{plan['iteration']}.json").write_text(
            json.dumps({"step": start, "digest": _digest(model, opt) if start else None})
        )
    step = start
    for k in range(plan["saves"]):
        for _ in range(plan["between"]):
            step += 1
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(16, WIDTH, generator=g)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
        if rank == 0:
            ref = Path(refs, f"state-{step}.txt")
            d = _digest(model, opt)
            if ref.exists() and ref.read_text() != d:
                Path(refs, f"nondeterministic-{plan['iteration']}-{step}.txt").write_text(d)
            elif not ref.exists():
                ref.write_text(d)
        if k == plan["kill_save"] and victim:
            target["step"] = step
            if plan["how"] == "timer":
                threading.Thread(
                    target=lambda: (time.sleep(plan["delay_s"]), die(f"timer:{plan['delay_s']:.3f}s")), daemon=True
                ).start()
        ckpt.save(step, state)
    ckpt.close()
    return {"start": start, "end": step}


# ---- the parent's checks (no torch) ---------------------------------------------------------------------------


def check_root(root: Path) -> tuple[list[str], dict]:
    """Crash-consistency of one root as a restart would find it: (violations, facts)."""
    from scout_ckpt import policy
    from scout_ckpt.format import manifest
    from scout_ckpt.format.layout import list_step_dirs, step_path
    from scout_ckpt.format.verify import verify_files
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.ops.recovery import NoCleanCheckpoint, latest_clean, verify_checkpoint

    bad: list[str] = []
    facts = {"dirs": 0, "pending_writing": 0, "never_resumed_dirs": 0}
    if not (root / "scout-ledger.db").exists():
        return bad, {**facts, "latest_clean": None}
    try:
        ledger = Ledger.open(root, readonly=True)
    except Exception as e:  # noqa: BLE001 - any failure to open is the violation
        return [f"ledger does not open: {e!r}"], facts
    with ledger:
        for step in list_step_dirs(root):
            facts["dirs"] += 1
            row = ledger.checkpoint(step)
            if row is None:
                bad.append(f"step {step}: directory without a ledger row")
            elif row["state"] in ("committed", "certified"):
                ev = verify_checkpoint(root, ledger, step)
                if ev["status"] != policy.PASS:
                    bad.append(f"step {step} ({row['state']}): does not verify: {ev['reasons'][:3]}")
            elif row["state"] == "writing":
                facts["pending_writing"] += 1
                try:
                    m, _ = manifest.read(step_path(root, step))
                except Exception as e:  # noqa: BLE001
                    bad.append(f"step {step} (writing): directory without a readable manifest: {e}")
                    continue
                if m.get("attempt") != row["attempt"]:
                    bad.append(
                        f"step {step} (writing): manifest of attempt {m.get('attempt')}, ledger {row['attempt']}"
                    )
                elif verify_files(step_path(root, step), m["files"])["status"] != policy.PASS:
                    bad.append(f"step {step} (writing): files do not match its own manifest")
            elif row["state"] in NEVER_RESUMED:
                facts["never_resumed_dirs"] += 1
            else:
                bad.append(f"step {step}: unknown state {row['state']}")
        try:
            lc = latest_clean(root, readonly_ledger=None)
        except NoCleanCheckpoint:
            lc = None
    if lc is not None:
        if lc["skipped"]:
            bad.append(f"latest_clean skipped certified checkpoints that failed verification: {lc['skipped']}")
        with Ledger.open(root, readonly=True) as ledger:
            if verify_checkpoint(root, ledger, lc["step"])["status"] != policy.PASS:
                bad.append(f"latest_clean returned step {lc['step']}, which does not verify")
    facts["latest_clean"] = lc["step"] if lc else None
    return bad, facts


def make_plan(rng: random.Random, iteration: int, keep: int | None, kill: bool = True) -> dict:
    how = rng.choice(("hook", "timer"))
    victim = rng.randrange(WORLD) if kill else None
    point = rng.choice(ALL_POINTS)
    if kill and point in COORDINATOR_ONLY:
        victim = 0
    return {
        "iteration": iteration,
        "async": rng.random() < 0.5,
        "keep": keep,
        "victim": victim,
        "how": how,
        "point": point if how == "hook" else None,
        "kill_save": rng.randrange(3),
        "saves": 3,
        "between": rng.choice((1, 2)),
        "delay_s": round(rng.uniform(0.0, 0.35), 3),
    }


def run_chain(chain: int, iterations: int, seed: int, workdir: Path) -> dict:
    from scout_ckpt.testing.launch import run_ranks

    rng = random.Random(f"{seed}-torture-{chain}")
    root, refs = workdir / f"chain{chain}" / "ckpt", workdir / f"chain{chain}" / "refs"
    refs.mkdir(parents=True)
    keep = 3 if chain % 2 else None
    out = {"chain": chain, "keep": keep, "iterations": [], "violations": []}
    prev_clean = 0
    for i in range(iterations + 1):  # the last one runs without a kill and must end certified
        final = i == iterations
        plan = make_plan(rng, i, keep, kill=not final)
        t0 = time.monotonic()
        outcomes = run_ranks(
            torture_rank, WORLD, str(root), str(refs), plan, timeout=90, pg_timeout_s=30, allow_failures=True
        )
        wall = time.monotonic() - t0
        rec = {"plan": plan, "wall_s": round(wall, 2), "exit_codes": [o.exitcode for o in outcomes]}
        killed_file = refs / f"killed-{i}.json"
        rec["killed"] = json.loads(killed_file.read_text()) if killed_file.exists() else None
        rec["rank_errors"] = {o.rank: o.error.strip().splitlines()[-1][:300] for o in outcomes if o.error}
        results = [o.result for o in outcomes if o.result]
        if results:
            rec["ended_at_step"] = results[0]["end"]
        viol = []
        loaded_file = refs / f"loaded-{i}.json"
        if not loaded_file.exists():
            errs = [o.error.strip().splitlines()[-1] for o in outcomes if o.error]
            viol.append(f"the job did not get past load_latest_clean: {errs[:2]}")
        else:
            loaded = json.loads(loaded_file.read_text())
            rec["loaded"] = loaded["step"]
            if loaded["step"] < prev_clean:
                viol.append(f"loaded step {loaded['step']} although step {prev_clean} was clean")
            if loaded["step"]:
                ref = refs / f"state-{loaded['step']}.txt"
                if not ref.exists() or ref.read_text() != loaded["digest"]:
                    viol.append(f"loaded state of step {loaded['step']} differs from what was saved there")
        for nd in refs.glob(f"nondeterministic-{i}-*.txt"):
            viol.append(f"training not deterministic: {nd.name}")
        if final:
            if any(o.exitcode != 0 or o.error for o in outcomes):
                viol.append(
                    "the clean final run failed: "
                    + "; ".join(
                        (o.error or f"exit {o.exitcode}").strip().splitlines()[-1]
                        for o in outcomes
                        if o.exitcode != 0 or o.error
                    )
                )
        elif rec["killed"] is None:
            if rec["rank_errors"]:
                viol.append(f"the job failed with no kill: {sorted(rec['rank_errors'].items())[:2]}")
            else:
                rec["note"] = "no kill landed (the job ended first)"
        elif outcomes[rec["killed"]["rank"]].exitcode != -signal.SIGKILL:
            viol.append(f"victim rank {rec['killed']['rank']} exit code {outcomes[rec['killed']['rank']].exitcode}")
        survivors_stuck = [
            o.rank
            for o in outcomes
            if o.exitcode == -signal.SIGKILL and not (rec["killed"] and o.rank == rec["killed"]["rank"])
        ]
        if survivors_stuck:
            rec["survivors_stuck"] = survivors_stuck  # killed by run_ranks at its deadline
        v2, facts = check_root(root)
        viol += v2
        rec.update(facts)
        if facts.get("latest_clean") is not None:
            if facts["latest_clean"] < prev_clean:
                viol.append(f"latest_clean went back from {prev_clean} to {facts['latest_clean']}")
            prev_clean = max(prev_clean, facts["latest_clean"])
        if final:
            from scout_ckpt.ledger import Ledger
            from scout_ckpt.ops.certify import certify

            with Ledger.open(root, readonly=True) as led:
                before = {c["step"]: c["state"] for c in led.checkpoints()}
            res = certify(root)
            lost = [
                (c["step"], before.get(c["step"]), c["state"], [r.get("code") for r in c["reasons"]])
                for c in res
                if before.get(c["step"]) in ("committed", "certified") and c["state"] != "certified"
            ]
            if lost:
                viol.append(f"after the final clean run, certify rejects committed/certified steps: {lost}")
            if before.get(max(before, default=None)) != "certified":
                viol.append(f"the clean final run's last save is not certified: {before.get(max(before))}")
            rec["final_certified"] = [c["step"] for c in res if c["state"] == "certified"]
        rec["violations"] = viol
        out["violations"] += [f"chain {chain} iteration {i}: {v}" for v in viol]
        out["iterations"].append(rec)
        what = (
            "final clean run"
            if final
            else (f"{plan['how']} victim={plan['victim']} {plan['point'] or plan['delay_s']}")
        )
        C.log(
            f"torture chain {chain} it {i}: {'async' if plan['async'] else 'sync'} {what} "
            f"-> killed={bool(rec['killed'])} loaded={rec.get('loaded')} "
            f"clean={facts.get('latest_clean')} {wall:.1f}s" + (f"  VIOLATION {viol}" if viol else "")
        )
    return out


def run_torture(kills: int, seed: int, chain_len: int = 10, workdir: Path | None = None) -> dict:
    """Chains of `chain_len` killed incarnations (each chain also ends with a clean run) until `kills` SIGKILLs
    have landed (a timer may fire after its job ended; such iterations do not count), at most 2 * kills tries."""
    t0 = time.monotonic()
    chains = []
    with tempfile.TemporaryDirectory(prefix="scout-torture-", dir=workdir) as tmp:
        landed = tried = c = 0
        while landed < kills and tried < 2 * kills:
            n = min(chain_len, kills - landed)
            ch = run_chain(c, n, seed, Path(tmp))
            chains.append(ch)
            landed += sum(1 for r in ch["iterations"] if r["plan"]["victim"] is not None and r["killed"])
            tried += n
            c += 1
    its = [r for ch in chains for r in ch["iterations"] if r["plan"]["victim"] is not None]
    kills = [r for r in its if r["killed"]]
    by_where: dict[str, int] = {}
    for r in kills:
        w = r["killed"]["where"]
        key = w if w.startswith("hook") else "timer"
        by_where[key] = by_where.get(key, 0) + 1
    violations = [v for ch in chains for v in ch["violations"]]
    return {
        "iterations": len(its),
        "kills": len(kills),
        "no_kill": len(its) - len(kills),
        "kills_sync": sum(1 for r in kills if not r["plan"]["async"]),
        "kills_async": sum(1 for r in kills if r["plan"]["async"]),
        "kills_by_point": dict(sorted(by_where.items())),
        "survivor_timeouts": sum(1 for r in its if r.get("survivors_stuck")),
        "pending_writing_seen": sum(r.get("pending_writing", 0) for r in its),
        "checks": sum(1 + r.get("dirs", 0) for ch in chains for r in ch["iterations"]),
        "violations": violations,
        "n_violations": len(violations),
        "chains": len(chains),
        "wall_s": round(time.monotonic() - t0, 1),
        "seed": seed,
        "detail": [{k: v for k, v in r.items() if k != "violations"} for ch in chains for r in ch["iterations"]],
    }


def rows(t: dict) -> list[list]:
    return [
        ["iterations (incarnations with a victim)", t["iterations"]],
        ["kills landed", t["kills"]],
        ["  sync / async", f"{t['kills_sync']} / {t['kills_async']}"],
        ["  by point", ", ".join(f"{k.replace('hook:', '')} {v}" for k, v in t["kills_by_point"].items())],
        ["interrupted saves completed from manifest", t["pending_writing_seen"]],
        ["survivors killed at deadline", t["survivor_timeouts"]],
        ["violations", t["n_violations"]],
        ["wall s", t["wall_s"]],
    ]


def main(argv=None) -> int:
    p = C.parser("SIGKILL torture of sync and async saves (3 ranks, run_ranks)")
    p.add_argument("--kills", type=int, default=100, help="SIGKILLs that must land (default 100)")
    p.add_argument("--chain-len", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="directory for torture.json (default bench/results)")
    args = C.parse_args(p, {"kills": 2, "chain_len": 2}, argv)
    t = run_torture(args.kills, args.seed, args.chain_len)
    out = args.out or C.results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "torture.json").write_text(json.dumps(t, indent=1, default=str))
    if args.json:
        print(
            json.dumps(
                {k: v for k, v in t.items() if k != "detail"} | ({"smoke": True} if args.smoke else {}),
                sort_keys=True,
                default=str,
            )
        )
    else:
        C.print_table(rows(t), ["torture", "value"])
        for v in t["violations"]:
            print("VIOLATION", v)
    return 1 if t["n_violations"] else 0


if __name__ == "__main__":
    import torture as _self  # the rank function must be pickled as torture.torture_rank, not __main__'s

    raise SystemExit(_self.main())
