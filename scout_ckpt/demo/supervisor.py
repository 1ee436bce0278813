"""The demo's job supervisor: start N worker processes, watch them, restart the job after a crash or a hang.

It plays torchrun's role with one difference that matters (TORCH-NOTES: torchrun restarts): every generation gets
a fresh TCPStore hosted here on port 0, so a restarted generation can never try to reach the previous
generation's gloo addresses. Workers run in their own sessions, so one `killpg` ends a worker with everything it
started. After the job, the supervisor re-certifies the committed checkpoints (the on-disk bitflip of
`--inject bitflip` is caught there if no restart caught it first) and reads the story back from the ledger.
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

from scout_ckpt.demo.faults import MARKER_DIR, fired_records, parse_all
from scout_ckpt.errors import BadInput
from scout_ckpt.layout import LEDGER_NAME

MODES = ("ddp", "fsdp", "hsdp")
POLL_S = 0.05
REPLAY_TARGETS = 7   # embedding, 4 blocks, head, optimizer: one replayed per step
INCIDENT_KINDS = ("crash", "hang", "desync")  # what the observers write when they judge a failed generation
STARTUP_TIMEOUT_S = 180.0   # import torch + init + load, 4 processes on 2 cores
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


class Generation:
    """One incarnation of the job: `ranks` worker processes around a fresh TCPStore."""

    def __init__(self, root: Path, number: int, base_args: dict, ranks: int, pg_timeout_s: float):
        import torch.distributed as dist

        self.root, self.number, self.ranks = root, number, ranks
        self.store = dist.TCPStore("127.0.0.1", 0, ranks + 1, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=pg_timeout_s))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [PACKAGE_PARENT, os.environ.get("PYTHONPATH")])))
        env.pop("TORCHELASTIC_RUN_ID", None)
        self.started = time.time()
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        from scout_ckpt.demo.train import WorkerArgs

        for rank in range(ranks):
            args = WorkerArgs(**{**base_args, "rank": rank, "world": ranks, "port": self.store.port,
                                 "generation": number, "pg_timeout_s": pg_timeout_s})
            log = open(root / MARKER_DIR / f"gen{number}-rank{rank}.log", "wb")
            self.logs.append(log)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "scout_ckpt.demo.train", "--args-json", args.to_json()],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True))

    def progress(self) -> dict[int, int]:
        from scout_ckpt.demo.train import PROGRESS_KEY

        out = {}
        for r in range(self.ranks):
            key = f"{PROGRESS_KEY}/{r}"
            if self.store.check([key]):
                out[r] = int(self.store.get(key).decode())
        return out

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for log in self.logs:
            log.close()

    def log_tail(self, rank: int, n: int = 2000) -> str:
        data = (self.root / MARKER_DIR / f"gen{self.number}-rank{rank}.log").read_bytes()
        return data[-n:].decode(errors="replace")

    def incident(self) -> dict | None:
        """The first crash/hang/desync event the observers wrote to the ledger during this generation."""
        from scout_ckpt.errors import LedgerError
        from scout_ckpt.ledger import Ledger

        try:
            with Ledger.open(self.root, readonly=True) as ledger:
                events = ledger.events(kinds=INCIDENT_KINDS)
        except LedgerError:
            return None
        return next((e for e in events if (e.get("time") or 0) >= self.started), None)

    def watch(self, hang_timeout_s: float, grace_s: float, deadline: float) -> dict:
        """Wait for the generation to end: {"outcome": "ok"|"failed"|"hang"|"timeout", ...}.

        When a worker dies, the others are left alone for up to `grace_s` so that the observers can judge the
        incident and write it to the ledger (a SIGKILL of the whole job would kill them too)."""
        last_progress, last_change, failed_at = {}, time.monotonic(), None
        progress: dict[int, int] = {}
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c == 0 for c in codes):
                return {"outcome": "ok", "exit_codes": codes}
            now = time.monotonic()
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                if failed_at is None:
                    failed_at, first_failed, progress = now, failed, self.progress()
                incident = self.incident()
                if incident is not None or now - failed_at > grace_s:
                    return {"outcome": "failed", "exit_codes": codes, "failed": first_failed,
                            "progress": progress, "incident": incident}
            else:
                progress = self.progress()
                if progress != last_progress:
                    last_progress, last_change = progress, now
                limit = hang_timeout_s if progress else STARTUP_TIMEOUT_S
                if now - last_change > limit:
                    return {"outcome": "hang", "exit_codes": codes, "progress": progress,
                            "stalled_s": round(now - last_change, 1), "incident": self.incident()}
            if now > deadline:
                return {"outcome": "timeout", "exit_codes": codes, "progress": progress, "incident": None}
            time.sleep(POLL_S if failed_at is None else 0.1)


def _record_event(root: Path, kind: str, ranks: list[int], step: int | None, detail: dict) -> None:
    from scout_ckpt.ledger import Ledger

    with Ledger.open(root, create=True) as ledger:
        ledger.add_event(kind, step=step, ranks=ranks, detail=detail)


def _diagnose(gen: Generation, res: dict) -> tuple[str, list[int], int | None, dict]:
    """(event kind, ranks, step, detail) of a failed or hung generation, as the supervisor saw it: the dead
    ranks (SIGKILLed ones first), or the ranks whose progress stopped behind the others'."""
    progress = res.get("progress") or {}
    top = max(progress.values()) if progress else None
    detail = {"source": "supervisor", "generation": gen.number, "progress": {str(k): v for k, v in progress.items()}}
    if res["outcome"] == "failed":
        killed = [r for r in res["failed"] if res["exit_codes"][r] == -signal.SIGKILL]
        ranks = killed or res["failed"]
        detail["exit_codes"] = {str(r): res["exit_codes"][r] for r in res["failed"]}
        if not killed:
            detail["log_tail"] = gen.log_tail(res["failed"][0])
        step = max((progress.get(r, 0) for r in ranks), default=top)
        return "crash", ranks, step, detail
    behind = [r for r in range(gen.ranks) if progress.get(r, -1) < (top if top is not None else 0)]
    detail["stalled_s"] = res.get("stalled_s")
    return "hang" if res["outcome"] == "hang" else "timeout", behind, top, detail


