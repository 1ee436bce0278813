"""`run_demo`: the demo job under torchrun's own elastic agent, as users run their jobs.

The ranks are started, watched and restarted by `python -m torch.distributed.run --standalone --max-restarts K`
(the setting the README recommends, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment), not by code of
ours: a demo that plays torchrun's role itself (an earlier supervisor here did) shows what that code does, and hid
that the observer recorded nothing when torchrun tore a generation down.

Why a subprocess and not `torch.distributed.launcher.api.elastic_launch` in this process:
  * it is the command users type: the same argument parsing, environment and signal forwarding;
  * the agent hosts the rendezvous store, starts threads and installs SIGTERM/SIGINT handlers in the process it
    runs in; `run_demo` is called many times from one process (the campaign, the tests);
  * a job that never ends (a hang the observer does not break) can be stopped from outside: at the deadline
    the agent gets SIGTERM, which it forwards to its workers (SIGKILL after 30 s), then SIGKILL itself;
  * fault injection is unaffected either way: a crash is the rank's own SIGKILL, a hang its own block, and
    torchrun reacts to both exactly as it would in a user's job (the hang through the observer's abort).

What stays here is what torchrun cannot do: the option checks and fault specs, the run directory, reading
torchrun's generations back and the summary (summary.py). Generation boundaries are observed, not made: each
rank writes a start record keyed by TORCHELASTIC_RESTART_COUNT (train.py), the ledger's runs table holds the
incarnation each generation began (and where it resumed from), and its events what the observers recorded. A
generation's `ended` is the next generation's start (torchrun starts it only after every worker of the previous
one has stopped), the last one's the agent's exit.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from scout_ckpt.demo import summary
from scout_ckpt.demo.faults import MARKER_DIR, parse_all
from scout_ckpt.errors import BadInput
from scout_ckpt.format.layout import LEDGER_NAME

MODES = ("ddp", "fsdp", "hsdp")
REPLAY_TARGETS = 7  # embedding, 4 blocks, head, optimizer: one replayed per step
# What ends a generation: the observers' crash/hang/desync, or the Checkpointer's live_fault (a save found the live
# state bad and ended the generation on every rank).
INCIDENT_KINDS = ("crash", "hang", "desync", "live_fault")
AGENT_STOP_S = 40.0  # torchrun's own worker shutdown: SIGTERM, then SIGKILL after 30 s
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


def _say(quiet: bool, msg: str) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _check(ranks, steps, save_every, mode, constraint, mixing, max_restarts, stall_s, inject):
    if ranks < 1:
        raise BadInput(f"--ranks must be at least 1 (got {ranks})")
    if steps < 1:
        raise BadInput(f"--steps must be at least 1 (got {steps})")
    if save_every < 1:
        raise BadInput(f"--save-every must be at least 1 (got {save_every})")
    if mode not in MODES:
        raise BadInput(f"--mode must be one of {', '.join(MODES)} (got {mode!r})")
    if mode == "hsdp" and (ranks < 4 or ranks % 2):
        raise BadInput(f"--mode hsdp needs an even number of ranks, at least 4 (got {ranks})")
    if constraint not in (None, "sphere"):
        raise BadInput(f"--constraint must be sphere (got {constraint!r})")
    if mixing not in (None, "online"):
        raise BadInput(f"--mixing must be online (got {mixing!r})")
    if max_restarts < 0:
        raise BadInput(f"--max-restarts must be >= 0 (got {max_restarts})")
    if not stall_s > 0:
        raise BadInput(f"--stall-s must be positive (got {stall_s})")
    faults = parse_all(list(inject or []), ranks=ranks, steps=steps)
    for f in faults:  # these happen during a save: their step must be one
        if f.kind in ("crash", "bitflip") and f.step % save_every and f.step != steps:
            raise BadInput(f"--inject {f.spec!r}: step {f.step} is not a save step (--save-every {save_every})")
        if f.kind == "drift" and mixing != "online":
            raise BadInput(f"--inject {f.spec!r}: drift perturbs the online mixture weights (needs --mixing online)")
    return faults


def _prepare_dir(dir: str | os.PathLike | None, quiet: bool) -> Path:
    if dir is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        root = Path.cwd() / f"scout-demo-{stamp}"
        n = 1
        while root.exists():
            n += 1
            root = Path.cwd() / f"scout-demo-{stamp}-{n}"
        _say(quiet, f"demo directory: {root}")
    else:
        root = Path(dir)
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise BadInput(f"{root}: exists and is not an empty directory (the demo needs a fresh one)")
    (root / MARKER_DIR).mkdir(parents=True, exist_ok=True)
    return root.resolve()


def torchrun_command(root: Path, ranks: int, max_restarts: int, worker_args: str) -> list[str]:
    """The torchrun command line of the demo job (what the README tells users to run, with the demo's worker)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "--max-restarts",
        str(max_restarts),
        "--log-dir",
        str(root / MARKER_DIR / "torchrun"),
        "--redirects",
        "3",
        "-m",
        "scout_ckpt.demo.train",
        "--args-json",
        worker_args,
    ]


