"""Evidence for sharded state (FSDP2, HSDP): cross-rank replay of each shard's optimizer update
(replay/shard_optimizer.py) and the at-rest check (at_rest.py), driven from the Checkpointer's hooks.

On by default where parameters are sharded. An optimizer the replay cannot reproduce bit for bit (fused, or not
Adam/AdamW/SGD) turns it off with a WARNING when defaulted, and is refused when the caller asked for it. Every
method but `resign` and `revoke` is collective: every rank calls it at the same point with the same step.

Save cadence. The at-rest check needs the shards signed right after the optimizer step a save follows. Signing
after every step costs a hashing pass per step (about half the evidence's cost), so once this incarnation has seen
a save, only the steps on the cadence the saves so far imply are signed (the gcd of the save steps and of the
first save's distance from the start): saves every N steps cost one signing pass per save. A save off that cadence
finds its step unsigned (at rest `missing`: that checkpoint stays uncertified) and the cadence shrinks to fit it.
`shard_evidence=ShardEvidenceOptions(at_rest_every=1)` signs after every step (irregular save schedules).

Decided at commit, revoked if need be. A save's shard replay window is the last cycle, or every step since the
start/resume when fewer (shard_plan.shard_replay_evidence), so the first saves are certified at their commit. A
fault found later is charged to every save within one cycle before it (`revoke`): certified or committed
checkpoints among them are rejected in the ledger, as later replay evidence does for the module replay.
"""

from __future__ import annotations

import math

from scout_ckpt import policy
from scout_ckpt.errors import ScoutError
from scout_ckpt.options import ShardEvidenceOptions, as_shard_evidence
from scout_ckpt.save import log as scout_log

KINDS = ("shard_replay", "at_rest")


