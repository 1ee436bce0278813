"""Stragglers from replay timings: one round per step, confirmed over several steps, with a 2x margin.

Why a rule of its own: the save-boundary sweep replays every target back to back, a few milliseconds each. Fed to
the consecutive-rounds rule one target at a time, a single scheduler hiccup on a loaded host (a healthy rank
descheduled for a few hundred milliseconds) flagged that rank in 3 "consecutive rounds" inside one sweep, and
replay named a healthy rank as a straggler (bench/campaign.py `slow`, precision 0.67). So:

- a round is a STEP: every replay that ran at one step (the rotation's target, the sweep's targets) is summed per
  rank, so one burst of noise counts once, and the sum is long enough to swamp millisecond jitter;
- a rank is slow in a round when its total exceeds median + max(k * 1.4826 * MAD, abs_floor_s, rel_floor * median)
  (consensus.timing.robust_outliers): by default at least twice the median and 20 ms more, with 3+ peers;
- it is reported only when `rounds` consecutive rounds (steps with replays) flagged it, so a transient
  slowdown must persist over several rotation/sweep steps, as a slow part does (the current step counts with
  the replays it had so far; the earlier ones with all of theirs).

A 3x straggler (the campaign's fault) is 1.5x over the margin; scheduler noise that doubles one rank's replay time
at three consecutive replay steps is what it takes to name a healthy one. Pure: no torch, no communication; every
peer feeds it the same gathered durations and reports the same events.
"""

from __future__ import annotations

from scout_ckpt.consensus.timing import robust_outliers

REL_FLOOR = 1.0  # slow means at least 2x the median ...
ABS_FLOOR_S = 0.02  # ... and at least 20 ms more than it


class StragglerRule:
    """Feed `observe(step, durations)` for every replay batch (durations: {rank: seconds}); it returns the new
    straggler events. A rank is reported as soon as the step being fed (its replays so far) flags it and the
    `rounds - 1` steps with replays before it flagged it too; once per episode (again after a step without)."""

    def __init__(
        self, rounds: int = 3, *, rel_floor: float = REL_FLOOR, abs_floor_s: float = ABS_FLOOR_S, k: float = 3.0
    ):
        if rounds < 1:
            raise ValueError("rounds must be at least 1")
        self.rounds = rounds
        self.rel_floor, self.abs_floor_s, self.k = rel_floor, abs_floor_s, k
        self._step: int | None = None
        self._totals: dict[int, float] = {}
        self._targets: list[str] = []
        self._streak: dict[int, int] = {}  # consecutive flagged steps before the open one
        self._reported: set[int] = set()

    def _flagged(self, totals: dict[int, float]) -> dict[int, float]:
        return robust_outliers(totals, k=self.k, abs_floor_s=self.abs_floor_s, rel_floor=self.rel_floor)

    def observe(self, step: int, durations: dict[int, float], target: str = "") -> list[dict]:
        if self._step is not None and step != self._step:
            self._close()
        self._step = step
        for r, d in durations.items():
            self._totals[r] = self._totals.get(r, 0.0) + float(d)
        if target:
            self._targets.append(target)
        events = []
        for r, ratio in self._flagged(self._totals).items():
            if self._streak.get(r, 0) + 1 >= self.rounds and r not in self._reported:
                self._reported.add(r)
                events.append(
                    {
                        "kind": "straggler",
                        "ranks": [r],
                        "step": step,
                        "detail": {
                            "slowdown": round(float(ratio), 3),
                            "source": "replay",
                            "target": self._targets[0] if self._targets else "",
                            "targets": self._targets[:8],
                            "rounds": self.rounds,
                        },
                    }
                )
        return events

    def _close(self) -> None:
        """The open step is complete: its totals decide the streaks (a step that does not flag a rank resets it,
        and ends its episode)."""
        flagged = self._flagged(self._totals)
        self._streak = {r: self._streak.get(r, 0) + 1 for r in flagged}
        self._reported &= set(flagged)
        self._step, self._totals, self._targets = None, {}, []


__all__ = ["StragglerRule"]
