"""What a previous generation left unfinished, recorded by the next one.

Why: under torchrun a failed generation is torn down as a whole within a second; its observers (in their own
sessions, so torchrun's kill of the workers does not take them down) usually attribute the crash before they
exit, but not always: a whole-node kill takes the observers too, a job-wide teardown can leave no strict
majority, and an observer may die with its host. Each generation's rank-0 observer therefore looks at the side
channels of earlier runs on the same ROOT once their observers are gone, and settles each exactly once (an
O_EXCL `settled.json` in that channel):
  clean       every rank closed its heartbeat (Checkpointer.close, or a normal interpreter exit);
  reported    an incident (hang, desync, crash) was already written by its observers, or by someone else (a
              supervisor's own crash event for that run, or one without a run id written while it ran);
  unfinished  anything else: one `crash` event for that run, attributed by the same rule the live observers
              use where the final statuses allow it (a strict majority of victims, or one rank clearly dead
              first), otherwise unattributed; its detail lists every rank's last step, phase, collective and
              when it stopped heartbeating, first-stopped first.
Read only from JSON files; never imports torch.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from scout_ckpt.observer import stacks as stacks_mod
from scout_ckpt.observer.channel import final_settle_s

log = logging.getLogger("scout_ckpt.observer")

INCIDENT_KINDS = ("hang", "desync", "crash")
SETTLED = "settled.json"


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def _observer_alive(row: dict, host: str, quiet_s: float, seen: dict, key) -> bool:
    """Could this row's observer still write? Same host: its process exists and is an observer. Another host: its
    heartbeat (`beat`, bumped at every status it writes) changed within the last `quiet_s` of this host's
    monotonic clock, counted from when this process first saw that beat (`seen`, kept by the caller between
    calls): never the row's own wall time, which is another host's clock (an hour behind made a live observer
    look dead, an hour ahead a dead one live). A row first seen now may still be writing."""
    if row.get("host") not in (None, host):
        now, beat = time.monotonic(), row.get("beat")
        first = seen.get(key)
        if first is None or first[0] != beat:
            seen[key] = (beat, now)
            return True
        return now - first[1] < quiet_s
    pid = row.get("observer_pid")
    if not isinstance(pid, int) or stacks_mod.proc_state(pid) in (None, "Z", "X"):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"scout_ckpt.observer.daemon" in f.read()
    except OSError:
        return False


def examine(
    channel: Path, host: str, quiet_s: float = 10.0, reported_elsewhere=None, seen: dict | None = None
) -> dict | None:
    """The outcome of one earlier run's channel, or None while its observers may still be writing.
    `reported_elsewhere(run_id, t_from)`: whether the ledger already holds an incident for that run. `seen`: the
    other hosts' heartbeats as first seen (`_observer_alive`), kept between calls by the caller; without it a
    row of another host is never judged quiet."""
    seen = {} if seen is None else seen
    cfgs = [c for c in (_read(p) for p in sorted(channel.glob("observer-*.json"))) if c]
    if not cfgs:
        return {"outcome": "empty"}
    world = int(cfgs[0]["world_size"])
    rows = {r: row for r in range(world) if (row := _read(channel / f"status-{r}.json"))}
    if any(_observer_alive(row, host, quiet_s, seen, (channel.name, r)) for r, row in rows.items()):
        return None
    claims = [c for c in (_read(p) for p in sorted((channel / "claims").glob("*.json"))) if c]
    reported = [c for c in claims if c.get("kind") in INCIDENT_KINDS]
    if reported:
        return {"outcome": "reported", "kinds": sorted({c["kind"] for c in reported})}
    run_id = cfgs[0].get("run_id") or channel.name
    t_from = min((row.get("t_start") or row.get("wall") or 0.0 for row in rows.values()), default=0.0)
    if reported_elsewhere is not None and reported_elsewhere(run_id, t_from):
        return {"outcome": "reported", "kinds": ["elsewhere"]}
    if len(rows) == world and all(row.get("state") in ("closed",) for row in rows.values()):
        return {"outcome": "clean"}
    return {"outcome": "unfinished", "world_size": world, "rows": rows, "run_id": cfgs[0].get("run_id")}


def verdict(found: dict) -> dict:
    """The crash event for an unfinished run: {"kind", "ranks", "step", "detail"}."""
    from scout_ckpt.observer.verdicts import attribute, fingerprint_mismatch

    world, rows = found["world_size"], found["rows"]
    # Only final words are evidence of how a rank ended. A row whose observer died before its final word (or
    # a rank with no row) could be anything: then only a fingerprint mismatch, which needs no outcome, counts.
    complete = len(rows) == world and all(row.get("state") in ("gone", "closed", "aborted") for row in rows.values())
    v = attribute(rows, world, stall_s=float("inf")) if complete else fingerprint_mismatch(rows, world // 2 + 1)

    def stopped_at(r: int) -> float:
        row = rows[r]
        return row.get("gone_at") or row.get("t_update") or row.get("wall") or 0.0

    order = sorted(rows, key=stopped_at)
    table = [
        {
            "rank": r,
            "state": rows[r].get("state"),
            "step": rows[r].get("step"),
            "phase": rows[r].get("phase"),
            "seq": rows[r].get("seq"),
            "fp": rows[r].get("fp"),
            "error": rows[r].get("error"),
            "last_heartbeat": rows[r].get("t_update"),
            "gone_at": rows[r].get("gone_at"),
            "pid": rows[r].get("pid"),
        }
        for r in order
    ]
    missing = sorted(set(range(world)) - set(rows))
    if v is not None:
        kind, ranks, attribution, reason = v["kind"], v["ranks"], v["attribution"], v["reason"]
        step = v["step"]
    else:
        kind, ranks, attribution = "crash", [], "unattributed"
        first = order[0] if order else None
        step = rows[first].get("step") if first is not None else None
        reason = (
            "the run ended without a clean close and without a reported incident; no strict majority "
            f"points at a rank (first to stop heartbeating: rank {first})"
            if first is not None
            else "the run ended without any observer status"
        )
    detail = {
        "source": "previous_generation",
        "previous_run_id": found.get("run_id"),
        "attribution": attribution,
        "reason": reason,
        "first_stopped": order[:1],
        "progress": table,
    }
    if missing:
        detail["missing_ranks"] = missing
    first = order[0] if order else None
    when = (rows[first].get("gone_at") or rows[first].get("t_update")) if first is not None else None
    return {"kind": kind, "ranks": ranks, "step": step, "detail": detail, "when": when}


def settle(
    observer_dir: Path,
    current_run_id: str,
    write_event,
    host: str,
    quiet_s: float = 10.0,
    reported_elsewhere=None,
    seen: dict | None = None,
) -> int:
    """Settles every earlier run's channel under `observer_dir` that can be settled now; `write_event(kind,
    ranks, step, detail, key, run_id, when=)` records an unfinished one (`when`: when its first rank stopped).
    `seen` as for `examine` (the caller's, kept between calls). Returns how many remain pending."""
    pending = 0
    try:
        channels = sorted(p for p in observer_dir.iterdir() if p.is_dir() and p.name != current_run_id)
    except FileNotFoundError:
        return 0
    for ch in channels:
        if (ch / SETTLED).exists():
            continue
        found = examine(ch, host, quiet_s, reported_elsewhere, seen)
        if found is None:
            pending += 1
            continue
        try:
            fd = os.open(ch / SETTLED, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue
        ev = verdict(found) if found["outcome"] == "unfinished" else None
        with os.fdopen(fd, "w") as f:
            json.dump(
                {
                    "outcome": found["outcome"],
                    "by_run": current_run_id,
                    "time": time.time(),
                    **({"kinds": found["kinds"]} if "kinds" in found else {}),
                    **({"event": {k: ev[k] for k in ("kind", "ranks", "step")}} if ev else {}),
                },
                f,
            )
        if ev is not None:
            key = f"{ev['kind']}-previous-{ch.name}"
            write_event(
                ev["kind"],
                ev["ranks"],
                ev["step"],
                ev["detail"],
                key,
                found.get("run_id") or ch.name,
                when=ev.get("when"),
            )
    return pending


class Aftermath:
    """Rank 0's observer settling earlier runs on this ROOT (`settle`): at start-up, again every second while
    their observers may still be writing (for at most `aftermath_s`), and once more before it exits."""

    def __init__(self, cfg: dict, observer_dir: Path, host: str, write_event, t_start: float):
        self.cfg, self.observer_dir, self.host, self.write_event = cfg, observer_dir, host, write_event
        self.t_start = t_start  # this run's start: an event without a run id after it is not the earlier run's
        self.t0 = time.monotonic()
        self.pending, self.next_at = True, 0.0
        self.seen: dict = {}  # other hosts' heartbeats as first seen here (aftermath._observer_alive)

    def poll(self, now: float) -> None:
        """Settle what can be settled now, if a retry is due."""
        if self.pending and now >= self.next_at:
            self.settle(now)

    def settle(self, now: float) -> None:
        try:
            left = settle(
                self.observer_dir,
                self.cfg["run_id"],
                self.write_event,
                self.host,
                reported_elsewhere=self.reported_in_ledger,
                seen=self.seen,
            )
        except Exception as e:  # a malformed old channel must not take the observer down
            log.warning("settling earlier runs failed: %s: %s", type(e).__name__, e)
            left = 0
        self.next_at = now + 1.0
        self.pending = left > 0 and now - self.t0 < self.cfg.get("aftermath_s", 120.0)

    def before_exit(self, poll_s: float) -> None:
        """A run shorter than its predecessor's observers' linger ends while they may still be writing: wait for
        them (at most `final_settle_s(cfg)`, which Observer.stop waits for) rather than leave the predecessor's
        crash unrecorded until some later generation."""
        deadline = time.monotonic() + final_settle_s(self.cfg)
        while self.pending and time.monotonic() < deadline:
            time.sleep(poll_s)
            self.settle(time.monotonic())
        if self.pending:
            log.warning("earlier runs on this ROOT still had live observers at exit; the next generation settles them")

    def reported_in_ledger(self, run_id: str, t_from: float) -> bool:
        """An incident event for that run is in the ledger already: one of its run, or one without a run id
        (a supervisor's own diagnosis) written between that run's start and this one's."""
        from scout_ckpt.ledger import Ledger

        with Ledger.open(self.cfg["root"], readonly=True) as ledger:
            events = ledger.events(kinds=INCIDENT_KINDS)
        return any(
            e.get("run_id") == run_id or (not e.get("run_id") and t_from <= (e.get("time") or 0) <= self.t_start)
            for e in events
        )
