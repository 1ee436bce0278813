"""Which part of the model is replayed at which step, and the coverage a certified step needs.

Replay checks one target per scheduled step, in a fixed rotation (embedding, every block in order, head,
optimizer), so its cost stays bounded per step while the whole model is covered every `len(targets) *
interval` steps; at each save the runner's sweep replays every target once more (see `coverage`). The rotation is a function of the step number alone: every rank, and a restarted job, agrees
on it without communicating.
"""

from __future__ import annotations

from collections.abc import Iterable

from scout_ckpt.policy import (
    FAIL,
    INCONCLUSIVE,
    MISSING,
    NOT_APPLICABLE,
    PASS,
    evidence,
)
from scout_ckpt.replay.live import coverage_detail, reason_flag

RECIPES = ("embedding", "block", "head", "optimizer")
OPTIMIZER_TARGET = "optimizer"

Target = tuple[str, str]  # (recipe, target name), e.g. ("block", "blocks.2")


def discover_targets(model, optimizer=None) -> list[Target]:
    """The coverage set of a model: its embedding(s), every repeated block, its head, the optimizer.
    See replay.targets.discover (imported here lazily: `coverage` serves read-only paths that must not load torch)."""
    from scout_ckpt.replay.targets import discover

    return discover(model, optimizer)