def _certify_committed(root: Path) -> list[dict]:
    """Re-verify every committed or certified checkpoint offline (what `scout-ckpt certify` does)."""
    from scout_ckpt.certify import certify
    from scout_ckpt.ledger import Ledger

    with Ledger.open(root, readonly=True) as ledger:
        steps = [c["step"] for c in ledger.checkpoints(states=("committed", "certified"))]
    return certify(root, steps=steps) if steps else []


def _checkpoint_rows(root: Path) -> list[dict]:
    """The `ls --json` rows."""
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.views import checkpoint_rows

    with Ledger.open(root, readonly=True) as ledger:
        return checkpoint_rows(ledger)


def _rejections(root: Path) -> list[dict]:
    """Every verdict of `rejected` in the ledger's history, including those a later re-save replaced (a
    bitflipped step caught at load time is re-saved by the restarted job)."""
    from scout_ckpt.ledger import Ledger

    with Ledger.open(root, readonly=True) as ledger:
        return [{"step": c["step"], "source": c["source"], "time": c["time"],
                 "reasons": [r.get("code") for r in c["reasons"] or [] if isinstance(r, dict)]}
                for c in ledger.certifications() if c["state"] == "rejected"]


def _events(root: Path) -> list[dict]:
    from scout_ckpt.report import timeline

    return [{"kind": e["kind"], "ranks": e["ranks"], "step": e["step"], "time": e["time"], "detail": e["detail"]}
            for e in timeline(root)["events"]]