def _environment() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        PYTHONPATH=os.pathsep.join(filter(None, [PACKAGE_PARENT, os.environ.get("PYTHONPATH")])),
    )
    return env


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _starts(root: Path) -> dict[int, list[dict]]:
    """The ranks' start records (train.py) by generation (TORCHELASTIC_RESTART_COUNT)."""
    out: dict[int, list[dict]] = {}
    for path in (root / MARKER_DIR).glob("gen*-rank*.json"):
        rec = _read_json(path)
        if rec is not None:
            out.setdefault(int(rec["generation"]), []).append(rec)
    return out


def _stop(proc: subprocess.Popen, root: Path) -> None:
    """The deadline passed: SIGTERM the agent (it stops its workers, SIGKILL after 30 s), then SIGKILL it and any
    worker of ours still alive (their pids are in the start records)."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=AGENT_STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for recs in _starts(root).values():
        for rec in recs:
            if _is_our_worker(rec.get("pid"), root):
                try:
                    os.kill(rec["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _is_our_worker(pid, root: Path) -> bool:
    """Is `pid` still a demo worker of this run (and not another process that got its pid since)?"""
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            cmdline = f.read()
    except (OSError, TypeError, ValueError):
        return False
    return b"scout_ckpt.demo.train" in cmdline and str(root).encode() in cmdline


def _run_agent(cmd: list[str], root: Path, deadline: float, quiet: bool) -> tuple[int | None, float]:
    """Run torchrun to its end or the deadline: (its exit code or None after the deadline, when it ended).
    While it runs, say when a new generation starts (from the start records); nothing here acts on the job."""
    with open(root / MARKER_DIR / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_environment(),
            start_new_session=True,
        )
        seen = 0
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                return rc, time.time()
            except subprocess.TimeoutExpired:
                pass
            if not quiet:
                gens = _starts(root)
                while seen in gens:
                    _say(quiet, f"generation {seen}: torchrun started it (TORCHELASTIC_RESTART_COUNT={seen})")
                    seen += 1
            if time.monotonic() > deadline:
                _say(quiet, "deadline reached: stopping torchrun")
                _stop(proc, root)
                return None, time.time()


def _ledger_story(root: Path) -> tuple[list[dict], list[dict]]:
    """(runs, incident events) from the ledger; empty when there is none."""
    from scout_ckpt.errors import LedgerError
    from scout_ckpt.ledger import Ledger

    if not (root / LEDGER_NAME).exists():
        return [], []
    try:
        with Ledger.open(root, readonly=True) as ledger:
            return ledger.runs(), ledger.events(kinds=INCIDENT_KINDS)
    except LedgerError:
        return [], []


def generations(root: Path, rc: int | None, t_end: float) -> list[dict]:
    """One entry per generation torchrun started: {generation, started, ended, outcome, run_id, resumed_from,
    torchelastic, ranks_started, and for a failed one event/ranks/step/detected_by}. outcome: "ok" (the last one,
    torchrun exited 0), "failed" (torchrun restarted or gave up on it), "timeout" (the demo's deadline stopped it).
    run_id and resumed_from are the ledger's run (incarnation) that began within the generation. The event is the
    first crash/hang/desync the ledger holds for that run: written by its own observers ("observer") or by the
    next generation's ("previous_generation"); None when nobody recorded one."""
    starts = _starts(root)
    runs, incidents = _ledger_story(root)
    out = []
    numbers = sorted(starts)
    for i, n in enumerate(numbers):
        recs = starts[n]
        last = i == len(numbers) - 1
        started = min(r["started"] for r in recs)
        ended = t_end if last else min(r["started"] for r in starts[numbers[i + 1]])
        run = next((r for r in runs if started <= (r.get("started") or 0) < ended), None)
        info = {
            "generation": n,
            "started": started,
            "ended": ended,
            "outcome": ("ok" if rc == 0 else "timeout" if rc is None else "failed") if last else "failed",
            "run_id": run["id"] if run else None,
            "resumed_from": run.get("resumed_from") if run else None,
            "torchelastic": {
                "run_id": recs[0].get("torchelastic_run_id"),
                "restart_count": n,
                "max_restarts": recs[0].get("max_restarts"),
            },
            "ranks_started": sorted(r["rank"] for r in recs),
        }
        if info["outcome"] != "ok":
            ev = next((e for e in incidents if run and e.get("run_id") == run["id"]), None)
            source = (ev.get("detail") or {}).get("source") if ev else None
            info.update(
                event=ev["kind"] if ev else None,
                ranks=ev["ranks"] if ev else None,
                step=ev["step"] if ev else None,
                detected_by=None
                if ev is None
                else "checkpointer"
                if ev["kind"] == "live_fault"
                else "previous_generation"
                if source == "previous_generation"
                else "observer",
            )
        out.append(info)
    return out


def run_demo(
    dir: str | os.PathLike | None = None,
    ranks: int = 4,
    steps: int = 40,
    save_every: int = 10,
    async_save: bool = False,
    mode: str = "ddp",
    inject: list[str] | tuple[str, ...] = (),
    constraint: str | None = None,
    mixing: str | None = None,
    max_restarts: int = 3,
    stall_s: float = 3.0,
    quiet: bool = False,
    replay: bool | None = None,
    seed: int = 0,
    timeout_s: float = 900.0,
    pg_timeout_s: float = 120.0,
) -> dict:
    """Run the demo job under torchrun (which restarts it after crashes and, through the observer's abort, hangs)
    and return the `demo --json` document. Raises BadInput for bad options before starting anything.

    `replay=None` turns the SDC replay runner on when one full cycle over its targets fits between two saves
    (save_every > REPLAY_TARGETS; the first step of a fresh run only arms the capture): with fewer steps
    between saves, replay coverage could never be complete and no checkpoint could be certified.
    `pg_timeout_s` is the process groups' timeout: what ends a hang the observer does not break."""
    faults = _check(ranks, steps, save_every, mode, constraint, mixing, max_restarts, stall_s, inject)
    root = _prepare_dir(dir, quiet)
    t0 = time.monotonic()
    if replay is None:
        replay = save_every > REPLAY_TARGETS
    # train.WorkerArgs as JSON (built here without importing train.py, which imports torch)
    args = {
        "root": str(root),
        "steps": steps,
        "save_every": save_every,
        "mode": mode,
        "async_save": async_save,
        "inject": [f.spec for f in faults],
        "constraint": constraint,
        "mixing": mixing,
        "stall_s": stall_s,
        "replay": replay,
        "seed": seed,
        "global_batch": ranks * max(1, 16 // ranks),
        "pg_timeout_s": pg_timeout_s,
    }
    cmd = torchrun_command(root, ranks, max_restarts, json.dumps(args))
    _say(
        quiet,
        f"running {ranks} {mode} ranks under torchrun --standalone --max-restarts {max_restarts}"
        f" (agent log: {root / MARKER_DIR / 'torchrun.log'})",
    )
    rc, t_end = _run_agent(cmd, root, t0 + timeout_s, quiet)
    gens = generations(root, rc, t_end)
    for g in gens:
        if g["outcome"] != "ok":
            _say(
                quiet,
                f"generation {g['generation']}: {g['outcome']}, "
                + (
                    f"{g['event']} on rank(s) {g['ranks']} at step {g['step']} (recorded by {g['detected_by']})"
                    if g["event"]
                    else "no incident recorded in the ledger"
                ),
            )
    completed = rc == 0

    has_ledger = (root / LEDGER_NAME).exists()  # absent only if every generation died before its first save
    certified = summary.certify_committed(root) if has_ledger else []
    worker = _read_json(root / MARKER_DIR / "result.json") if completed else None
    worker = worker or {}
    result = {
        "dir": str(root),
        "ranks": ranks,
        "steps": steps,
        "save_every": save_every,
        "mode": mode,
        "async_save": async_save,
        "constraint": constraint,
        "mixing": mixing,
        "replay": replay,
        "checkpoints": summary.checkpoint_rows(root) if has_ledger else [],
        "events": summary.events(root) if has_ledger else [],
        "restarts": gens[-1]["generation"] if gens else 0,  # TORCHELASTIC_RESTART_COUNT of the last generation
        "final_digest": worker.get("final_digest"),
        "completed": completed,
        "losses": summary.losses(root),
        "wall_s": round(time.monotonic() - t0, 2),
        "injections": summary.injections(root, faults),
        "generations": gens,
        "rejections": summary.rejections(root) if has_ledger else [],
        "certify": [{"step": c["step"], "state": c["state"], "reasons": c["reasons"]} for c in certified],
        "launcher": {
            "command": "torchrun",
            "argv": cmd[1:-1] + ["<worker args>"],
            "exit_code": rc,
            "max_restarts": max_restarts,
            "log": str(root / MARKER_DIR / "torchrun.log"),
        },
    }
    if "mixing" in worker:
        result["mixing_weights"] = worker["mixing"]
    if "sphere_deviation" in worker:
        result["sphere_deviation"] = worker["sphere_deviation"]
    return result
