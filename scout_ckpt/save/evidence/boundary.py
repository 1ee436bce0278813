"""What a Checkpointer's save proves: the run's policy, the evidence taken from the live state at a save boundary,
and the verdict it gives together with the writers' evidence.

Why a module of its own: the Checkpointer (checkpointer.py) decides *when* a save's steps run, on which thread
and group (the async path: async_save.py), and commit.py *how* a save is published; this module decides *what*
the save proves. It holds the run's evidence configuration (invariant checks, the writers' finite checks,
consensus, shard and replay evidence, load verification) and what carries from one save to the next (the previous
invariant values for `monotone`, the health window), and turns them into:

- `policy`: what "certified" requires of this run, stored in the ledger and every manifest;
- `live` (collective): the evidence taken from the state at the save boundary, identical on every rank but
  `replay` (the coordinator's): the consensus verdict of the hashing the save started, invariants, shard evidence,
  the load-verification signatures, the replay coverage;
- `assess` (coordinator): that evidence, the writers' (bytes, finite checks) and the observers' (health) ->
  the evidence dict, the signatures and the verdict the commit records.

Nothing here holds a reference to the Checkpointer (a reference cycle would keep its process groups alive past
destroy_process_group): the ledger and run id come as plain values (`bind`).
"""

from __future__ import annotations

from scout_ckpt import invariants as inv
from scout_ckpt import policy
from scout_ckpt.consensus.full import full_signatures
from scout_ckpt.consensus.mesh import full_signable
from scout_ckpt.consensus.signatures import flatten_state
from scout_ckpt.format import node_manifest
from scout_ckpt.save import log as scout_log
from scout_ckpt.save.evidence.health import HealthWindow
from scout_ckpt.save.evidence.shard import KINDS as SHARD_KINDS


