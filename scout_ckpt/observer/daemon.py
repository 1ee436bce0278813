"""The out-of-band observer: one process per training process, watching its heartbeat from outside.

Why a separate process: a trainer blocked in a collective, SIGSTOPped or killed cannot report on itself, and a
thread inside it would share its fate (and its GIL). The observer is started with subprocess (no fork of a
threaded trainer), never imports torch (1.4 s and 226 MB), and exits by itself once its trainer is gone.

Side channel: a directory of small JSON files under ROOT/reports/.observer/RUN_ID/, one status per rank,
replaced atomically every `exchange_s` (0.5 s). It never touches the training process groups, keeps working
while they are stuck, and needs a ROOT shared by all hosts (as DCP checkpoints usually are).

Verdicts (`attribute`, a pure function) use strict majorities over the world size:
  crash   a trainer that is gone without a clean close and without having seen a collective fail (a victim of a
          peer's death has), while the survivors and victims are a strict majority (else it is a job-wide kill);
  desync  while a strict majority is stalled, ranks entered the same collective number with different
          fingerprints (the odd ones out, if one fingerprint holds a strict majority), or ranks wait in a
          training collective further on than the waiting majority;
  hang    a strict majority is stuck for stall_s at the same (step, seq), waiting in a collective (training or
          side group) or inside a step (DDP's all-reduce runs in C++); the ranks behind it are hung. With no
          laggard it is a hang only if the majority sits in one training collective (else: a long save or
          eval). A SIGSTOPped trainer (state T) that made no progress for stall_s is hung whatever its
          progress.
The judge is the lowest-ranked live observer; an O_EXCL claim file per incident makes the write exactly-once
even if two observers briefly disagree on who is the judge. Stacks come from each stalled rank's own observer
(SIGUSR1 -> faulthandler), captured once per stall before any verdict, so the judge rarely waits for them.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from scout_ckpt.errors import ScoutError
from scout_ckpt.layout import REPORTS_DIR, atomic_write_json
from scout_ckpt.observer import stacks as stacks_mod
from scout_ckpt.observer.heartbeat import Heartbeat, HeartbeatReader, default_path

log = logging.getLogger("scout_ckpt.observer")

ABORT_KINDS = ("hang", "desync", "crash")
INCIDENT_KINDS = ABORT_KINDS


def channel_dir(root: str | os.PathLike, run_id: str) -> Path:
    return Path(root) / REPORTS_DIR / ".observer" / run_id


def _read_json(path: Path) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _write_status(path: Path, obj: dict) -> None:
    """Atomic replace without fsync: the status is ephemeral, only its atomicity matters."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
    os.replace(tmp, path)


# ---- attribution (pure) -------------------------------------------------------------------------------------


def _prog(row: dict) -> tuple[int, int]:
    return (row["step"], row["seq"])


