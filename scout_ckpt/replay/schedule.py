"""Which part of the model is replayed at which step, and the coverage a certified step needs.

Replay checks one target per scheduled step, in a fixed rotation (embedding, every block in order, head,
optimizer), so its cost stays bounded per step while the whole model is covered every `len(targets) *
interval` steps. The rotation is a function of the step number alone: every rank, and a restarted job, agrees
on it without communicating.
"""

from __future__ import annotations

from typing import Iterable

from scout_ckpt.policy import FAIL, INCONCLUSIVE, MISSING, NOT_APPLICABLE, PASS, evidence

RECIPES = ("embedding", "block", "head", "optimizer")
OPTIMIZER_TARGET = "optimizer"

Target = tuple[str, str]  # (recipe, target name), e.g. ("block", "blocks.2")


def discover_targets(model, optimizer=None) -> list[Target]:
    """The coverage set of a transformer-shaped model: `embedding`, each of `blocks`, `head`, the optimizer.

    Falls back to the first nn.Embedding and the last top-level nn.Linear when the attributes are named
    differently. A model with none of these is an error: replay without targets would certify nothing.
    """
    import torch.nn as nn  # here, not at import: `coverage` serves read-only paths that must not load torch

    targets: list[Target] = []
    top = dict(model.named_children())
    emb = "embedding" if "embedding" in top else next(
        (n for n, m in model.named_modules() if isinstance(m, nn.Embedding)), None)
    if emb is not None:
        targets.append(("embedding", emb))
    blocks = top.get("blocks") or top.get("layers")
    if isinstance(blocks, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        prefix = "blocks" if "blocks" in top else "layers"
        targets.extend(("block", f"{prefix}.{name}") for name, _ in blocks.named_children())
    head = "head" if "head" in top else next(
        (n for n, m in reversed(list(top.items())) if isinstance(m, nn.Linear)), None)
    if head is not None:
        targets.append(("head", head))
    if not targets:
        raise ValueError("replay: no embedding, blocks or head found on the model; pass targets= explicitly")
    if optimizer is not None:
        targets.append(("optimizer", OPTIMIZER_TARGET))
    return targets


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


def _name(t) -> str:
    return t[1] if isinstance(t, (tuple, list)) else str(t)


def coverage(replay_rows: Iterable[dict], targets: Iterable, step: int | None = None) -> dict:
    """Replay evidence for the state saved at `step`, from the replays since the previous certified step.

    Without `step` (a plain window): pass when every target has an AGREE row and no row disagrees.
    With `step`, the rows may run past it, and the state is certified only when, for every target, there is a
    clean replay in the window up to `step` AND a clean replay at or after `step`. Failing hardware fails
    persistently: a fault that entered the state at or before `step` shows up in the target's next replay, so
    until that replay has run cleanly the state is `missing` (reason replay_pending), never certified. A
    disagreeing replay counts against `step` unless the same target already replayed cleanly at or after
    `step` before it (then the fault began after the state was saved).

    fail: some replay attributed ranks (replay_sdc); inconclusive: no strict majority (replay_inconclusive);
    missing: replay_coverage_incomplete (no clean replay up to `step`) or replay_pending (none after it yet).
    """
    names = [_name(t) for t in targets]
    rows = sorted(replay_rows, key=lambda r: r["step"])
    last_clean: dict[str, int | None] = {n: None for n in names}
    confirmed: dict[str, int | None] = {n: None for n in names}
    sdc, unsure = [], []
    for r in rows:
        status, name = r["status"], r["target"]
        if step is not None and confirmed.get(name) is not None:
            continue  # this target was vouched for after `step`; later faults began after the save
        if status == "AGREE":
            if name in last_clean:
                if step is None or r["step"] <= step:
                    last_clean[name] = r["step"]
                if step is not None and r["step"] >= step:
                    confirmed[name] = r["step"]
        elif status == "ATTRIBUTED":
            sdc.append({"code": "replay_sdc", "ranks": sorted(r.get("ranks") or []), "target": name,
                        "recipe": r.get("recipe"), "step": r["step"]})
        else:
            unsure.append({"code": "replay_inconclusive", "ranks": sorted(r.get("ranks") or []), "target": name,
                           "recipe": r.get("recipe"), "step": r["step"]})
    detail = {"coverage": last_clean, "replays": len(rows)}
    if step is not None:
        detail["confirmed_after"] = confirmed
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


__all__ = ["RECIPES", "OPTIMIZER_TARGET", "Target", "discover_targets", "Schedule", "coverage"]
