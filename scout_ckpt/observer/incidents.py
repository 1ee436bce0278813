"""Publishing what the observers saw: the claim protocol that makes each incident's write exactly-once, the event's
JSON report and ledger row, and the claims every observer acts on.

Why a module of its own: the judge (observer/daemon.py) decides *what* happened; this says how a decision
becomes one durable record even when two observers briefly both believe they are the judge, and how the other
observers learn of it. The protocol, in the side channel's `claims/` folder:

  claim    the publisher creates `claims/KEY.json` with O_EXCL (KEY: verdicts.incident_key, or the straggler's
           rank and step); only the observer whose create succeeded writes the event, so a report is never
           duplicated. The claim records the kind, the ranks, the step and the furthest progress any rank had
           made (`progress_max`), by which a later death is told from a consequence of this incident.
  report   ROOT/reports/KIND-RUN-KEY.json (atomic replace), then the ledger row, retried on a locked ledger; if
           the ledger stays unwritable the JSON report is what remains.
  act      every observer lists `claims/` at each exchange; a claim it has not seen of an ABORT_KINDS kind,
           with action="abort", tells it to kill its own trainer (the judge's own claim included: the hung rank
           may be the judge's).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from scout_ckpt.observer.channel import REPORTS_DIR, read_json
from scout_ckpt.observer.verdicts import ABORT_KINDS, INCIDENT_KINDS, prog

log = logging.getLogger("scout_ckpt.observer")

PROGRESS_KEYS = (
    "rank",
    "state",
    "step",
    "phase",
    "seq",
    "cseq",
    "pos",
    "seq_left",
    "fp",
    "in_coll",
    "in_side",
    "error",
    "age_s",
    "pid",
    "live",
)


class Incidents:
    """One observer's side of the protocol: `cfg` is its config (root, run_id), `rank` its rank, `claims` the
    side channel's claims folder (created here)."""

    def __init__(self, cfg: dict, rank: int, claims: Path):
        self.cfg, self.rank, self.claims = cfg, rank, claims
        self.claims.mkdir(exist_ok=True)
        self.known: set[str] = set()
        self._ledger: Any = None  # the ledger (scout_ckpt.ledger.Ledger), opened at the first event

    def claimed(self, key: str) -> bool:
        return (self.claims / f"{key}.json").exists()

    def unresolved(self, rows: dict[int, dict]) -> bool:
        """An incident was already reported and no rank got past it since: later deaths are its consequence
        (the supervisor's kill), not new faults."""
        top = max((prog(r) for r in rows.values()), default=(0, 0))
        for name in self.known:
            claim = read_json(self.claims / name)
            if claim and claim.get("kind") in INCIDENT_KINDS and tuple(claim.get("progress_max", (0, 0))) >= top:
                return True
        return False

    def publish(
        self, kind: str, ranks: list[int], step: int | None, detail: dict, key: str, rows: dict[int, dict]
    ) -> bool:
        """Claim the incident (O_EXCL: exactly one writer), then write the JSON report and the ledger row."""
        claim = self.claims / f"{key}.json"
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        top = max((prog(r) for r in rows.values()), default=(0, 0))
        with os.fdopen(fd, "w") as f:
            json.dump(
                {
                    "kind": kind,
                    "ranks": ranks,
                    "step": step,
                    "observer": self.rank,
                    "progress_max": list(top),
                    "time": time.time(),
                },
                f,
            )
        # not marked known here: `new_abort` must see the judge's own claim as new, so that with action=abort
        # the judge kills its own trainer too (the hung rank may be the judge's, the lowest live observer's)
        table = [{k: row.get(k) for k in PROGRESS_KEYS} for _, row in sorted(rows.items())]
        self.write_event(kind, ranks, step, {**detail, "progress": table}, key)
        return True

    def write_event(
        self,
        kind: str,
        ranks: list[int],
        step: int | None,
        detail: dict,
        key: str,
        run_id: str | None = None,
        when: float | None = None,
    ) -> None:
        """`when`: the time the event happened where it is known better than now (a crash settled by the next
        generation: when its first rank stopped); for display only, nothing is ordered by it."""
        when = when if when is not None else time.time()
        run_id = run_id or self.cfg["run_id"]
        reports = Path(self.cfg["root"]) / REPORTS_DIR
        path = reports / f"{kind}-{run_id}-{key}.json"
        detail = {**detail, "report": str(path.relative_to(self.cfg["root"])), "observer_rank": self.rank}
        from scout_ckpt.format.layout import atomic_write_json  # an event is rare: its imports wait for it

        atomic_write_json(
            path, {"kind": kind, "ranks": ranks, "step": step, "time": when, "run_id": run_id, "detail": detail}
        )
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

    def new_abort(self, may_abort: bool) -> dict | None:
        """Take note of the claims published since the last call; with `may_abort` (action=abort and a trainer
        still to kill), the first new one of an ABORT_KINDS kind, else None."""
        try:
            names = set(os.listdir(self.claims))
        except FileNotFoundError:
            return None
        new = names - self.known
        self.known |= new
        if not may_abort:
            return None
        for name in new:
            claim = read_json(self.claims / name)
            if claim and claim.get("kind") in ABORT_KINDS:
                return claim
        return None

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