def attribute(rows: dict[int, dict], world_size: int, stall_s: float, order_gap_s: float = 0.05) -> dict | None:
    """The verdict on a table of observer statuses ({rank: row}, ages already brought up to date), or None.

    Returns {"kind", "ranks", "step", "seq", "attribution", "reason"}; `ranks` is empty when a fault is seen but
    no strict majority points at anyone."""
    majority = world_size // 2 + 1
    # Ranks that entered the same collective number with different fingerprints: a desync, whatever else
    # followed (a mismatched collective may fail and take its ranks down, or hang). In SPMD training equal
    # numbers mean the same collective, so no stall is needed to be sure.
    desync = fingerprint_mismatch(rows, majority)
    if desync:
        return desync
    gone = sorted(r for r, row in rows.items() if row["state"] == "gone")
    culprits = [r for r in gone if not row_error(rows[r])]
    if culprits:
        if world_size - len(culprits) >= majority:
            last = min(culprits, key=lambda r: _prog(rows[r]))
            return {"kind": "crash", "ranks": culprits, "step": rows[last]["step"], "seq": rows[last]["seq"],
                    "attribution": "strict_majority",
                    "reason": f"trainer process of rank(s) {culprits} is gone without a clean close "
                              f"({len(gone) - len(culprits)} other(s) died after a collective failed)"}
        first = first_gone(rows, culprits, order_gap_s)
        if first and world_size - len(first) >= majority:
            last = min(first, key=lambda r: _prog(rows[r]))
            return {"kind": "crash", "ranks": first, "step": rows[last]["step"], "seq": rows[last]["seq"],
                    "attribution": "first_gone",
                    "reason": f"trainer process of rank(s) {first} died first, >= {order_gap_s:g}s before any "
                              f"other rank (the others were torn down after it, e.g. by torchrun)"}
        return None
    live = {r: row for r, row in rows.items() if row["state"] in ("running", "stopped")}
    stalled = [r for r, row in live.items() if row["age_s"] >= stall_s]
    stopped = sorted(r for r in stalled if live[r]["state"] == "stopped")
    waiting = [r for r in stalled if live[r]["state"] == "running" and (live[r]["in_coll"] or live[r].get("in_side"))]
    # stalled and busy: waiting in a collective we see, or inside a step (e.g. in DDP's C++ all-reduce)
    busy = [r for r in stalled if live[r]["state"] == "running"
            and (r in waiting or live[r].get("phase", "idle") != "idle")]
    counts = Counter(_prog(live[r]) for r in busy)
    point, n = counts.most_common(1)[0] if counts else (None, 0)
    if n >= majority:
        step, seq = point
        ahead = sorted(r for r in waiting if _prog(live[r]) > point and live[r]["in_coll"])
        if ahead:
            return {"kind": "desync", "ranks": ahead, "step": step, "seq": seq,
                    "attribution": "strict_majority",
                    "reason": f"the majority waits in collective #{seq} at step {step}; rank(s) {ahead} "
                              f"wait in a later collective"}
        behind = sorted(r for r in live if _prog(live[r]) < point)
        ranks = sorted(set(behind) | set(stopped))
        in_training_coll = sum(1 for r in busy if _prog(live[r]) == point and live[r]["in_coll"])
        if ranks or in_training_coll >= majority:
            reason = (f"{n} of {world_size} ranks are stuck at collective #{seq}, step {step}, for "
                      f">= {stall_s:g}s; " + (f"rank(s) {ranks} never got there" if behind else
                                             f"rank(s) {ranks} are stopped" if ranks else
                                             "every rank is inside it (no laggard)"))
            return {"kind": "hang", "ranks": ranks, "step": step, "seq": seq,
                    "attribution": "strict_majority" if ranks else "none", "reason": reason}
        # equal progress, no laggard, and not a training collective (a long save, an eval): no verdict
    if stopped:
        r0 = stopped[0]
        return {"kind": "hang", "ranks": stopped, "step": live[r0]["step"], "seq": live[r0]["seq"],
                "attribution": "stopped",
                "reason": f"trainer process of rank(s) {stopped} is stopped (SIGSTOP) for >= {stall_s:g}s"}
    if n < majority and len(waiting) >= majority:
        return {"kind": "hang", "ranks": [], "step": max(live[r]["step"] for r in waiting),
                "seq": max(live[r]["seq"] for r in waiting), "attribution": "inconclusive",
                "reason": "a majority waits in collectives, but at different points: no strict majority"}
    return None


def fingerprint_mismatch(live: dict[int, dict], majority: int) -> dict | None:
    """Ranks that entered the same collective number with different fingerprints: a desync."""
    by_seq: dict[int, list[int]] = {}
    for r, row in live.items():
        if row["seq"] > 0:
            by_seq.setdefault(row["seq"], []).append(r)
    for seq, ranks in sorted(by_seq.items()):
        fps = Counter(live[r]["fp"] for r in ranks)
        if len(fps) < 2:
            continue
        fp, count = fps.most_common(1)[0]
        odd = sorted(r for r in ranks if live[r]["fp"] != fp)
        attributed = count >= majority
        step = min(live[r]["step"] for r in ranks)
        return {"kind": "desync", "ranks": odd if attributed else [], "step": step, "seq": seq,
                "attribution": "strict_majority" if attributed else "inconclusive",
                "reason": f"collective #{seq}: ranks entered collectives with {len(fps)} different fingerprints"
                          + ("" if attributed else f"; no strict majority (suspects {odd})")}
    return None