class Schedule:
    """Step S (S % interval == 0) replays targets[(S // interval - 1) % len(targets)]."""

    def __init__(self, targets: list[Target], interval: int = 1):
        if interval < 1:
            raise ValueError(f"replay interval must be >= 1, got {interval}")
        if not targets:
            raise ValueError("replay schedule needs at least one target")
        self.targets = list(targets)
        self.interval = interval

    def slot(self, step: int) -> int | None:
        """The step's position in the rotation, or None when the step is not scheduled."""
        if step < 1 or step % self.interval:
            return None
        return step // self.interval - 1

    def target_for(self, step: int) -> Target | None:
        slot = self.slot(step)
        return None if slot is None else self.targets[slot % len(self.targets)]

    def source_index(self, step: int, n_peers: int) -> int:
        """Which peer's capture is replayed: rotates by step, and shifts every full round so that each target
        gets every peer as its source over time even when len(targets) is a multiple of n_peers."""
        slot = self.slot(step) or 0
        return (slot + slot // len(self.targets)) % n_peers


def rotation_interval(configured: int | None, period: int | None, auto: int = 10) -> int:
    """Steps between two rotation replays: the configured interval as given; None (automatic): `auto` until the
    save period is known, then max(auto, period // 2) (the sweep at each save certifies; between saves the
    rotation is an early warning, about one round per interval, and its rounds on save steps join the sweep)."""
    if configured is not None:
        return configured
    return max(auto, period // 2) if period else auto


class SaveForecast:
    """Which steps will be saved, known before their forward (the sweep's capture must be armed then): said
    (`expect`), configured (`save_every`), the period of the last two saves continued, or -- while none of these is
    known (no save_every, nothing said yet, fewer than two saves) -- maybe: every step, so that even the first saves
    get a sweep. A function of the calls alone, so every rank that makes the same calls gets the same answers."""

    def __init__(self, save_every: int | None = None):
        if save_every is not None and save_every < 1:
            raise ValueError(f"replay save_every must be >= 1, got {save_every}")
        self.save_every = save_every
        self.expected: set[int] = set()
        self.announced = False  # expect was used: no capture on mere suspicion
        self.saves: list[int] = []  # steps saved so far (their period predicts the next)

    def expect(self, step: int) -> None:
        self.expected.add(step)
        self.announced = True

    def saved(self, step: int) -> None:
        self.expected.discard(step)
        if not self.saves or self.saves[-1] < step:
            self.saves.append(step)

    def period(self) -> int | None:
        """The save period when it is known (configured, or the last two saves'), else None."""
        if self.save_every:
            return self.save_every
        if len(self.saves) >= 2 and self.saves[-1] > self.saves[-2]:
            return self.saves[-1] - self.saves[-2]
        return None

    def due(self, step: int, known: bool = False) -> bool:
        """Will `step` be saved? `known`: not on a maybe."""
        if step in self.expected or (self.save_every and step % self.save_every == 0):
            return True
        if len(self.saves) >= 2:
            period = self.saves[-1] - self.saves[-2]
            return period > 0 and step > self.saves[-1] and (step - self.saves[-1]) % period == 0
        return not known and self.save_every is None and not self.expected and not self.announced


def _name(t) -> str:
    return t[1] if isinstance(t, (tuple, list)) else str(t)


def _comparison(row: dict) -> dict:
    """{"comparison": ...} of a row that recorded one (replay/determinism.py), else {}."""
    c = (row.get("detail") or {}).get("comparison")
    return {"comparison": c} if c else {}


def coverage(replay_rows: Iterable[dict], targets: Iterable, step: int | None = None) -> dict:
    """Replay evidence for the state saved at `step`, from the replays since the previous certified step.

    Without `step` (a plain window): pass when every target has an AGREE row and no row disagrees.
    With `step`, the rows may run past it, and the state is certified only when, for every target, there is a
    clean replay in the window up to `step` AND a clean replay at or after `step`. The save-boundary sweep gives
    both at once: a clean replay AT `step` (of the save step's own computation) completes the evidence with no
    waiting. Without a sweep, failing hardware fails persistently: a fault that entered the state at or before
    `step` shows up in the target's next replay, so until that replay has run cleanly the state is `missing`
    (reason replay_pending), never certified. A disagreeing replay counts against `step` unless the same target
    already replayed cleanly at or after `step` and at an earlier step than the fault (then the fault began after
    the state was saved); so a rotation that finds a fault counts against every checkpoint since that target's
    last clean replay.

    fail: some replay attributed ranks (replay_sdc); inconclusive: no strict majority (replay_inconclusive);
    missing: replay_coverage_incomplete (no clean replay up to `step`) or replay_pending (none after it yet). A
    reason from a row whose source's live step disagreed with the replays of it says `live_step: true`.

    With `step`, the detail also says whose live step the replays at `step` checked and how often each rank's is
    (`live_checked_ranks`, `live_rotation`: replay.live.coverage_detail).
    """
    names = [_name(t) for t in targets]
    rows = sorted(replay_rows, key=lambda r: r["step"])
    last_clean: dict[str, int | None] = {n: None for n in names}
    confirmed: dict[str, int | None] = {n: None for n in names}
    sdc, unsure = [], []
    for r in rows:
        status, name = r["status"], r["target"]
        if step is not None and confirmed.get(name) is not None and r["step"] > confirmed[name]:
            continue  # vouched for at or after `step`, before this row: a later fault began after the save
        if status == "AGREE":
            if name in last_clean:
                if step is None or r["step"] <= step:
                    last_clean[name] = r["step"]
                if step is not None and r["step"] >= step:
                    confirmed[name] = r["step"]
        elif status == "ATTRIBUTED":
            sdc.append(
                {
                    "code": "replay_sdc",
                    "ranks": sorted(r.get("ranks") or []),
                    "target": name,
                    "recipe": r.get("recipe"),
                    "step": r["step"],
                    **reason_flag(r),
                    **_comparison(r),
                }
            )
        else:
            unsure.append(
                {
                    "code": "replay_inconclusive",
                    "ranks": sorted(r.get("ranks") or []),
                    "target": name,
                    "recipe": r.get("recipe"),
                    "step": r["step"],
                    **reason_flag(r),
                }
            )
    detail = {"coverage": last_clean, "replays": len(rows)}
    if step is not None:
        detail["confirmed_after"] = confirmed
        detail.update(coverage_detail(r for r in rows if r["step"] == step))
        compared = sorted({c for r in rows if r["step"] == step for c in _comparison(r).values()})
        if compared:  # what the bitwise comparison at the save rested on (replay/determinism.py)
            detail["comparison"] = compared
    if sdc:
        return evidence(FAIL, sdc + unsure, **detail)
    if unsure:
        return evidence(INCONCLUSIVE, unsure, **detail)
    if not names:
        return evidence(NOT_APPLICABLE, [{"code": "replay_no_targets"}], **detail)
    missing = [n for n in names if last_clean[n] is None]
    if missing:
        return evidence(MISSING, [{"code": "replay_coverage_incomplete", "missing": missing}], **detail)
    pending = [n for n in names if step is not None and confirmed[n] is None]
    if pending:
        return evidence(MISSING, [{"code": "replay_pending", "awaiting": pending}], **detail)
    return evidence(PASS, [], **detail)


__all__ = ["OPTIMIZER_TARGET", "RECIPES", "SaveForecast", "Schedule", "Target", "coverage", "discover_targets"]