class SaveEvidence:
    """The evidence of one Checkpointer's saves (see the module docstring). `checks` are parsed invariant specs,
    `replay`/`shard` the ReplayEvidence/ShardEvidence or None, `mode` the topology's mode name."""

    def __init__(
        self,
        *,
        checks: list,
        finite: bool,
        consensus: bool,
        verify_load: bool,
        replay,
        shard,
        mode: str,
        is_coordinator: bool,
        lineage=None,
        world_size: int = 2,
    ):
        self.checks, self.finite, self.consensus, self.verify_load = checks, finite, consensus, verify_load
        self.replay, self.shard, self.mode, self.is_coordinator = replay, shard, mode, is_coordinator
        self.world_size = world_size
        self.policy = self._policy()
        self.ledger = None
        self.run_id: str | None = None
        self._inv_previous: dict | None = None
        self._health = HealthWindow()
        # save/lineage.py: once a save's evidence showed the live state bad, until a clean checkpoint is loaded,
        # every save in between descends from that state and is rejected (`lineage`, policy.lineage_evidence).
        self.lineage = lineage

    def bind(self, *, ledger, run_id: str) -> None:
        """The run, once it is known (after the policy went into the ledger); `ledger` is the coordinator's."""
        self.ledger, self.run_id = ledger, run_id

    # ---- policy --------------------------------------------------------------------------------------------

    def _policy(self) -> dict:
        """What "certified" means for this run, stored in the ledger and every manifest."""
        require = ["bytes"]
        if self.finite or self.checks:
            require.append("invariants")
        allow_na = []
        if self.shard is not None:
            require += list(SHARD_KINDS)
        if self.consensus:
            require.append("consensus")
            # Single-owner shards (pure FSDP) have no replica to compare with: only checks that pin a tensor's
            # values down can vouch for them (invariants.VOUCHES; `finite` and `monotone` never do), or the
            # cross-rank replay of every shard's update together with the at-rest check.
            # Tensor-parallel shards without a data-parallel replica (a "+tp" mesh whose replicate dims are 1) are
            # single-owner too, and vouched for the same way.
            single_owner = self.mode.startswith("fsdp") or "+tp" in self.mode
            if any(c.vouches for c in self.checks) or (self.shard is not None and single_owner):
                allow_na.append("consensus")
            elif self.world_size < 2:
                # one rank has no replica: certified on bytes and the finite checks, the gap named at start
                # (warn_if_never_certifies) and in the evidence; `resume --require consensus` refuses such steps
                allow_na.append("consensus")
        if self.replay is not None:
            require.append("replay")
            # not_applicable only where the script never called ckpt.step() (replay_no_step_hook): certified on
            # the rest of the evidence, the gap named in the evidence and refused by `--require replay`
            allow_na.append("replay")
        finite = ["finite"] if self.finite and not any(c.kind == "finite" for c in self.checks) else []
        return {
            "require": require,
            "allow_not_applicable": allow_na,
            "invariants": [c.spec for c in self.checks] + finite,
            "replay_targets": [list(t) for t in self.replay.targets()] if self.replay else [],
        }

    def warn_if_never_certifies(self) -> None:
        """A run whose policy can never be met should say so at start-up, not after a week of `committed`
        (on the coordinator only)."""
        if self.world_size < 2 and self.consensus and self.is_coordinator:
            scout_log.logger.warning(
                "one rank: no replica to compare and no peer to replay on, so silent data corruption is not "
                "detected; checkpoints are certified on their bytes and finite checks alone (consensus "
                "not_applicable; `scout-ckpt resume --latest-clean --require consensus` refuses them)"
            )
        single_owner = self.mode.startswith("fsdp")
        if (
            single_owner
            and "consensus" in self.policy["require"]
            and "consensus" not in self.policy["allow_not_applicable"]
            and self.is_coordinator
        ):
            scout_log.logger.warning(
                "this configuration can never certify a checkpoint: the %s topology has single-owner shards, so "
                "consensus is not applicable, and nothing else vouches for the shards. Use a non-fused Adam, "
                "AdamW or SGD so that shard evidence runs (shard_evidence=True, the default for FSDP), or "
                "configure an invariant that vouches (e.g. {'check': 'spectral_bound', ...}), or pass "
                "consensus=False to accept bytes and finite checks alone",
                self.mode,
            )

    # ---- the live state (every rank) -----------------------------------------------------------------------

    def live(self, step: int, flat: dict, hashing, group, taken_at: float) -> dict:
        """Evidence taken from the state at the save boundary (collective over `group` and the consensus groups):
        sync saves gather it after the write, async ones before it or, from the staged copy, in the commit thread;
        the state is the same either way. `hashing` is the consensus the save started (or None); `taken_at` the
        wall time the save started, the end of the health window."""
        # The end of the health window (HealthWindow): the state compared here is the state at the start of this
        # save (hashing may finish later), so an event after that start counts against the next save.
        ev: dict = {"_taken_at": taken_at}
        if self.is_coordinator and self.ledger is not None:
            # where the health window ends: the ledger's receipt position now, not anyone's clock
            ev["_events_upto"] = self.ledger.last_event_id()
        if hashing is not None:
            ev["consensus"] = hashing.finish()
        if self.checks:
            res = inv.run_local(self.checks, inv.flatten(flat), group=group, previous=self._inv_previous)
            self._inv_previous = res.get("values") or self._inv_previous
            ev["invariants"] = res
        if self.shard is not None:
            ev.update(self.shard.live(step))
        if self.verify_load:
            # Where consensus hashed every leaf on every rank (DDP), the signatures need no collective.
            full = hashing.full_rows() if hashing is not None else None
            known = full if full is not None else (hashing.replica_rows() if hashing is not None else None)
            # A _StridedShard (FSDP x TP) has no one-box shard to sign: its bytes vouch for it at load instead.
            # one flattening of the state a save: consensus's, where it took one of this very state
            flattened = hashing.flattened(flat) if hashing is not None else None
            if flattened is None:
                flattened = flatten_state(flat, keep_dtensor=True)
            unsigned = full_signable(flattened)[1]
            # The DTensor shards' partial signatures, where the consensus thread computed them during the write
            partials = hashing.shard_partials() if hashing is not None else None
            ev["signatures"] = full_signatures(
                flat,
                group=group,
                plain="replica",
                known=known,
                complete=full is not None,
                exclude=unsigned,
                partials=partials,
                flat=flattened,
            )
            if hashing is not None:
                hashing.keep_partials()  # from the next save on
            if unsigned:
                ev["load_check_unsigned"] = unsigned
        if self.replay is not None and self.is_coordinator:
            ev["replay"] = self.replay.evidence(step)
        return ev

    # ---- the verdict (coordinator) -------------------------------------------------------------------------

    def assess(self, gathered: list[dict], live: dict) -> tuple[dict, dict, policy.Verdict]:
        """Coordinator: (evidence, signatures, verdict) from the writers' digests and finite checks plus the live
        evidence of the boundary. Live evidence is identical on every rank (but `replay`, the coordinator's), so
        only the coordinator's is used and the others send just what they wrote."""
        files = [f for g in gathered for f in g["files"]]
        live = dict(live)
        signatures = live.pop("signatures", {})
        unsigned = live.pop("load_check_unsigned", None)
        live.pop("_taken_at", None)
        upto = live.pop("_events_upto", None)
        if upto is None:
            upto = self.ledger.last_event_id()
        nfiles, nbytes = node_manifest.totals(files)  # a node manifest's row counts its node's files
        ev = {"bytes": policy.evidence(policy.PASS, files=nfiles, bytes=nbytes, hashed_by="writers")}
        if unsigned:
            ev["bytes"]["load_check_unsigned"] = unsigned[:64]
        if self.finite or self.checks:
            bad = [
                {"code": "invariant_failed", "check": "finite", "ranks": [g["rank"]], "tensors": g["finite_bad"][:8]}
                for g in gathered
                if g["finite_bad"]
            ]
            checks = live.pop("invariants", None)
            reasons = bad + (checks["reasons"] if checks else [])
            status = policy.PASS
            if checks and checks["status"] != policy.PASS:
                status = checks["status"]
            if bad:
                status = policy.FAIL
            ev["invariants"] = policy.evidence(
                status, reasons, specs=self.policy["invariants"], values=(checks or {}).get("values")
            )
        ev.update(live)
        ev["health"] = self._health_evidence(ev, upto)
        lineage = policy.lineage_evidence(self.lineage.tainted if self.lineage is not None else None)
        if lineage is not None:
            ev["lineage"] = lineage
        verdict = policy.evaluate(self.policy, ev)
        self._health.settled(verdict.state, upto)
        return ev, signatures, verdict

    def _health_evidence(self, ev: dict, until: int) -> dict:
        """Coordinator: hardware faults and desyncs the observers recorded in this run since the newest certified
        save's evidence (health evidence fails for the owner's state unless this save's consensus or vouching
        invariants clear it)."""
        events = [e for e in self.ledger.events(kinds=("health", "desync")) if e.get("run_id") == self.run_id]
        return self._health.evidence(
            events,
            until=until,
            mode=self.mode,
            consensus=ev.get("consensus"),
            invariants=ev.get("invariants"),
            vouching=any(c.vouches for c in self.checks),
        )
