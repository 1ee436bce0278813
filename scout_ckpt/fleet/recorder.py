"""A job's fleet recorder: copies the ROOT's attributed events into the fleet store from a background thread.

The coordinator starts one when the fleet record is configured. Every `interval_s` (and when nudged after a save,
and once more at close) it reads the ledger's events newer than the store's cursor for this ROOT and appends
them (fleet/records.py, fleet/store.py): the events the observers' processes write reach it the same way as the
save's own. Nothing here runs on the training thread, and nothing here can fail a save: a store that is lost,
locked or unwritable is logged (WARNING, once per distinct cause) and retried at the next round; the events wait
in the ledger meanwhile, so none is lost while the ROOT lives. Events recorded after the job ended (a crash the
next generation settles) are copied by the next generation's recorder or by `scout-ckpt fleet import`.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from scout_ckpt.fleet import records
from scout_ckpt.fleet.store import JOB_BUSY_TIMEOUT_S, FleetStore

log = logging.getLogger("scout_ckpt")


def sync_root(store: FleetStore, root: str | Path) -> int:
    """Copy ROOT's events not yet in `store` (idempotent: a record already there is kept once). Returns how many
    records were new. Raises what opening the ledger or writing the store raises."""
    key = records.root_key(root)
    found, last = records.read_root(root, after=store.cursor(key))
    if not found and last == store.cursor(key):
        return 0
    return store.append(key, found, last)


class FleetRecorder:
    def __init__(self, path: Path, root: Path, interval_s: float = 2.0):
        self.path, self.root, self.interval_s = Path(path), Path(root), interval_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_error: str | None = None
        self.recorded = 0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="scout-fleet-recorder", daemon=True)
        self._thread.start()

    def nudge(self) -> None:
        """A verdict was just recorded: copy it at once rather than at the next interval (non-blocking)."""
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self.round()
            if self._stop.is_set():  # close() asked: the round above was the last
                return

    def round(self) -> bool:
        """One copy; True when it succeeded. Every error is caught: the fleet record never fails the job."""
        try:
            with FleetStore.open(self.path, busy_timeout=JOB_BUSY_TIMEOUT_S) as store:
                self.recorded += sync_root(store, self.root)
        except Exception as e:  # noqa: BLE001 - lost, locked, unwritable: logged, retried at the next round
            self.failures += 1
            text = f"{type(e).__name__}: {e}"
            if text != self._last_error:
                log.warning("fleet: could not record this run's verdicts in %s (%s); retrying", self.path, text)
                self._last_error = text
            return False
        if self._last_error is not None:
            log.info("fleet: recording in %s again", self.path)
            self._last_error = None
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop after one last round, in the recorder's thread; waits at most `timeout_s` for it (a store that
        hangs does not hold up close; the events stay in the ledger for the next recorder or `fleet import`)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