class ShardEvidence:
    def __init__(self, replay, log, guard, *, adaptive: bool = True):
        self.replay, self.log, self.guard = replay, log, guard
        self.adaptive = adaptive
        self._start = 0  # the step this incarnation began after (0, or the resumed step)
        self._cadence: int | None = None  # saves fall on multiples of it (learned from the saves so far)

    @classmethod
    def start(
        cls,
        cfg: ShardEvidenceOptions | dict | bool | None,
        *,
        mode: str,
        model,
        optimizer,
        group,
        timeout_s: float,
        no_replicas: bool = False,
    ) -> "ShardEvidence | None":
        """None where it does not apply; creates its side groups now, in the same order on every rank. On by
        default for sharded layouts: FSDP2 and HSDP, and tensor-parallel meshes without a data-parallel replica
        (`no_replicas`: their TP shards have no copy for consensus to compare)."""
        cfg = as_shard_evidence(cfg)  # a misspelled key or a bad value fails here, naming the field
        sharded = mode.startswith(("fsdp", "hsdp")) or ("+tp" in mode and no_replicas)
        asked = cfg is not None
        if not (cfg if asked else sharded) or model is None or optimizer is None:
            return None
        from scout_ckpt.replay.optimizer_replay import unwrap_optimizer
        from scout_ckpt.replay.shard_optimizer import ShardUpdateReplay, UnsupportedOptimizer, check_supported
        from scout_ckpt.replay.shard_plan import ShardReplayLog
        from scout_ckpt.save.evidence.at_rest import AtRestGuard

        optimizer = unwrap_optimizer(optimizer)  # accelerate's AcceleratedOptimizer: the torch one it wraps
        opts = cfg if isinstance(cfg, ShardEvidenceOptions) else ShardEvidenceOptions()
        at_rest_every = opts.at_rest_every
        try:
            check_supported(optimizer)
        except UnsupportedOptimizer as e:
            if asked:
                raise ScoutError(f"shard evidence: {e}") from None
            scout_log.logger.warning("shard evidence is off: %s", e)
            return None
        replay = ShardUpdateReplay(optimizer, model, timeout_s=timeout_s, **opts.replay_kwargs())
        guard = AtRestGuard(optimizer, model, group=group, every=at_rest_every or 1)
        return cls(replay, ShardReplayLog(replay.cycle), guard, adaptive=at_rest_every is None)

    def _arm_for(self, step: int) -> None:
        """Before optimizer step `step`: have the guard sign after it if a save is expected to follow it."""
        if self._cadence is not None and step % self._cadence == 0:
            self.guard.arm_next()

    def on_step(self, step: int) -> list[dict]:
        """After the optimizer step: this step's cross-checks; returns the rows that found a fault."""
        self._arm_for(step + 1)
        self.guard.next_step = step + 1  # the interval check numbers its runs and findings by training step
        return self.log.add(self.replay.on_step(step))

    def _saw_save(self, step: int) -> None:
        if not self.adaptive or step <= self._start:
            return
        first = self._cadence is None
        self._cadence = math.gcd(self._cadence or 0, step, step - self._start if first else 0)
        self.guard.every = None  # from now on only the steps on the cadence are signed
        self._arm_for(step + 1)

    def flush(self) -> list[dict]:
        """Before a save: the exchange in flight; returns the rows that found a fault."""
        return self.log.add(self.replay.flush())

    def live(self, step: int) -> dict:
        """The save's evidence: {"at_rest": ..., "shard_replay": ...}."""
        out = {"at_rest": self.guard.check(step), "shard_replay": self.log.evidence(step)}
        self._saw_save(step)
        return out

    def resign(self) -> None:
        """Local: a legitimate write after the optimizer step (see Checkpointer.parameters_written)."""
        self.guard.resign()

    def after_load(self, step: int) -> None:
        self.replay.begin(step)
        self.log.reset(step)
        self.guard.next_step = step + 1
        self.guard.resign()
        self.guard.forget()  # changes found between steps before the load do not concern the loaded state
        self._start = step
        self._arm_for(step + 1)

    def revoke(self, ledger, root, bad_rows: list[dict], source: str = "shard_replay") -> list[int]:
        """Coordinator, local: reject the certified (or committed) checkpoints that the faults in `bad_rows` may
        already be in (up to one cycle before each was found); returns their steps. Their shard replay evidence
        becomes the fault's."""
        from scout_ckpt.ledger import journal
        from scout_ckpt.replay.shard_plan import charged_steps
        from scout_ckpt.save import local_tier_rows as local_rows

        out = []
        for r in bad_rows:
            lo, hi = charged_steps(r, self.log.cycle)
            status = policy.FAIL if r["status"] == policy.FAIL else policy.INCONCLUSIVE
            reasons = [
                dict(x, found_at_step=r["step"])
                for x in (r.get("reasons") or [])
                if x["code"] != "shard_replay_missing"
            ][:16] or [{"code": f"shard_replay_{status}", "ranks": r.get("ranks") or [], "found_at_step": r["step"]}]
            for row in ledger.checkpoints(states=("certified", "committed")):
                if not lo < row["step"] <= hi:
                    continue
                ledger.put_evidence(
                    row["step"],
                    {
                        "shard_replay": policy.evidence(
                            status, reasons, ranks=r.get("ranks") or [], steps=[r["step"]], cycle=self.log.cycle
                        )
                    },
                    source=source,
                )
                if journal.record_transition(
                    ledger,
                    root,
                    row["step"],
                    "rejected",
                    reasons,
                    source=source,
                    expect=(row["state"],),
                    attempt=row["attempt"],
                ):
                    out.append(row["step"])
            # the fast tier's copies of the same steps: the fault is in the state, wherever its bytes live
            for row in local_rows.rows(ledger, states=("certified", "committed")):
                if lo < row["step"] <= hi and local_rows.set_state(
                    ledger, row["step"], "rejected", reasons, expect=row["state"]
                ):
                    ledger.add_event(
                        "local_rejected", step=row["step"], detail={"reasons": reasons[:8], "source": source}
                    )
                    out.append(row["step"])
        return sorted(set(out))

    def close(self) -> None:
        self.log.add(self.replay.close())
        self.guard.close()
