"""SDC replay and FSDP shard evidence for TorchTitan's checkpoint manager, wired with the same calls as the core
Checkpointer (replay_evidence.ReplayEvidence, shard_evidence.ShardEvidence), so a TorchTitan job gets the same
evidence: certified at commit, a one-ulp optimizer fault or a bit flip at rest on one rank rejected and attributed.

TorchTitan has no per-step hook for a checkpoint manager, but its Trainer calls `checkpointer.save(step, ...)`
after every optimizer step (and the LR scheduler's), whether or not the step is saved: `on_step` is driven from
there, before the manager decides whether to save (`_should_save`). The call order of one save (all ranks):

  on_step(S)      the module replay's rotation and the shard replay's exchange of step S (collective on side
                  groups); faults found are `sdc` events and revoke the checkpoints they may be in (coordinator)
  before_save(S)  the replay's sweep of step S; the shard replay's exchange in flight (faults as above)
  live(S)         the at-rest check (collective on the run's group) and the shard replay evidence; the replay's
                  coverage on the coordinator: merged into the save's live evidence
  after_load(S)   replay schedule and shard plans start again from the loaded step

The model and optimizer the engines see are TorchTitan's single model part and its single torch optimizer
(OptimizersContainer.optimizers[0]); with several (pipeline stages, several optimizer factories) they are off,
with a WARNING when defaulted, refused when asked for. TorchTitan's default optimizer implementation is "fused",
which the shard replay cannot reproduce on a slice: use implementation="foreach" (or "for-loop").
"""

from __future__ import annotations

from scout_ckpt.errors import ScoutError
from scout_ckpt.options import ReplayOptions, ShardEvidenceOptions
from scout_ckpt.save import log as scout_log
from scout_ckpt.save.evidence.replay import ReplayEvidence
from scout_ckpt.save.evidence.shard import KINDS as SHARD_KINDS
from scout_ckpt.save.evidence.shard import ShardEvidence

__all__ = ["TitanEvidence", "SHARD_KINDS"]


def _single(mgr) -> tuple[object | None, object | None, str | None]:
    """(model, torch optimizer, why not) of the manager's single model part."""
    parts = list(mgr.states["model"].model)
    opts = list(getattr(mgr.states.get("optimizer"), "optimizers", None) or [])
    if len(parts) != 1 or len(opts) != 1:
        return (
            None,
            None,
            (
                f"{len(parts)} model part(s) and {len(opts)} optimizer(s): replay and shard evidence "
                "need exactly one of each (no pipeline stages, one optimizer factory)"
            ),
        )
    return parts[0], opts[0], None


class TitanEvidence:
    """Replay (`replay`) and shard evidence (`shard`) of one manager; either may be None. See the module doc."""

    def __init__(self, mgr, replay: ReplayEvidence | None, shard: ShardEvidence | None) -> None:
        self.mgr, self.replay, self.shard = mgr, replay, shard
        self._stepped = -1

    @classmethod
    def start(cls, mgr, config) -> "TitanEvidence":
        """Collective (side groups, same order on every rank): the engines the config asks for."""
        model, opt, why = _single(mgr)
        if why is not None:
            for name, asked in (("replay", config.replay), ("shard_evidence", config.shard_evidence)):
                if isinstance(asked, (ReplayOptions, ShardEvidenceOptions)):  # asked for (True: where it can)
                    raise ScoutError(f"{name}: {why}")
            if mgr.mode.startswith(("fsdp", "hsdp")) and mgr.is_coordinator:
                scout_log.logger.warning("shard evidence is off: %s", why)
            return cls(mgr, None, None)
        replay = None
        if mgr.groups is None:
            if isinstance(config.replay, ReplayOptions):
                raise ScoutError("replay was asked for (ReplayOptions) but needs 2 or more ranks")
        else:
            off = ReplayEvidence.off_by_default(mgr.groups.world_size, mgr.mode)  # as the core Checkpointer
            replay = ReplayEvidence.start(
                config.replay, model=model, optimizer=opt, groups=mgr.groups, auto_on=off is None, off_reason=off
            )
            if replay is not None and replay.runner.save_every is None:
                replay.runner.save_every = config.interval  # saves fall on TorchTitan's interval: sweep those
        shard = ShardEvidence.start(
            config.shard_evidence,
            mode=mgr.mode,
            model=model,
            optimizer=opt,
            group=mgr.run.pg,
            timeout_s=config.scout_timeout_s,
        )
        return cls(mgr, replay, shard)

    # ---- policy ----------------------------------------------------------------------------------------------

    def policy(self, require: list[str], allow_na: list[str]) -> dict:
        """The core Checkpointer's rule: shard evidence required where it runs, and it vouches for single-owner
        shards (consensus may then be not applicable under pure FSDP); replay required where it runs."""
        if self.shard is not None:
            require += list(SHARD_KINDS)
            if "consensus" in require and self.mgr.mode.startswith("fsdp") and "consensus" not in allow_na:
                allow_na.append("consensus")
        if self.replay is not None:
            require.append("replay")
        return {"replay_targets": [list(t) for t in self.replay.targets()] if self.replay else []}

    def bind(self) -> None:
        self.mgr.run.bind_replay(self.replay, self.mgr.scout_policy)

    # ---- the hooks -------------------------------------------------------------------------------------------

    def on_step(self, step: int) -> None:
        """Collective: after optimizer step `step` (once per step: a repeated save() of the same step is not a
        new step)."""
        if step <= self._stepped:
            return
        self._stepped = step
        if self.shard is not None:
            self._record_shard_faults(self.shard.on_step(step))
        if self.replay is not None:
            self.replay.on_step(step)

    def before_save(self, step: int) -> None:
        """Collective, before the save's `writing` row: the replay's same-step sweep."""
        if self.replay is not None:
            self.replay.sweep(step)

    def flush(self) -> None:
        """Collective, before the save's evidence: the shard replay's exchange in flight."""
        if self.shard is not None:
            self._record_shard_faults(self.shard.flush())

    def live(self, step: int) -> dict:
        """Collective: {"at_rest", "shard_replay"} on every rank, plus "replay" on the coordinator."""
        ev = self.shard.live(step) if self.shard is not None else {}
        if self.replay is not None and self.mgr.is_coordinator:
            ev["replay"] = self.replay.evidence(step)
        return ev

    def after_load(self, step: int) -> None:
        if self.replay is not None:
            self.replay.begin(step)
        if self.shard is not None:
            self.shard.after_load(step)
        self._stepped = step

    def _record_shard_faults(self, bad: list[dict]) -> None:
        """Collective (`bad` is the same on every rank): an async save still committing may hold the fault, so it
        commits first; then the coordinator records `sdc` events naming the rank and revokes every checkpoint
        within one cycle before the fault (ShardEvidence.revoke)."""
        if not bad:
            return
        m = self.mgr
        if m.save_future is not None:
            m.maybe_wait_for_saving()

        def record():
            for r in bad:
                m.ledger.add_event(
                    "sdc",
                    step=r.get("step"),
                    ranks=r.get("ranks") or [],
                    run_id=m.run_id,
                    detail={"source": "shard_replay", "reasons": (r.get("reasons") or [])[:8]},
                )
            return self.shard.revoke(m.ledger, m.root, bad)

        m.run.on_coordinator("record a shard replay fault", record)

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()
            self.replay = None
        if self.shard is not None:
            self.shard.close()
            self.shard = None
