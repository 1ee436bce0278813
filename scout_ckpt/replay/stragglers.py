"""Stragglers from replay timings: one round per step, confirmed over several steps, with a 2x margin.

Why a rule of its own: the save-boundary sweep replays every target back to back, a few milliseconds each. Fed to
the consecutive-rounds rule one target at a time, a single scheduler hiccup on a loaded host (a healthy rank
descheduled for a few hundred milliseconds) flagged that rank in 3 "consecutive rounds" inside one sweep, and
replay named a healthy rank as a straggler (bench/campaign.py `slow`, precision 0.67). So:

- a round is a STEP: every replay that ran at one step (the rotation's target, the sweep's targets) is summed per
  rank, so one burst of noise counts once, and the sum is long enough to swamp millisecond jitter;
- a rank is slow in a round when its total exceeds median + max(k * 1.4826 * MAD, abs_floor_s, rel_floor * median)
  (consensus.timing.robust_outliers): by default at least twice the median and 20 ms more, with 3+ peers;
- it is reported only after `rounds` consecutive rounds (steps with replays) flagged it, so a transient
  slowdown must persist over several rotation/sweep steps, as a slow part does.

A 3x straggler (the campaign's fault) is 1.5x over the margin; scheduler noise that doubles one rank's replay time
at three consecutive replay steps is what it takes to name a healthy one. Pure: no torch, no communication; every
peer feeds it the same gathered durations and reports the same events.
"""

from __future__ import annotations

from scout_ckpt.consensus.timing import Confirmer, robust_outliers

REL_FLOOR = 1.0      # slow means at least 2x the median ...
ABS_FLOOR_S = 0.02   # ... and at least 20 ms more than it


class StragglerRule:
    """Feed `observe(step, durations)` for every replay batch (durations: {rank: seconds}); it returns the
    straggler events of the rounds it closed. A round closes when a later step's durations arrive (or `flush`)."""

    def __init__(self, rounds: int = 3, *, rel_floor: float = REL_FLOOR, abs_floor_s: float = ABS_FLOOR_S,
                 k: float = 3.0):
        self._confirmer = Confirmer(rounds)
        self.rel_floor, self.abs_floor_s, self.k = rel_floor, abs_floor_s, k
        self._step: int | None = None
        self._totals: dict[int, float] = {}
        self._targets: list[str] = []
        self._reported: set[int] = set()

    def observe(self, step: int, durations: dict[int, float], target: str = "") -> list[dict]:
        events = self.flush() if self._step is not None and step != self._step else []
        self._step = step
        for r, d in durations.items():
            self._totals[r] = self._totals.get(r, 0.0) + float(d)
        if target:
            self._targets.append(target)
        return events

    def flush(self) -> list[dict]:
        """Close the open round (if any) and return its new events."""
        if self._step is None:
            return []
        step, totals, targets = self._step, self._totals, self._targets
        self._step, self._totals, self._targets = None, {}, []
        flagged = robust_outliers(totals, k=self.k, abs_floor_s=self.abs_floor_s, rel_floor=self.rel_floor)
        confirmed = self._confirmer.update(flagged)
        new = {r: v for r, v in confirmed.items() if r not in self._reported}
        self._reported = set(confirmed)  # a rank that recovers and slows down again is reported again
        return [{"kind": "straggler", "ranks": [r], "step": step,
                 "detail": {"slowdown": round(float(v), 3), "source": "replay",
                            "target": targets[0] if targets else "", "targets": targets[:8],
                            "rounds": self._confirmer.rounds}}
                for r, v in sorted(new.items())]


__all__ = ["StragglerRule"]
