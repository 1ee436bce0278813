"""Certified checkpoints for TorchTitan 0.3: `ScoutCheckpointManager`, a subclass of its DCP `CheckpointManager`
(same on-disk layout, `FOLDER/step-N/` with `.metadata` and `__R_0.distcp`, so TorchTitan's own tools still read
it), enabled by configuration alone, either in a Python config

    from scout_ckpt.integrations.torchtitan import ScoutCheckpointManager
    Trainer.Config(..., checkpoint=ScoutCheckpointManager.Config(enable=True, folder="checkpoint", interval=500,
                                                                 keep_latest_k=3))

or on the command line of an unchanged TorchTitan config, through TorchTitan's override mechanism (it replaces the
CheckpointManager.Config by a ScoutCheckpointManager.Config with the same field values, before anything is built):

    --override.imports scout_ckpt.integrations.torchtitan.scout_checkpoint

What changes against the parent, hook by hook (TorchTitan's public methods are left alone; its base class guards
them and forbids overriding them):

  __init__           replica groups from TorchTitan's mesh (`titan_topology`: the ParallelDims the Trainer passes
                     as its train state, else the model's DTensor meshes), the run begun in the ledger after the
                     core's settling of interrupted saves (integrations.session.IntegrationRun); SDC replay and
                     FSDP shard evidence as the core Checkpointer starts them (integrations.titan_evidence)
  _save              called by TorchTitan's Trainer after every optimizer step: first the evidence's per-step hook
                     (replay rotation, shard update replay); on a save step, the replay's sweep, then the
                     coordinator records `writing` (and removes the folder of an abandoned attempt at the same
                     step); every rank takes the at-rest check, shard replay and replay coverage; then the parent
                     writes while consensus over the replica dims of the mesh, the configured invariants and the
                     full-tensor signatures for the load check are taken beside the write, in background threads
                     (integrations.titan_live), joined before `_save` returns; sync: commit at once (certified at
                     commit); async modes: commit when the upload has completed
  _wait_for_saving   the parent waits for the upload; then the pending commit runs (all ranks)
  _close             flushes a pending async commit first (the parent does not await save_future)
  commit             barrier; each rank hashes the `__R_0.distcp` it wrote, the other files are split over the ranks
                     by size; the coordinator
                     writes scout-manifest.json into step-N, records the verdict, then purges
  _load(step=-1)     the newest *certified* step whose bytes re-verify (core recovery.latest_clean: walking back,
                     rejecting failures), loaded by the parent; then the loaded values are compared with the
                     full-tensor signatures recorded at save; a mismatch rejects the step (`load_mismatch`) and the
                     next older certified one is loaded, in the same call; a fresh start (nothing certified) falls
                     back to the parent's initial_load_path handling. An explicit load_step is loaded as TorchTitan
                     does (the operator's choice). After a load the evidence's schedules restart from its step.
  _purge_stale_checkpoints  core retention (`retention.decide` with keep = keep_latest_k): never the newest
                     certified nor a newer one awaiting evidence, rejected ones first; runs after the commit, never
                     right after an async dispatch; a `purge_exempt` callable on the manager (TorchTitan main's
                     option) keeps the steps it names besides
  _is_valid_checkpoint, _is_resumable_checkpoint  TorchTitan main's hooks, answered by integrations.titan_next
                     (one definition with the load choice and retention above)

Not covered: a last-step save with `last_save_model_only` (TorchTitan's default) is recorded and hashed but carries
model evidence only and no load signatures (and, off the save interval, no replay sweep: it stays `committed`
under a policy that requires replay); replay and shard evidence with several model parts (pipeline stages) or
several optimizers.
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.config.override import derive, override

import scout_ckpt
from scout_ckpt import invariants as inv
from scout_ckpt import options
from scout_ckpt.errors import ScoutError
from scout_ckpt.integrations import titan_next
from scout_ckpt.integrations.session import IntegrationRun
from scout_ckpt.integrations.titan_evidence import TitanEvidence
from scout_ckpt.integrations.titan_live import LiveEvidence
from scout_ckpt.ledger import journal
from scout_ckpt.options import ReplayOptions, ShardEvidenceOptions
from scout_ckpt.save import log

__all__ = ["ScoutCheckpointManager", "scout_checkpoint", "signable", "titan_topology"]

TITAN_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # TorchTitan's dense mesh, row-major over the world
DIM_ROLES = {
    "pp": "pipeline",
    "dp_replicate": "replicate",
    "dp_shard": "shard",
    "cp": "context_parallel",
    "tp": "tensor_parallel",
}
PER_RANK = ("dataloader",)
DCP_DATA = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's data file, written by rank \1


def dcp_writer(path: str) -> int | None:
    """The rank that wrote a DCP data file (it hashes it: digests by the writing ranks), None for others."""
    m = DCP_DATA.match(path)
    return (
        int(m.group(1)) if m else None
    )  # TorchTitan keys the dataloader's state by dp rank: it differs per rank by design


def _shared_state(name: str) -> bool:
    """Consensus compares what is not per rank by design."""
    return not name.startswith(PER_RANK)


def titan_topology(model_parts: list, parallel_dims=None, world_size: int | None = None) -> dict:
    """The topology consensus uses (consensus.mesh's dict), for TorchTitan's meshes. Local, no collective.

    TorchTitan unflattens every mesh from a 1-D world mesh, so the root of its DeviceMeshes is that 1-D mesh and
    `describe_topology` cannot place a 2-D DTensor on it (it fails closed, `consensus_layout_unknown`). With the
    ParallelDims the grid is TorchTitan's dense mesh, (pp, dp_replicate, dp_shard, cp, tp) row-major over the
    world (size-1 dims dropped), given to `describe_topology(grid=, roles=)`, which places each DTensor on it by
    rank arithmetic (it also resolves the flattened `fsdp` = dp_shard x cp, and FSDP x TP's _StridedShard). Mode
    names follow the core's: fsdp, hsdp, ddp, with +tp / +pp. Without ParallelDims: `describe_topology` of the
    model parts.

    Args:
        model_parts: TorchTitan's model parts.
        parallel_dims: its ParallelDims (None: the topology is read from the model parts' DTensors).
        world_size: the world size (default: torch.distributed's).
    """
    from torch import nn

    from scout_ckpt.consensus.mesh import Grid, describe_topology

    world = world_size or (dist.get_world_size() if dist.is_initialized() else 1)
    model = model_parts[0] if len(model_parts) == 1 else nn.ModuleList(model_parts)
    if parallel_dims is None:
        return describe_topology(model, world_size=world)
    dims = [(n, int(getattr(parallel_dims, n))) for n in TITAN_DIMS if int(getattr(parallel_dims, n)) > 1]
    grid = Grid.make([d for _, d in dims], [n for n, _ in dims], range(world)) if dims else Grid.world(world)
    return describe_topology(model, world_size=world, grid=grid, roles=DIM_ROLES)


def signable(states: dict, skip: tuple[str, ...] = ()) -> tuple[dict, list[str]]:
    """({dotted key: leaf} the load check can sign, [keys it cannot]). Local, the same on every rank (placements are
    SPMD). Full-tensor signatures (consensus.full) handle Shard(dim) and Replicate placements; FSDP over a TP dim
    shards the same tensor dim twice (_StridedShard), which they refuse: such tensors are vouched for at load by
    their byte digests alone, and the manifest lists them (`load_check_unsigned`).

    Args:
        states: the states TorchTitan checkpoints, by name.
        skip: key prefixes left out.
    """
    from scout_ckpt.consensus.flatten import flatten_state
    from scout_ckpt.consensus.mesh import full_signable

    return full_signable(flatten_state({k: v for k, v in states.items() if not k.startswith(skip)}, keep_dtensor=True))


class ScoutCheckpointManager(CheckpointManager):
    """TorchTitan's DCP checkpoint manager with scout-ckpt's evidence, verdicts and latest-clean loading.

    Args:
        config: its Config (TorchTitan's checkpoint fields, and scout-ckpt's: invariants, consensus, verify_load, ...).
        kwargs: what TorchTitan's Trainer passes its checkpoint manager (dataloader, model_parts, optimizers, states, ...).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        invariants: list = field(default_factory=lambda: ["finite"])
        """Invariant specs checked on the live state at every save (scout_ckpt.invariants)."""

        consensus: bool = True
        """Compare the live state across the replica dims of the mesh (plain state across all ranks)."""

        verify_load: bool = True
        """Record full-tensor signatures at save and compare the loaded values with them at load(step=-1)."""

        scout_timeout_s: float = 600.0
        """Timeout of scout-ckpt's own gloo groups: a dead peer fails the save instead of hanging it."""

        replay: ReplayOptions | bool = True
        """SDC replay of the model's blocks across ranks, as the core's `replay=`: True = on with 2+ ranks when
        the model has repeated blocks, a ReplayOptions (asked for: refused where it cannot run), False = off. A
        config file's table is converted with ReplayOptions.from_dict."""

        shard_evidence: ShardEvidenceOptions | bool = True
        """Cross-rank replay of each shard's optimizer update and the at-rest check, as the core's
        `shard_evidence=`: True = on for sharded layouts (fsdp, hsdp) with a non-fused Adam/AdamW/SGD, else off
        with a WARNING (TorchTitan's optimizer default is implementation="fused": use "foreach"); a
        ShardEvidenceOptions; False = off. A config file's table is converted with ShardEvidenceOptions.from_dict."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            inv.parse_specs(self.invariants)
            # a config file (TOML, JSON, a CLI override) gives a group as a table: converted here, the one place
            if isinstance(self.replay, Mapping):
                self.replay = ReplayOptions.from_dict(self.replay)
            if isinstance(self.shard_evidence, Mapping):
                self.shard_evidence = ShardEvidenceOptions.from_dict(self.shard_evidence)
            options.check_group("replay", self.replay)
            options.check_group("shard_evidence", self.shard_evidence)

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.checks = inv.parse_specs(config.invariants)
        self.verify_load = config.verify_load
        self._use_cpu_stager()
        self.run = IntegrationRun(self.folder, framework="torchtitan", timeout_s=config.scout_timeout_s)
        self.root, self.rank, self.world = self.run.root, self.run.rank, self.run.world
        self.is_coordinator = self.run.is_coordinator
        parallel_dims = getattr(self.states.get("train_state"), "parallel_dims", None)
        try:
            topo = titan_topology(self.states["model"].model, parallel_dims, self.world)
        except ValueError as e:
            raise ScoutError(f"topology: {e}") from None
        self.groups = None
        self.mode = topo["mode"]
        if (config.consensus or isinstance(config.replay, ReplayOptions)) and self.world > 1:
            from scout_ckpt.consensus.groups import ConsensusGroups

            self.groups = ConsensusGroups.from_topology(topo, timeout_s=config.scout_timeout_s)
        self.consensus = config.consensus and self.groups is not None
        self.evidence = TitanEvidence.start(self, config)
        self.scout_policy = self._policy()
        self._warn_if_never_certifies()
        self.topology = {
            **{
                k: topo[k]
                for k in (
                    "mode",
                    "world_size",
                    "mesh_shape",
                    "mesh_dim_names",
                    "dim_roles",
                    "compare_dims",
                    "replica_groups",
                    "problems",
                )
            },
            "framework": "torchtitan",
        }
        self._pending: tuple | None = None
        self._purging = False
        self._chosen = -1
        self.last_verdict: dict | None = None
        self.loaded: dict | None = None
        self.run.start(topology=self.topology, policy=self.scout_policy, versions=self._versions())
        self.run_id = self.run.run_id
        self.evidence.bind()

    @property
    def ledger(self):
        return self.run.ledger

    def parameters_written(self) -> None:
        """As Checkpointer.parameters_written: call after writing parameters or optimizer state outside the
        optimizer step (a projection, an EMA written back) and before the next save, so the at-rest check takes
        the new values as legitimate. Local; a no-op without shard evidence."""
        if self.evidence.shard is not None:
            self.evidence.shard.resign()

    # ---- configuration -------------------------------------------------------------------------------------

    def _use_cpu_stager(self) -> None:
        """async_with_pinned_mem without an accelerator: TorchTitan's stager asks for pinned memory and a
        non-blocking copy, which assert "the current accelerator is available"; the parent builds its stager only
        when none is set, so set one with both off (shared memory and async staging kept). With an accelerator
        the parent's own stager is used unchanged."""
        if self.async_mode.value != "async_with_pinned_mem" or torch.accelerator.is_available():
            return
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=False
            )
        )

    def _policy(self) -> dict:
        """As the core Checkpointer's: consensus required; single-owner shards (no replica anywhere) may pass it as
        not applicable only when something vouches for their values: a vouching invariant (invariants.VOUCHES), or
        under pure FSDP the shard evidence (shard replay + at-rest), which is then required; replay is required
        where it runs (TitanEvidence.policy)."""
        require = ["bytes"] + (["invariants"] if self.checks else [])
        allow_na = []
        if self.consensus:
            require.append("consensus")
            if any(c.vouches for c in self.checks):
                allow_na.append("consensus")
        extra = self.evidence.policy(require, allow_na)
        return {
            "require": require,
            "allow_not_applicable": allow_na,
            "invariants": [c.spec for c in self.checks],
            "layout": "dcp",
            **extra,
        }

    def _warn_if_never_certifies(self) -> None:
        """A run whose policy can never be met says so at start-up (as the core Checkpointer does)."""
        p = self.scout_policy
        if (
            self.mode.startswith("fsdp")
            and "consensus" in p["require"]
            and "consensus" not in p["allow_not_applicable"]
            and self.is_coordinator
        ):
            log.logger.warning(
                "this configuration can never certify a checkpoint: the %s layout has single-owner shards, so "
                "consensus is not applicable, and nothing else vouches for them. Use a non-fused AdamW, Adam or SGD "
                '(TorchTitan\'s optimizer implementation="foreach") so that shard evidence runs, or configure an '
                "invariant that vouches, or consensus=False to accept bytes and invariants alone",
                self.mode,
            )

    def _versions(self) -> dict:
        import torchtitan

        return {
            "scout_ckpt": scout_ckpt.__version__,
            "torch": torch.__version__,
            "torchtitan": getattr(torchtitan, "__version__", "0.3"),
            "python": platform.python_version(),
        }

    # ---- save ----------------------------------------------------------------------------------------------

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Collective. Sync: returns after the commit (verdict in `last_verdict`). Async: after the dispatch; the
        commit runs when the upload has completed (next save, maybe_wait_for_saving or close)."""
        if not self.load_only:  # TorchTitan's Trainer calls save() after every optimizer step: the per-step hook
            self.evidence.on_step(curr_step)
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()  # commits the previous async save first
        self.evidence.before_save(curr_step)
        name = os.path.basename(self._create_checkpoint_id(curr_step))
        attempt = self.run.begin_save(curr_step, name)
        self.evidence.flush()
        model_only = last_step and self.last_save_model_only
        states = self.states["model"].state_dict() if model_only else self._flattened_model_states_sd()
        shard_live = self.evidence.live(curr_step)
        # consensus, invariants and the load signatures beside the parent's write (titan_live.py)
        beside = LiveEvidence(
            self, states, signatures=self.verify_load and not model_only, names_filter=_shared_state
        ).start()
        self._purging = False
        try:
            ok = CheckpointManager._save(self, curr_step, last_step)
        except BaseException:
            beside.wait()
            raise
        live = {**beside.result(), **shard_live}
        pending = (curr_step, attempt, name, live, model_only)
        if self.save_future is None:
            self._commit(*pending)
        else:
            self._pending = pending
        return ok

    def _signed(self, states: dict) -> tuple[dict, list[str]]:
        return signable(states, PER_RANK + tuple(self.exclude_from_loading))

    def _wait_for_saving(self) -> None:
        super()._wait_for_saving()  # the upload has completed on this rank
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._commit(*pending)

    def _close(self) -> None:
        if getattr(self, "save_future", None) is not None:
            self.maybe_wait_for_saving()
        super()._close()
        if getattr(self, "evidence", None) is not None:
            self.evidence.close()
        if getattr(self, "run", None) is not None:
            self.run.close(release=False)  # no barrier here: this close may not run on every rank together

    def _commit(self, step: int, attempt: str, name: str, live: dict, model_only: bool) -> None:
        """Collective: every rank's files are written (barrier), hash shares, the coordinator publishes and
        purges; every rank gets the same verdict."""
        self.run.barrier()
        step_dir = self.root / name
        files, listing = self.run.hash_share(step_dir, writer=dcp_writer)
        live = dict(live)
        signatures = live.pop("signatures", None)
        unsigned = live.pop("unsigned", [])
        verdict = self.run.commit(
            step,
            attempt,
            step_dir,
            files,
            listing,
            live,
            run_policy=self.scout_policy,
            topology=self.topology,
            versions=self._versions(),
            need_metadata=True,
            signatures=signatures,
            after=lambda v, ev: self._retention(),
            model_only=model_only,
            load_check_unsigned=unsigned[:64],
        )
        self.last_verdict = {"step": step, **verdict}

    # ---- retention -----------------------------------------------------------------------------------------

    def _purge_stale_checkpoints(self, *args, **kwargs) -> None:
        """The parent calls this right after writing (or, async, right after dispatching) a save: nothing is
        deleted then; retention runs in `_retention`, after the commit is recorded. (Any arguments: TorchTitan's
        later base class passes keywords, `is_save_in_flight=` or `saving_step=`.)"""

    def _is_valid_checkpoint(self, checkpoint_dir: str) -> bool:
        """TorchTitan main's hook (unused by 0.3): integrations.titan_next.is_valid_checkpoint."""
        return titan_next.is_valid_checkpoint(self.root, checkpoint_dir)

    def _is_resumable_checkpoint(self, checkpoint_dir: str) -> bool:
        """TorchTitan main's hook (unused by 0.3): integrations.titan_next.is_resumable_checkpoint."""
        return titan_next.is_resumable_checkpoint(self.root, checkpoint_dir)

    def _retention(self) -> None:
        """Coordinator, after a recorded commit: core retention with keep = keep_latest_k (0: keep all). Errors
        are recorded as events, never raised: the save itself has succeeded."""
        if self.keep_latest_k <= 0:
            return
        try:
            titan_next.apply_retention(
                self.ledger, self.root, self.keep_latest_k, also_keep=getattr(self, "purge_exempt", None)
            )
        except Exception as e:  # noqa: BLE001 -- see the docstring
            self.ledger.add_event("retention_error", run_id=self.run_id, detail={"error": repr(e)})

    # ---- load ----------------------------------------------------------------------------------------------

    def _find_load_step(self, folder: str = "", max_step: int | None = None) -> int:
        """What the parent's `_load(step=-1)` loads: the step `_load` chose (-1: a fresh start). With a
        `max_step` below it (TorchTitan main's signature), collective: the newest certified step <= max_step
        whose bytes verify (titan_next.find_load_step_collective)."""
        if max_step is None or self._chosen <= max_step:
            return self._chosen
        return titan_next.find_load_step_collective(self.root, max_step)

    def _candidate(self) -> dict | None:
        """Coordinator: the newest certified step whose bytes re-verify (core recovery.latest_clean, which
        rejects failures in the ledger and walks back) and the signatures its trusted manifest records."""
        from scout_ckpt.ops.recovery import trusted_manifest

        found = titan_next.newest_resumable(self.root)
        if found is None:
            return None
        row = self.ledger.checkpoint(found["step"])
        m, bad = trusted_manifest(self.root / row["path"], row)
        return {
            "step": found["step"],
            "attempt": row["attempt"],
            "skipped": found["skipped"],
            "signatures": (m or {}).get("signatures") or {} if not bad else {},
        }

    def _load(self, step: int = -1) -> bool:
        """Collective. step -1: load the newest certified step whose bytes and loaded values verify (walking back
        past failures in this same call); see the module docstring. `loaded` tells what happened."""
        if step != -1 or not os.path.isdir(self.folder):
            self._chosen = -1
            ok = super()._load(step)
            if ok and step > 0:  # an explicit step: the evidence's schedules start from it
                self.evidence.after_load(step)
            return ok
        skipped: list[dict] = []
        while True:
            cand = self.run.on_coordinator("choose a checkpoint to load", self._candidate)
            self._chosen = cand["step"] if cand else -1
            ok = super()._load(step=-1)
            if cand is None:
                self.loaded = {"step": None, "skipped": skipped}
                return ok
            skipped += [{"step": s, "code": "bytes"} for s in cand["skipped"]]
            differ = self._loaded_differences(cand["signatures"])
            if not differ:
                self.loaded = {"step": cand["step"], "skipped": skipped, "signatures": bool(cand["signatures"])}
                self.evidence.after_load(cand["step"])
                return ok
            skipped.append({"step": cand["step"], "code": "load_mismatch", "tensors": differ[:4]})
            self.run.on_coordinator(
                f"reject step {cand['step']}", lambda c=cand, d=differ: self._reject_load_mismatch(c, d)
            )

    def _loaded_differences(self, expected: dict) -> list[str]:
        """Collective: the saved values whose loaded signature differs from the one recorded at save (the same
        list on every rank: the signatures come from one all_reduce)."""
        if not self.verify_load or not expected:
            return []
        from scout_ckpt.consensus.full import full_signatures

        got = full_signatures(self._signed(self._flattened_model_states_sd())[0], group=self.run.pg, plain="replica")
        return sorted(k for k in expected if got.get(k) != expected[k])

    def _reject_load_mismatch(self, cand: dict, differ: list[str]) -> None:
        """Coordinator: the loaded values are not what was certified: rejected for good (compare-and-set from the
        certified attempt that was loaded), journaled, and a `load_mismatch` event."""
        reasons = [{"code": "load_mismatch", "tensors": differ[:16], "count": len(differ)}]
        applied = journal.record_transition(
            self.ledger,
            self.root,
            cand["step"],
            "rejected",
            reasons,
            source="load",
            expect="certified",
            attempt=cand["attempt"],
        )
        self.ledger.add_event(
            "load_mismatch",
            step=cand["step"],
            run_id=self.run_id,
            detail={"differ": differ[:16], "count": len(differ), "rejected": applied},
        )


@override(
    target=CheckpointManager.Config,
    exact=True,
    description="scout-ckpt: certified checkpoints (evidence per save, load the newest certified step)",
)
def scout_checkpoint(cfg: CheckpointManager.Config, **options) -> ScoutCheckpointManager.Config:
    """`--override.imports scout_ckpt.integrations.torchtitan.scout_checkpoint` (options as JSON:
    `'scout_ckpt.integrations.torchtitan.scout_checkpoint={"invariants": ["finite"]}'`): the run's checkpoint
    config, every field kept, managed by ScoutCheckpointManager.

    Args:
        cfg: the run's CheckpointManager.Config.
        options: scout-ckpt's fields of ScoutCheckpointManager.Config, by name.
    """
    return derive(cfg, ScoutCheckpointManager.Config, **options)
