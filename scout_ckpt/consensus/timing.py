"""The statistical rule for timings (stragglers): robust outliers, confirmed over consecutive rounds.

Timings are never bit-exact, so they do not go through C3's equality vote. A sample is slow when it exceeds

    median + max(k * 1.4826 * MAD, abs_floor_s, rel_floor * median)

where MAD is the median absolute deviation (1.4826 * MAD estimates the standard deviation of normal noise). The
floors keep scheduler jitter from flagging anyone when all ranks are nearly equal (MAD close to 0). A rank is
reported only after it was flagged in `rounds` consecutive rounds. Pure: no torch, no I/O.
"""

from __future__ import annotations

from statistics import median

MAD_SCALE = 1.4826
MIN_SAMPLES = 3  # as with C3: with two samples neither is the odd one out


def threshold(samples: dict[int, float], *, k: float = 3.0, abs_floor_s: float = 0.01, rel_floor: float = 0.5) -> float:
    """The time above which a sample counts as slow."""
    values = list(samples.values())
    med = median(values)
    mad = median(abs(v - med) for v in values)
    return med + max(k * MAD_SCALE * mad, abs_floor_s, rel_floor * med)


def robust_outliers(
    samples: dict[int, float], *, k: float = 3.0, abs_floor_s: float = 0.01, rel_floor: float = 0.5
) -> dict[int, float]:
    """{rank: slowdown ratio (sample / median)} of the slow samples; {} with fewer than MIN_SAMPLES samples.

    Defaults: k = 3 robust standard deviations, at least 10 ms and at least 50% above the median. The ratio is
    inf when the median is 0."""
    if len(samples) < MIN_SAMPLES:
        return {}
    limit = threshold(samples, k=k, abs_floor_s=abs_floor_s, rel_floor=rel_floor)
    med = median(samples.values())
    return {r: (v / med if med > 0 else float("inf")) for r, v in sorted(samples.items()) if v > limit}


class Confirmer:
    """Reports a rank only after it was flagged in `rounds` consecutive rounds; a round without the flag resets
    its count."""

    def __init__(self, rounds: int = 3):
        if rounds < 1:
            raise ValueError("rounds must be at least 1")
        self.rounds = rounds
        self.streak: dict[int, int] = {}

    def update(self, flagged: dict[int, float]) -> dict[int, float]:
        """Feed one round's flags ({rank: ratio}); return {rank: this round's ratio} of every rank flagged in at
        least `rounds` consecutive rounds up to and including this one."""
        self.streak = {r: self.streak.get(r, 0) + 1 for r in flagged}
        return {r: flagged[r] for r in sorted(flagged) if self.streak[r] >= self.rounds}

    def reset(self) -> None:
        self.streak.clear()
