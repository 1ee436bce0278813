"""Stragglers: a rank whose busy time per step stays well above the others', confirmed over rounds.

Why busy time and not step time: in synchronous training every rank's wall time per step is the same, since the
fast ranks wait for the slow one inside the collectives. The heartbeat accumulates each step's duration minus the
time spent in traced collectives; over a window of a few steps the monitor compares the per-rank means with
consensus.timing's robust rule (median + max(k * 1.4826 * MAD, floors)) and reports a rank once it was flagged in
`rounds` consecutive windows. A rank is reported once per episode: it is re-armed after a window without a flag.
"""

from __future__ import annotations

from statistics import median

from scout_ckpt.consensus.timing import Confirmer, robust_outliers


class StragglerMonitor:
    def __init__(self, *, window_s: float = 1.0, min_steps: int = 3, rounds: int = 3, k: float = 3.0,
                 abs_floor_s: float = 0.05, rel_floor: float = 0.5):
        self.window_s, self.min_steps = window_s, min_steps
        self.rule = {"k": k, "abs_floor_s": abs_floor_s, "rel_floor": rel_floor}
        self.confirmer = Confirmer(rounds)
        self._start: dict[int, tuple[int, float]] | None = None
        self._t0 = 0.0
        self._reported: set[int] = set()

    def update(self, now: float, totals: dict[int, tuple[int, float, int]]) -> list[dict]:
        """totals: {rank: (steps done so far, busy seconds so far, current step)} of the running ranks.
        Returns straggler events ({"ranks", "step", "detail"}) confirmed at this window's end."""
        if self._start is None or set(totals) != set(self._start):
            self._start, self._t0 = {r: (n, b) for r, (n, b, _s) in totals.items()}, now
            self.confirmer.reset()
            return []
        deltas = {r: (totals[r][0] - n0, totals[r][1] - b0) for r, (n0, b0) in self._start.items()}
        if now - self._t0 < self.window_s or min(dn for dn, _ in deltas.values()) < self.min_steps:
            return []
        samples = {r: db / dn for r, (dn, db) in deltas.items()}
        self._start, self._t0 = {r: (n, b) for r, (n, b, _s) in totals.items()}, now
        flagged = robust_outliers(samples, **self.rule)
        confirmed = self.confirmer.update(flagged)
        self._reported &= set(flagged)
        events = []
        med = median(samples.values())
        for r, slowdown in confirmed.items():
            if r in self._reported:
                continue
            self._reported.add(r)
            events.append({"ranks": [r], "step": totals[r][2], "detail": {
                "slowdown": round(slowdown, 3), "rounds": self.confirmer.rounds, "window_steps": deltas[r][0],
                "busy_s_per_step": {str(q): round(v, 6) for q, v in sorted(samples.items())},
                "median_busy_s": round(med, 6), "rule": self.rule}})
        return events
