"""Evidence for sharded state (FSDP2, HSDP): cross-rank replay of each shard's optimizer update
(replay/shard_optimizer.py) and the at-rest check (at_rest.py), driven from the Checkpointer's hooks.

On by default where parameters are sharded. An optimizer the replay cannot reproduce bit for bit (fused, or not
Adam/AdamW/SGD) turns it off with a WARNING when defaulted, and is refused when the caller asked for it. Every
method but `resign` is collective: every rank calls it at the same point with the same step.
"""

from __future__ import annotations

from scout_ckpt import log as scout_log
from scout_ckpt.errors import ScoutError

KINDS = ("shard_replay", "at_rest")


class ShardEvidence:
    def __init__(self, replay, log, guard):
        self.replay, self.log, self.guard = replay, log, guard

    @classmethod
    def start(cls, cfg: dict | bool | None, *, mode: str, model, optimizer, group,
              timeout_s: float) -> "ShardEvidence | None":
        """None where it does not apply; creates its side groups now, in the same order on every rank."""
        sharded = mode.startswith(("fsdp", "hsdp"))
        asked = cfg is not None
        if not (cfg if asked else sharded) or model is None or optimizer is None:
            return None
        from scout_ckpt.at_rest import AtRestGuard
        from scout_ckpt.replay.shard_optimizer import ShardUpdateReplay, UnsupportedOptimizer, check_supported
        from scout_ckpt.replay.shard_plan import ShardReplayLog

        try:
            check_supported(optimizer)
        except UnsupportedOptimizer as e:
            if asked:
                raise ScoutError(f"shard evidence: {e}") from None
            scout_log.logger.warning("shard evidence is off: %s", e)
            return None
        replay = ShardUpdateReplay(optimizer, model, timeout_s=timeout_s, **(cfg if isinstance(cfg, dict) else {}))
        return cls(replay, ShardReplayLog(replay.cycle), AtRestGuard(optimizer, model, group=group))

    def on_step(self, step: int) -> list[dict]:
        """After the optimizer step: this step's cross-checks; returns the rows that found a fault."""
        return self.log.add(self.replay.on_step(step))

    def flush(self) -> list[dict]:
        """Before a save: the exchange in flight; returns the rows that found a fault."""
        return self.log.add(self.replay.flush())

    def live(self, step: int) -> dict:
        """The save's evidence: {"at_rest": ..., "shard_replay": ...}."""
        return {"at_rest": self.guard.check(step), "shard_replay": self.log.evidence(step)}

    def resign(self) -> None:
        """Local: a legitimate write after the optimizer step (see Checkpointer.parameters_written)."""
        self.guard.resign()

    def after_load(self, step: int) -> None:
        self.replay.begin(step)
        self.log.reset()
        self.guard.resign()

    def close(self) -> None:
        self.log.add(self.replay.close())
        self.guard.close()
