"""The out-of-band observer: one process per training process, watching its heartbeat from outside.

Why a separate process: a trainer blocked in a collective, SIGSTOPped or killed cannot report on itself, and a
thread inside it would share its fate (and its GIL). The observer is started with subprocess (no fork of a
threaded trainer) in a session of its own, so torchrun's SIGTERM/SIGKILL of a worker's process group does not
reach it; it never imports torch (1.4 s and 226 MB), and exits by itself `linger_s` after its trainer is gone,
once it has written what it saw.

Side channel: a directory of small JSON files under ROOT/reports/.observer/RUN_ID/, one status per rank,
replaced atomically every `exchange_s` (0.5 s). It never touches the training process groups, keeps working
while they are stuck, and needs a ROOT shared by all hosts (as DCP checkpoints usually are).

Verdicts (`attribute`, a pure function) use strict majorities over the world size:
  desync  ranks entered the same collective number with different fingerprints (the odd ones out, if one
          fingerprint holds a strict majority); checked first and without waiting for a stall, also on ranks
          that are gone (a mismatched collective may abort its rank), since in SPMD training equal numbers
          mean the same collective; or a Python-level collective at a native position where the others issued
          a native one (DDP's reducer) or another Python one; or, while a majority is stalled, ranks wait in a
          training collective further on than the waiting majority;
  crash   a trainer that is gone without a clean close and without having seen a collective fail (a victim of a
          peer's death has: a sync call raised, an async one's Work failed, or the trainer died of an uncaught
          collective error, e.g. DDP's all-reduce raising in backward), while the survivors and victims
          are a strict majority; or, when a teardown (torchrun's) took the others too, the ranks that died
          first, at least 50 ms before anyone else (death times from PR_SET_PDEATHSIG), if the rest are a
          strict majority; in a 1-rank job, its only rank; else no verdict (a job-wide kill), and the next
          generation records the run as unfinished (observer/aftermath.py, rank 0's observer);
  hang    a strict majority is stuck for stall_s at the same progress, waiting in a collective (training or
          side group) or inside a step (an async collective's wait); the ranks behind it are hung. With no
          laggard it is a hang only if the majority sits in one training collective (else: a long save or
          eval). A SIGSTOPped trainer (state T) that made no progress for stall_s is hung whatever its
          progress. Without a strict majority at one point (2 ranks, 2 against 2) the collective sequence
          decides (verdicts.sequence_hang): every rank stalled for stall_s at different points, the furthest
          waiting (in a collective, or in a native one the others never issued) and the rest outside any
          collective: the rest are hung; any other mix of stalled ranks with one waiting is an unattributed hang.
The judge is the lowest-ranked live observer; an O_EXCL claim file per incident makes the write exactly-once
even if two observers briefly disagree on who is the judge (observer/incidents.py: the claim, the report, the
abort every observer takes from it). Stacks come from each stalled rank's own observer
(SIGUSR1 -> faulthandler), captured once per stall before any verdict, so the judge rarely waits for them.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import sys
import time
from pathlib import Path

from scout_ckpt.observer import stacks as stacks_mod
from scout_ckpt.observer.channel import REPORTS_DIR, channel_dir, load_factory, read_json, write_status  # noqa: F401
from scout_ckpt.observer.heartbeat import HeartbeatReader
from scout_ckpt.observer.incidents import Incidents
from scout_ckpt.observer.verdicts import ABORT_KINDS, INCIDENT_KINDS, attribute, incident_key, prog  # noqa: F401

log = logging.getLogger("scout_ckpt.observer")


def __getattr__(name: str):
    """`Observer` (the training side's handle) is re-exported lazily: the observer process never needs it."""
    if name == "Observer":
        from scout_ckpt.observer.handle import Observer

        return Observer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- the observer process -----------------------------------------------------------------------------------


class Daemon:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.rank, self.world = cfg["rank"], cfg["world_size"]
        self.channel = Path(cfg["channel"])
        self.incidents = Incidents(cfg, self.rank, self.channel / "claims")  # the claim protocol, the reports
        self.pid = cfg["trainer_pid"]
        self.stall_s = cfg["stall_s"]
        self.poll_s, self.exchange_s = cfg["poll_s"], cfg["exchange_s"]
        self.live_timeout_s = max(4 * self.exchange_s, 2.0)
        self.crash_confirm_s = 2 * self.exchange_s + self.poll_s
        self.stacks_wait_s = max(2.0, 3 * self.exchange_s)
        self.reader = HeartbeatReader(cfg["heartbeat"])
        self.status_path = self.channel / f"status-{self.rank}.json"
        self.host = _HOST
        self.role = None  # on a job of several nodes: this observer's part in the hierarchy (observer/aggregator.py)
        if cfg.get("hier"):
            from scout_ckpt.observer.aggregator import NodeRole

            self.role = NodeRole(self, cfg["hier"])
        self.t_start = time.time()
        self.aftermath = None  # rank 0: what earlier runs on this ROOT left unfinished (observer/aftermath.py)
        if self.rank == 0:
            from scout_ckpt.observer.aftermath import Aftermath

            self.aftermath = Aftermath(self.cfg, self.channel.parent, _HOST, self.incidents.write_event, self.t_start)
        self.beat = 0
        self.version = (-1, -1)
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
        # the default source (NVML, quiet without a GPU) is built at its first poll, after the first status: its
        # probe costs start-up time; a named one is built now, so that a bad name stops the start with its error
        self.health = self._health_source() if cfg["health"] else None
        self.next_health = 0.0
        self._wake_r = -1  # the self-pipe a signal writes to, so that a SIGTERM or the trainer's death ends the sleep
        from scout_ckpt.observer.stragglers import StragglerJudge

        self.stragglers = StragglerJudge(self.world, **cfg["straggler"])  # the measure per job: stragglers.py
        self.arrivals: dict[int, float] = {}  # this rank's, kept longer than the heartbeat's ring
        self.stamps: dict[int, tuple] = {}  # this rank's step stamps: step -> (left, arrived, waited for a CPU)
        self._stop = False

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
        # progress is either heartbeat's: a Python-level event, or a native collective issued (counts.py)
        version = (self.snap.version, self.snap.cseq)
        if version != self.version:
            self.version, self.last_change = version, now
        for step, t in self.snap.arrivals:
            self.arrivals[step] = t
        for step, *stamp in self.snap.stamps:
            self.stamps[step] = tuple(stamp)
        for kept in (self.arrivals, self.stamps):
            if len(kept) > 64:
                for step in sorted(kept)[: len(kept) - 64]:
                    del kept[step]
        self.state = self._trainer_state()
        if self.state in ("gone", "closed", "aborted") and self.gone_since is None:
            self.gone_since = now
            if self.state == "gone":
                self.gone_at = self._death_signal_at or time.time()
            log.info("trainer %d is %s", self.pid, self.state)
        if self.state in ("running", "stopped") and now - self.last_change >= self.stall_s:
            self._capture_stacks()

    def _capture_stacks(self) -> None:
        if self.stacks is not None and self.stacks["hb"] == list(self.version):
            return
        got = stacks_mod.capture(self.pid, self.channel / f"stacks-{self.rank}.log", self.cfg["signal"])
        self.stacks = {"hb": list(self.version), **({"span": list(got)} if isinstance(got, tuple) else {"reason": got})}
        log.info("stacks of trainer %d: %s", self.pid, self.stacks)

    def _status(self, now: float) -> dict:
        s = self.snap
        return {
            "rank": self.rank,
            "observer_pid": os.getpid(),
            "pid": self.pid,
            "beat": self.beat,
            "state": self.state,
            "step": s.step,
            "phase": s.phase,
            "seq": s.seq_enter,
            "fp": f"{s.fp_enter:016x}",
            "seq_left": s.seq_leave,
            "in_coll": s.in_coll,
            "in_side": s.in_side,
            "error": s.coll_error,
            "hb": list(self.version),
            "cseq": max(s.cseq, s.pos_enter),
            "pos": s.pos_enter,
            "off_watch": s.off_watch,
            "counted": s.counted,
            "t_cseq": s.t_cseq,
            "arrivals": sorted(self.arrivals.items())[-32:],
            "stamps": [[k, *v] for k, v in sorted(self.stamps.items())[-32:]],
            "age_s": round(now - self.last_change, 3),
            "t_update": s.t_update,
            "n_steps": s.n_steps,
            "busy_sum": s.busy_sum,
            "dur_sum": s.dur_sum,
            "last_dur": s.last_dur,
            "stacks": self.stacks,
            "wall": time.time(),
            "torch_imported": "torch" in sys.modules,
            "gone_at": self.gone_at,
            "host": _HOST,
            "t_start": self.t_start,
        }

    # ---- peers ---------------------------------------------------------------------------------------------

    def read_row(self, r: int, now: float, path: Path | None = None) -> dict | None:
        """Rank r's status (from `path`, by default ROOT's channel), `live` and `age_s` brought up to date."""
        row = dict(self.last_status) if r == self.rank else read_json(path or self.channel / f"status-{r}.json")
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
            row = self.read_row(r, now)
            if row is None:
                continue
            if r < self.rank and row["live"] and row["state"] not in ("aborted", "closed"):
                return None
            rows[r] = row
        return rows

    # ---- verdicts ------------------------------------------------------------------------------------------

    def _judge(self, now: float, rows: dict[int, dict]) -> None:
        for ev in self.stragglers.update(now, rows):  # while every rank runs (observer/stragglers.py)
            key = f"straggler-r{ev['ranks'][0]}-s{ev['step']}"
            self.incidents.publish("straggler", ev["ranks"], ev["step"], ev["detail"], key, rows)
        # a row whose observer stopped beating is unknown, unless its last word was final
        known = {r: row for r, row in rows.items() if row["live"] or row["state"] in ("gone", "closed", "aborted")}
        verdict = attribute(known, self.world, self.stall_s)
        if verdict is None:
            self.pending.clear()
            return
        due = self.due(verdict, rows, now)
        if due is None:
            return
        key, first = due
        named = verdict["ranks"] or sorted(rows)
        fresh = {
            r: rows[r].get("stacks")
            for r in named
            if rows[r].get("stacks") and rows[r]["stacks"]["hb"] == rows[r]["hb"]
        }
        # a stopped rank's observer records why it has no dump (at once, no signal): waited for as a dump is
        needs = [r for r in named if rows[r]["state"] in ("running", "stopped") and r not in fresh]
        if needs and verdict["kind"] != "crash" and now - first < self.stacks_wait_s:
            return
        stacks = stacks_mod.collect(
            named,
            fresh,
            lambda r: rows[r]["state"] == "gone",
            "process is gone",
            self.channel,
            stopped=lambda r: rows[r]["state"] == "stopped",
        )
        detail = stacks_mod.incident_detail(verdict, stacks, self.stall_s, self.cfg["action"])
        self.incidents.publish(verdict["kind"], verdict["ranks"], verdict["step"], detail, key, rows)
        self.pending.clear()

    def due(self, verdict: dict, rows: dict, now: float) -> tuple | None:
        """(incident key, first seen) of a verdict to act on now; None while another judge claimed it, a row is
        unresolved, or a crash is not yet confirmed (the flat judge and the hierarchy's root alike)."""
        key = incident_key(verdict)
        if self.incidents.claimed(key) or self.incidents.unresolved(rows):
            return None
        first, _ = self.pending.get(key, (now, verdict))
        self.pending = {key: (first, verdict)}
        if verdict["kind"] == "crash" and now - first < self.crash_confirm_s:
            return None
        return key, first

    def _check_claims(self) -> None:
        """Act on incidents the judge published (observer/incidents.py): with action=abort every observer kills
        its own trainer."""
        claim = self.incidents.new_abort(
            self.cfg["action"] == "abort" and not self.aborted and self.state in ("running", "stopped")
        )
        if claim is None:
            return
        if self.state == "running" and time.monotonic() - self.last_change >= self.stall_s:
            self._capture_stacks()
        log.info(
            "abort: %s reported by observer %s; killing trainer %d", claim["kind"], claim.get("observer"), self.pid
        )
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.aborted = True
        self.state = "aborted"

    # ---- health --------------------------------------------------------------------------------------------

    def _poll_health(self) -> None:
        try:
            if self.health is None:
                self.health = self._health_source()
            events = self.health.poll()
        except Exception as e:
            log.warning("health source failed: %s: %s", type(e).__name__, e)
            return
        for ev in events:
            key = f"health-r{self.rank}-{ev.get('metric', 'x')}-{time.time_ns()}"
            self.incidents.write_event("health", [self.rank], self.snap.step, dict(ev), key)

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
        self._wake_r = _wakeup_pipe()
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
                if self.role is not None:
                    self.role.exchange(now)
                else:
                    write_status(self.status_path, self.last_status)
                    rows = self._judge_rows(now)
                    if rows is not None:
                        self._judge(now, rows)
                    self._check_claims()
            if self.aftermath is not None:
                self.aftermath.poll(now)
            if now >= self.next_health and self.state == "running":
                self.next_health = now + self.cfg["health_poll_s"]
                self._poll_health()
            if (
                self._stop
                or self.state in ("closed", "aborted")
                or (self.gone_since is not None and now - self.gone_since >= self.cfg["linger_s"])
            ) and not (self.role is not None and self.role.stays(now)):
                break
            self._sleep(self.poll_s)
        self.state = "closed" if self._stop and self.state == "running" else self.state
        self.beat += 1
        self.last_status = self._status(time.monotonic())
        if self.role is not None:
            self.role.exchange(time.monotonic(), final=True)
        else:
            write_status(self.status_path, self.last_status)
        if self.aftermath is not None:
            self.aftermath.before_exit(self.poll_s)
        if self.state != "closed":
            try:
                os.unlink(self.cfg["heartbeat"])
            except FileNotFoundError:
                pass
        self.incidents.close()
        log.info("observer exits (trainer %s)", self.state)

    def _sleep(self, seconds: float) -> None:
        """time.sleep that a signal cuts short: Python resumes an interrupted sleep (PEP 475), so a SIGTERM from
        Observer.stop would otherwise wait out the poll interval, at every Checkpointer.close."""
        if self._wake_r < 0:
            time.sleep(seconds)
            return
        ready, _, _ = select.select([self._wake_r], [], [], seconds)
        if ready:
            try:
                os.read(self._wake_r, 512)
            except BlockingIOError:
                pass

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


def _wakeup_pipe() -> int:
    """A non-blocking pipe registered with signal.set_wakeup_fd; its read end (-1 where that fails)."""
    try:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        return r
    except (OSError, ValueError):
        return -1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):  # argparse costs start-up time at every Checkpointer
        print(
            "usage: python -m scout_ckpt.observer.daemon CONFIG  (the JSON config written by Observer.start)",
            file=sys.stderr,
        )
        return 2
    cfg = json.loads(Path(args[0]).read_text())
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format=f"%(asctime)s observer[{cfg['rank']}] %(levelname)s %(message)s"
    )
    Daemon(cfg).run()
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # What the observer writes is on disk by now (atomic replaces, committed ledger rows): skip the interpreter's
    # teardown, a tenth of a second on a loaded host that Observer.stop would wait for at every close.
    os._exit(code)