def _losses(root: Path) -> dict:
    """The loss per step, from the rank-0 logs; a step redone after a restart keeps its latest value."""
    by_step: dict[int, tuple[int, float]] = {}
    for path in sorted((root / MARKER_DIR).glob("log-gen*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by SIGKILL
            if "loss" in rec and (rec["step"] not in by_step or rec["generation"] >= by_step[rec["step"]][0]):
                by_step[rec["step"]] = (rec["generation"], rec["loss"])
    curve = [[s, by_step[s][1]] for s in sorted(by_step)]
    return {"first": curve[0][1] if curve else None, "last": curve[-1][1] if curve else None, "curve": curve}


def _injections(root: Path, faults) -> list[dict]:
    fired: dict[str, list[dict]] = {}
    for rec in fired_records(root):
        fired.setdefault(rec["spec"], []).append(rec)
    return [{**f.to_json(), "fired": fired.get(f.spec, [])} for f in faults]


def run_demo(dir: str | os.PathLike | None = None, ranks: int = 4, steps: int = 40, save_every: int = 10,
             async_save: bool = False, mode: str = "ddp", inject: list[str] | tuple[str, ...] = (),
             constraint: str | None = None, mixing: str | None = None, max_restarts: int = 3,
             stall_s: float = 3.0, quiet: bool = False, replay: bool | None = None, seed: int = 0,
             hang_timeout_s: float | None = None, timeout_s: float = 900.0, pg_timeout_s: float = 120.0) -> dict:
    """Run the demo job to completion (restarting it after crashes and hangs) and return the `demo --json`
    document. Raises BadInput for bad options before starting anything.

    `replay=None` turns the SDC replay runner on when one full cycle over its targets fits between two saves
    (save_every > REPLAY_TARGETS; the first step of a fresh run only arms the capture): with fewer steps
    between saves, replay coverage could never be complete and no checkpoint could be certified."""
    faults = _check(ranks, steps, save_every, mode, constraint, mixing, max_restarts, stall_s, inject)
    root = _prepare_dir(dir, quiet)
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    hang_timeout_s = hang_timeout_s if hang_timeout_s is not None else max(15.0, 5 * stall_s)
    grace_s = stall_s + 2.0
    if replay is None:
        replay = save_every > REPLAY_TARGETS
    base = {"root": str(root), "steps": steps, "save_every": save_every, "mode": mode, "async_save": async_save,
            "inject": [f.spec for f in faults], "constraint": constraint, "mixing": mixing, "stall_s": stall_s,
            "replay": replay, "seed": seed, "global_batch": ranks * max(1, 16 // ranks)}
    generations: list[dict] = []
    restarts, completed = 0, False
    while True:
        n = len(generations)
        _say(quiet, f"generation {n}: starting {ranks} {mode} ranks")
        gen = Generation(root, n, base, ranks, pg_timeout_s)
        try:
            res = gen.watch(hang_timeout_s, grace_s, deadline)
        finally:
            gen.kill()
        info = {"generation": n, "outcome": res["outcome"], "started": gen.started, "ended": time.time(),
                "exit_codes": [p.returncode for p in gen.procs]}
        if res["outcome"] == "ok":
            generations.append(info)
            completed = True
            break
        incident = res.get("incident")
        if incident is not None:  # the observers judged it and wrote the event
            kind, bad, step = incident["kind"], incident["ranks"], incident["step"]
        else:
            kind, bad, step, detail = _diagnose(gen, res)
            if kind != "timeout":
                _record_event(root, kind, bad, step, detail)
        info.update({"event": kind, "ranks": bad, "step": step,
                     "detected_by": "observer" if incident is not None else "supervisor"})
        generations.append(info)
        _say(quiet, f"generation {n}: {kind} on rank(s) {bad or '?'} at step {step}")
        if res["outcome"] == "timeout" or restarts >= max_restarts:
            _say(quiet, f"giving up after {restarts} restart(s)")
            break
        restarts += 1
        _say(quiet, f"restarting from the latest clean checkpoint ({restarts}/{max_restarts})")
    del gen

    has_ledger = (root / LEDGER_NAME).exists()  # absent only if every generation died before its first save
    certified = _certify_committed(root) if has_ledger else []
    result_path = root / MARKER_DIR / "result.json"
    worker = json.loads(result_path.read_text()) if completed and result_path.exists() else {}
    result = {
        "dir": str(root), "ranks": ranks, "steps": steps, "save_every": save_every, "mode": mode,
        "async_save": async_save, "constraint": constraint, "mixing": mixing, "replay": replay,
        "checkpoints": _checkpoint_rows(root) if has_ledger else [],
        "events": _events(root) if has_ledger else [], "restarts": restarts,
        "final_digest": worker.get("final_digest"), "completed": completed, "losses": _losses(root),
        "wall_s": round(time.monotonic() - t0, 2), "injections": _injections(root, faults),
        "generations": generations, "rejections": _rejections(root) if has_ledger else [],
        "certify": [{"step": c["step"], "state": c["state"], "reasons": c["reasons"]} for c in certified],
    }
    if "mixing" in worker:
        result["mixing_weights"] = worker["mixing"]
    if "sphere_deviation" in worker:
        result["sphere_deviation"] = worker["sphere_deviation"]
    return result


def print_summary(result: dict, console=None) -> None:
    """The human summary of a demo run: checkpoints, events, restarts, loss, final digest."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from scout_ckpt.views import STATE_STYLE, evidence_marks, reason_text

    console = console or Console()
    table = Table(title=f"scout-ckpt demo: {result['ranks']} ranks, {result['steps']} steps ({result['mode']})")
    for col in ("step", "state", "evidence", "bytes", "reasons"):
        table.add_column(col, justify="right" if col in ("step", "bytes") else "left")
    for c in result["checkpoints"]:
        reasons = escape(reason_text(c["reasons"])) or "-"
        state = f"[{STATE_STYLE.get(c['state'], 'white')}]{c['state']}[/]"
        table.add_row(str(c["step"]), state, evidence_marks(c["evidence"]), f"{c['bytes']:,}" if c["bytes"] else "-",
                      reasons)
    console.print(table)
    if result["events"]:
        ev_table = Table(title="events")
        for col in ("time", "kind", "ranks", "step", "detail"):
            ev_table.add_column(col)
        for e in result["events"]:
            when = datetime.datetime.fromtimestamp(e["time"]).strftime("%H:%M:%S") if e["time"] else "-"
            detail = {k: v for k, v in (e["detail"] or {}).items() if k not in ("log_tail", "progress")}
            ev_table.add_row(when, e["kind"], ",".join(map(str, e["ranks"] or [])) or "-",
                             "-" if e["step"] is None else str(e["step"]), json.dumps(detail)[:70])
        console.print(ev_table)
    for r in result.get("rejections", []):
        console.print(f"step {r['step']} rejected by {r['source']}: {', '.join(r['reasons']) or '?'}")
    losses = result["losses"]
    loss = f"{losses['first']:.3f} -> {losses['last']:.3f}" if losses["first"] is not None else "-"
    for f in result["injections"]:
        console.print(f"injected {f['spec']}: " + (f"fired {len(f['fired'])}x" if f["fired"] else "did not fire"))
    console.print(f"restarts: {result['restarts']}    loss: {loss}    wall: {result['wall_s']:.1f} s")
    console.print(f"final digest: {result['final_digest'] or '(job did not complete)'}")
    console.print(f"dir: {result['dir']}")