def first_gone(rows: dict[int, dict], candidates: list[int], gap_s: float) -> list[int]:
    """The ranks among `candidates` that died first, separated by at least `gap_s` from the next death (each
    observer stamps its trainer's death: `gone_at`, wall time, from PR_SET_PDEATHSIG where it has it); [] when
    the order is not clear (a job-wide kill takes every rank within milliseconds)."""
    times = sorted((rows[r]["gone_at"], r) for r in candidates if rows[r].get("gone_at") is not None)
    if len(times) < len(candidates) or len(times) < 2:
        return []
    for i in range(1, len(times)):
        if times[i][0] - times[i - 1][0] >= gap_s:
            return sorted(r for _t, r in times[:i])
    return []


def row_error(row: dict) -> bool:
    return bool(row.get("error"))


def incident_key(v: dict) -> str:
    ranks = "-".join(str(r) for r in v["ranks"]) or "none"
    return f"{v['kind']}-s{v['step']}-q{v['seq']}-r{ranks}"


# ---- the training side's handle -----------------------------------------------------------------------------


class Observer:
    """Started by every rank after init_process_group (collective in the sense that every rank must start one);
    owns the heartbeat, the stack-dump handler, the collective tracer and the observer process."""

    def __init__(self, cfg: dict, heartbeat: Heartbeat, dumper: stacks_mod.StackDumper, proc: subprocess.Popen,
                 tracer, ddp_hook=None):
        self.cfg, self.heartbeat, self._dumper, self.proc, self.tracer = cfg, heartbeat, dumper, proc, tracer
        self.channel = Path(cfg["channel"])
        self.rank = cfg["rank"]
        self._ddp_hook = ddp_hook or (None, None)  # (hook, state): None = the default, False = register none
        self.attached: str | None = None

    @classmethod
    def start(cls, root: str | os.PathLike, *, rank: int, world_size: int, run_id: str, stall_s: float = 60.0,
              action: str = "report", poll_s: float = 0.25, health_source=None, store=None,
              exchange_s: float = 0.5, trace: bool = True, ignore_groups=(), straggler: dict | None = None,
              health_poll_s: float = 10.0, linger_s: float = 4.0, ready_timeout_s: float = 60.0,
              local_rank: int | None = None, ddp_comm_hook=None, ddp_comm_state=None) -> "Observer":
        """Start this rank's observer. `health_source`: where hardware health comes from, described by name
        (the observer process builds it; nothing is pickled): "module:factory" or {"factory": "module:factory",
        "kwargs": {...JSON...}}, the factory returning an object with poll() -> list[dict] (default: NVML for
        GPU `local_rank`, quiet without one). `store`: an optional c10d Store used to check that every rank
        uses the same side-channel directory. `ignore_groups`: process groups whose collectives are not training
        collectives (the checkpointer's side groups). `ddp_comm_hook`/`ddp_comm_state`: the user's own DDP comm
        hook, registered by `attach` in place of the default (see observer/ddp.py for the rule); False registers
        none (DDP's gradient all-reduces then stay unseen)."""
        if action not in ("report", "abort"):
            raise ScoutError(f"observer action must be report or abort (got {action!r})")
        health = health_spec(health_source)
        channel = channel_dir(root, run_id)
        channel.mkdir(parents=True, exist_ok=True)
        if store is not None:
            _check_same_channel(store, run_id, rank, world_size, channel, ready_timeout_s)
        status = channel / f"status-{rank}.json"
        status.unlink(missing_ok=True)
        hb = Heartbeat.create(default_path(run_id, rank))
        dumper = stacks_mod.StackDumper(channel / f"stacks-{rank}.log")
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
        cfg = {"root": str(Path(root).resolve()), "rank": rank, "world_size": world_size, "run_id": run_id,
               "channel": str(channel.resolve()), "trainer_pid": os.getpid(), "heartbeat": str(hb.path),
               "stall_s": stall_s, "action": action, "poll_s": poll_s, "exchange_s": exchange_s,
               "straggler": straggler or {}, "health_poll_s": health_poll_s, "linger_s": linger_s,
               "local_rank": local_rank, "signal": int(dumper.sig),
               "health": health}
        cfg_path = channel / f"observer-{rank}.json"
        atomic_write_json(cfg_path, cfg)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        with open(channel / f"observer-{rank}.log", "ab") as errlog:
            proc = subprocess.Popen([sys.executable, "-m", "scout_ckpt.observer.daemon", str(cfg_path)],
                                    stdin=subprocess.DEVNULL, stdout=errlog, stderr=errlog, env=env,
                                    start_new_session=True, close_fds=True)
        tracer = None
        try:
            if not _wait_for(lambda: (_read_json(status) or {}).get("observer_pid") == proc.pid, 30.0,
                             lambda: proc.poll() is not None):
                raise ScoutError(f"observer of rank {rank} did not start (exit code {proc.poll()}); "
                                 f"see {channel / f'observer-{rank}.log'}")
            if trace:
                from scout_ckpt.observer.fingerprints import CollectiveTracer

                tracer = CollectiveTracer.install(hb, ignore=ignore_groups)
        except BaseException:
            proc.kill()
            proc.wait()
            dumper.close()
            hb.close()
            raise
        obs = cls(cfg, hb, dumper, proc, tracer, (ddp_comm_hook, ddp_comm_state))
        _watch_uncaught()
        atexit.register(obs._at_exit)
        missing = obs.wait_peers(ready_timeout_s)
        if missing:
            log.warning("observer: no status from rank(s) %s after %.0fs in %s (is ROOT shared by every host?)",
                        missing, ready_timeout_s, channel)
        return obs

    def wait_peers(self, timeout_s: float) -> list[int]:
        """Waits until every rank's observer has published a status; returns the ranks still missing."""
        ws = self.cfg["world_size"]
        paths = [self.channel / f"status-{r}.json" for r in range(ws)]
        _wait_for(lambda: all(p.exists() for p in paths), timeout_s)
        return [r for r, p in enumerate(paths) if not p.exists()]

    def attach(self, model) -> str:
        """Make `model`'s own collectives visible (called by the Checkpointer on the model it is given): on a
        DDP module, registers the tracing comm hook (observer/ddp.py says how a user's own hook composes);
        FSDP2's collectives are seen without it. Returns what was done; "not_traced" when tracing is off."""
        hook, state = self._ddp_hook
        if self.tracer is None:
            self.attached = "not_traced"
        elif hook is False:
            self.attached = "hook_disabled"
        else:
            from scout_ckpt.observer.ddp import attach

            self.attached = attach(model, hook, state)
        log.info("observer of rank %d: attach -> %s", self.rank, self.attached)
        return self.attached

    @property
    def pid(self) -> int:
        return self.proc.pid

    def step(self, n: int, duration_s: float | None = None) -> None:
        self.heartbeat.step(n, duration_s)

    def phase(self, name: str):
        return self.heartbeat.phase(name)

    def _at_exit(self) -> None:
        """A normal interpreter exit without Checkpointer.close() is a clean end, not a crash; an exit through an
        uncaught exception is not (its heartbeat stays open, so the observers judge it)."""
        if not _UNCAUGHT:
            self.stop()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Clean shutdown: the closed heartbeat tells the observer (and its peers) this is no crash."""
        atexit.unregister(self._at_exit)
        if self.tracer is not None:
            self.tracer.uninstall()
            self.tracer = None
        self.heartbeat.close(unlink=True)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dumper.close()


_UNCAUGHT: list = []


def _watch_uncaught() -> None:
    """Chains sys.excepthook once, to note that the interpreter is ending through an uncaught exception."""
    if getattr(sys.excepthook, "__scout__", False):
        return
    previous = sys.excepthook

    def hook(tp, value, tb):
        _UNCAUGHT.append(tp.__name__)
        previous(tp, value, tb)

    hook.__scout__ = True
    sys.excepthook = hook


def health_spec(source) -> dict | None:
    """The JSON description of a health source: {"factory": "module:callable", "kwargs": {...}}. The observer
    process imports the factory by name and calls it; an object is refused (the side channel and the config are
    JSON only: a pickle read back from a shared directory would run whatever code it names)."""
    if source is None:
        return None
    if isinstance(source, str):
        source = {"factory": source}
    if not isinstance(source, dict) or set(source) - {"factory", "kwargs"} or not isinstance(
            source.get("factory"), str) or ":" not in source["factory"]:
        raise ScoutError("observer health_source must be 'module:factory' or {'factory': 'module:factory', "
                         f"'kwargs': {{...}}}} (got {type(source).__name__})")
    kwargs = source.get("kwargs", {})
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError) as e:
        raise ScoutError(f"observer health_source kwargs must be JSON ({e})") from None
    if not isinstance(kwargs, dict):
        raise ScoutError("observer health_source kwargs must be a JSON object")
    return {"factory": source["factory"], "kwargs": kwargs}


def load_factory(name: str):
    """'package.module:attr' -> the attribute (what the health spec names)."""
    module, _, attr = name.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _wait_for(cond, timeout_s: float, abort=lambda: False, every: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if abort() or time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def _check_same_channel(store, run_id: str, rank: int, world_size: int, channel: Path, timeout_s: float) -> None:
    import datetime

    keys = [f"scout-observer/{run_id}/{r}" for r in range(world_size)]
    store.set(keys[rank], str(channel.resolve()))
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    dirs = {store.get(k).decode() for k in keys}
    if len(dirs) > 1:
        raise ScoutError(f"observer side channel differs between ranks: {sorted(dirs)} (ROOT must be shared)")


# ---- the observer process -----------------------------------------------------------------------------------


class Daemon:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.rank, self.world = cfg["rank"], cfg["world_size"]
        self.channel = Path(cfg["channel"])
        self.claims = self.channel / "claims"
        self.claims.mkdir(exist_ok=True)
        self.pid = cfg["trainer_pid"]
        self.stall_s = cfg["stall_s"]
        self.poll_s, self.exchange_s = cfg["poll_s"], cfg["exchange_s"]
        self.live_timeout_s = max(4 * self.exchange_s, 2.0)
        self.crash_confirm_s = 2 * self.exchange_s + self.poll_s
        self.stacks_wait_s = max(2.0, 3 * self.exchange_s)
        self.reader = HeartbeatReader(cfg["heartbeat"])
        self.status_path = self.channel / f"status-{self.rank}.json"
        self.t_start = time.time()
        self.t0 = time.monotonic()
        self.aftermath_pending, self.next_aftermath = True, 0.0
        self.beat = 0
        self.version = -1
        self.last_change = time.monotonic()
        self.snap = self.reader.snapshot()
        self.state = "running"
        self.gone_since: float | None = None
        self.gone_at: float | None = None  # wall time of the trainer's death, for the order of deaths
        self._death_signal_at: float | None = None
        self.aborted = False
        self.stacks: dict | None = None
        self.peer_seen: dict[int, tuple[int, float]] = {}
        self.pending: dict[str, tuple[float, dict]] = {}
        self.known_claims: set[str] = set()
        self.health = self._health_source()
        self.next_health = 0.0
        from scout_ckpt.observer.stragglers import StragglerMonitor

        self.stragglers = StragglerMonitor(**cfg["straggler"])
        self._stop = False
        self._ledger = None

    def _health_source(self):
        spec = self.cfg["health"]
        if spec:
            return load_factory(spec["factory"])(**spec.get("kwargs", {}))
        from scout_ckpt.observer.health import default_source

        return default_source(self.cfg["local_rank"])

    # ---- own trainer ---------------------------------------------------------------------------------------

    def _trainer_state(self) -> str:
        if self.aborted:
            return "aborted"
        if self.snap.closed:
            return "closed"
        if os.getppid() != self.pid:
            return "gone"
        st = stacks_mod.proc_state(self.pid)
        if st is None or st in ("Z", "X"):
            return "gone"
        return "stopped" if st == "T" else "running"

    def _observe(self, now: float) -> None:
        self.snap = self.reader.snapshot()
        if self.snap.version != self.version:
            self.version, self.last_change = self.snap.version, now
        self.state = self._trainer_state()
        if self.state in ("gone", "closed", "aborted") and self.gone_since is None:
            self.gone_since = now
            if self.state == "gone":
                self.gone_at = self._death_signal_at or time.time()
            log.info("trainer %d is %s", self.pid, self.state)
        if self.state in ("running", "stopped") and now - self.last_change >= self.stall_s:
            self._capture_stacks()

    def _capture_stacks(self) -> None:
        if self.stacks is not None and self.stacks["hb"] == self.version:
            return
        got = stacks_mod.capture(self.pid, self.channel / f"stacks-{self.rank}.log", self.cfg["signal"])
        self.stacks = {"hb": self.version, **({"span": list(got)} if isinstance(got, tuple) else {"reason": got})}
        log.info("stacks of trainer %d: %s", self.pid, self.stacks)

    def _status(self, now: float) -> dict:
        s = self.snap
        return {"rank": self.rank, "observer_pid": os.getpid(), "pid": self.pid, "beat": self.beat,
                "state": self.state, "step": s.step, "phase": s.phase, "seq": s.seq_enter, "fp": f"{s.fp_enter:016x}",
                "seq_left": s.seq_leave, "in_coll": s.in_coll, "in_side": s.in_side, "error": s.coll_error, "hb": self.version,
                "age_s": round(now - self.last_change, 3), "t_update": s.t_update, "n_steps": s.n_steps,
                "busy_sum": s.busy_sum, "dur_sum": s.dur_sum, "last_dur": s.last_dur, "stacks": self.stacks,
                "wall": time.time(), "torch_imported": "torch" in sys.modules,
                "gone_at": self.gone_at, "host": _HOST, "t_start": self.t_start}

    # ---- peers ---------------------------------------------------------------------------------------------

    def _read_row(self, r: int, now: float) -> dict | None:
        row = dict(self.last_status) if r == self.rank else _read_json(self.channel / f"status-{r}.json")
        if row is None:
            return None
        seen = self.peer_seen.get(r)
        if seen is None or seen[0] != row["beat"]:
            self.peer_seen[r] = seen = (row["beat"], now)
        row["live"] = r == self.rank or now - seen[1] < self.live_timeout_s
        row["age_s"] = row["age_s"] + (now - seen[1])  # the row is as old as the time since we first saw it
        return row

    def _judge_rows(self, now: float) -> dict[int, dict] | None:
        """All rows if this observer is the judge (the lowest-ranked live one), else None. A non-judge reads
        only the rows below its own rank, and stops at the first live one."""
        rows: dict[int, dict] = {}
        for r in range(self.world):
            row = self._read_row(r, now)
            if row is None:
                continue
            if r < self.rank and row["live"] and row["state"] not in ("aborted", "closed"):
                return None
            rows[r] = row
        return rows

    # ---- verdicts ------------------------------------------------------------------------------------------

    def _unresolved_incident(self, rows: dict[int, dict]) -> bool:
        """An incident was already reported and no rank got past it since: later deaths are its consequence
        (the supervisor's kill), not new faults."""
        top = max((_prog(r) for r in rows.values()), default=(0, 0))
        for name in self.known_claims:
            claim = _read_json(self.claims / name)
            if claim and claim.get("kind") in INCIDENT_KINDS and tuple(claim.get("progress_max", (0, 0))) >= top:
                return True
        return False

    def _judge(self, now: float, rows: dict[int, dict]) -> None:
        running = {r: (row["n_steps"], row["busy_sum"], row["step"]) for r, row in rows.items()
                   if row["state"] == "running" and row["live"]}
        if len(running) == self.world:
            for ev in self.stragglers.update(now, running):
                key = f"straggler-r{ev['ranks'][0]}-s{ev['step']}"
                self._publish_event("straggler", ev["ranks"], ev["step"], ev["detail"], key, rows)
        # a row whose observer stopped beating is unknown, unless its last word was final
        known = {r: row for r, row in rows.items() if row["live"] or row["state"] in ("gone", "closed", "aborted")}
        verdict = attribute(known, self.world, self.stall_s)
        if verdict is None:
            self.pending.clear()
            return
        key = incident_key(verdict)
        if (self.claims / f"{key}.json").exists() or self._unresolved_incident(rows):
            return
        first, _ = self.pending.get(key, (now, verdict))
        self.pending = {key: (first, verdict)}
        if verdict["kind"] == "crash" and now - first < self.crash_confirm_s:
            return
        named = verdict["ranks"] or sorted(rows)
        fresh = {r: rows[r].get("stacks") for r in named
                 if rows[r].get("stacks") and rows[r]["stacks"]["hb"] == rows[r]["hb"]}
        needs = [r for r in named if rows[r]["state"] == "running" and r not in fresh]
        if needs and verdict["kind"] != "crash" and now - first < self.stacks_wait_s:
            return
        stacks = {}
        for r in named:
            st = fresh.get(r)
            if rows[r]["state"] == "gone":
                stacks[str(r)] = "process is gone"
            elif st is None:
                stacks[str(r)] = "no stack dump captured"
            elif "span" in st:
                stacks[str(r)] = stacks_mod.read_dump(self.channel / f"stacks-{r}.log", tuple(st["span"]))
            else:
                stacks[str(r)] = st["reason"]
        detail = {"attribution": verdict["attribution"], "reason": verdict["reason"], "seq": verdict["seq"],
                  "stall_s": self.stall_s, "stacks": stacks, "action": self.cfg["action"]}
        self._publish_event(verdict["kind"], verdict["ranks"], verdict["step"], detail, key, rows)
        self.pending.clear()

    def _publish_event(self, kind: str, ranks: list[int], step: int | None, detail: dict, key: str,
                       rows: dict[int, dict]) -> bool:
        """Claim the incident (O_EXCL: exactly one writer), then write the JSON report and the ledger row."""
        claim = self.claims / f"{key}.json"
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        top = max((_prog(r) for r in rows.values()), default=(0, 0))
        with os.fdopen(fd, "w") as f:
            json.dump({"kind": kind, "ranks": ranks, "step": step, "observer": self.rank,
                       "progress_max": list(top), "time": time.time()}, f)
        self.known_claims.add(claim.name)
        table = [{k: row.get(k) for k in ("rank", "state", "step", "phase", "seq", "seq_left", "fp", "in_coll",
                                          "in_side", "error", "age_s", "pid", "live")} for _, row in sorted(rows.items())]
        self._write_event(kind, ranks, step, {**detail, "progress": table}, key)
        return True

    def _write_event(self, kind: str, ranks: list[int], step: int | None, detail: dict, key: str,
                     run_id: str | None = None) -> None:
        when = time.time()
        run_id = run_id or self.cfg["run_id"]
        reports = Path(self.cfg["root"]) / REPORTS_DIR
        path = reports / f"{kind}-{run_id}-{key}.json"
        detail = {**detail, "report": str(path.relative_to(self.cfg["root"])), "observer_rank": self.rank}
        atomic_write_json(path, {"kind": kind, "ranks": ranks, "step": step, "time": when, "run_id": run_id,
                                 "detail": detail})
        for attempt in range(5):
            try:
                if self._ledger is None:
                    from scout_ckpt.ledger import Ledger

                    self._ledger = Ledger.open(self.cfg["root"], create=True)
                self._ledger.add_event(kind, step=step, ranks=ranks, detail=detail, run_id=run_id, when=when)
                log.info("event %s ranks=%s step=%s written (%s)", kind, ranks, step, path.name)
                return
            except Exception as e:  # LedgerError ("database is locked" beyond the busy timeout) and the like
                log.warning("ledger write of %s failed (attempt %d): %s", kind, attempt + 1, e)
                if self._ledger is not None:
                    self._ledger.close()
                    self._ledger = None
                time.sleep(0.2 * (attempt + 1))
        log.error("event %s kept only in %s: the ledger stayed unwritable", kind, path)

    def _check_claims(self) -> None:
        """Act on incidents the judge published: with action=abort every observer kills its own trainer."""
        try:
            names = set(os.listdir(self.claims))
        except FileNotFoundError:
            return
        new = names - self.known_claims
        self.known_claims |= new
        if self.cfg["action"] != "abort" or self.aborted or self.state not in ("running", "stopped"):
            return
        for name in new:
            claim = _read_json(self.claims / name)
            if claim and claim.get("kind") in ABORT_KINDS:
                if self.state == "running" and time.monotonic() - self.last_change >= self.stall_s:
                    self._capture_stacks()
                log.info("abort: %s reported by observer %s; killing trainer %d", claim["kind"],
                         claim.get("observer"), self.pid)
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.aborted = True
                self.state = "aborted"
                return

    # ---- earlier runs ----------------------------------------------------------------------------------------

    def _settle_previous(self, now: float) -> None:
        """Rank 0 records what earlier runs on this ROOT left unfinished (observer/aftermath.py), retrying while
        their observers may still be writing, for at most `aftermath_s`."""
        from scout_ckpt.observer import aftermath

        try:
            pending = aftermath.settle(self.channel.parent, self.cfg["run_id"], self._write_event, _HOST,
                                       reported_elsewhere=self._reported_in_ledger)
        except Exception as e:  # a malformed old channel must not take the observer down
            log.warning("settling earlier runs failed: %s: %s", type(e).__name__, e)
            pending = 0
        self.next_aftermath = now + 1.0
        self.aftermath_pending = pending > 0 and now - self.t0 < self.cfg.get("aftermath_s", 120.0)

    def _reported_in_ledger(self, run_id: str, t_from: float) -> bool:
        """An incident event for that run is in the ledger already: one of its run, or one without a run id
        (a supervisor's own diagnosis) written between that run's start and this one's."""
        from scout_ckpt.ledger import Ledger

        with Ledger.open(self.cfg["root"], readonly=True) as ledger:
            events = ledger.events(kinds=INCIDENT_KINDS)
        return any(e.get("run_id") == run_id or (not e.get("run_id") and t_from <= (e.get("time") or 0) <= self.t_start)
                   for e in events)

    # ---- health --------------------------------------------------------------------------------------------

    def _poll_health(self) -> None:
        try:
            events = self.health.poll()
        except Exception as e:
            log.warning("health source failed: %s: %s", type(e).__name__, e)
            return
        for ev in events:
            key = f"health-r{self.rank}-{ev.get('metric', 'x')}-{time.time_ns()}"
            self._write_event("health", [self.rank], self.snap.step, dict(ev), key)

    # ---- main loop -----------------------------------------------------------------------------------------

    def _on_parent_death(self, *_):
        """PR_SET_PDEATHSIG: the kernel tells us the moment the trainer (our parent) exits, so the order of
        deaths across ranks is known to the millisecond, not to the poll interval."""
        if os.getppid() != self.pid:
            self._death_signal_at = time.time()

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGUSR2, self._on_parent_death)
        _set_parent_death_signal(signal.SIGUSR2)
        if os.getppid() != self.pid:  # died before the request took effect
            self._death_signal_at = time.time()
        next_exchange = 0.0
        while True:
            now = time.monotonic()
            self._observe(now)
            if now >= next_exchange:
                next_exchange = now + self.exchange_s
                self.beat += 1
                self.last_status = self._status(now)
                _write_status(self.status_path, self.last_status)
                rows = self._judge_rows(now)
                if rows is not None:
                    self._judge(now, rows)
                self._check_claims()
            if self.rank == 0 and self.aftermath_pending and now >= self.next_aftermath:
                self._settle_previous(now)
            if now >= self.next_health and self.state == "running":
                self.next_health = now + self.cfg["health_poll_s"]
                self._poll_health()
            if self._stop or self.state in ("closed", "aborted") or (
                    self.gone_since is not None and now - self.gone_since >= self.cfg["linger_s"]):
                break
            time.sleep(self.poll_s)
        self.state = "closed" if self._stop and self.state == "running" else self.state
        self.beat += 1
        _write_status(self.status_path, self._status(time.monotonic()))
        if self.state != "closed":
            try:
                os.unlink(self.cfg["heartbeat"])
            except FileNotFoundError:
                pass
        log.info("observer exits (trainer %s)", self.state)

    def _on_term(self, *_):
        self._stop = True


_HOST = os.uname().nodename


def _set_parent_death_signal(sig: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, sig) on Linux; False where it is not available (the poll still sees the death)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(sig), 0, 0, 0) == 0  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scout_ckpt.observer.daemon")
    ap.add_argument("config", help="the JSON config written by Observer.start")
    cfg = json.loads(Path(ap.parse_args(argv).config).read_text())
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format=f"%(asctime)s observer[{cfg['rank']}] %(levelname)s %(message)s")
    Daemon(cfg).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
