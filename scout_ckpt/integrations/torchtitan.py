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

  _save              the coordinator records `writing` first (and removes the folder of an abandoned attempt at the
                     same step); every rank takes the live evidence (consensus over the replicas when the model is
                     replicated, plain state across the world when it is FSDP-sharded, the configured invariants);
                     then the parent writes; sync: commit at once; async: commit when the upload has completed
  _wait_for_saving   the parent waits for the upload; then the pending commit runs (all ranks)
  _close             flushes a pending async commit first (the parent does not await save_future)
  commit             barrier; the files are split over the ranks by size, each hashes its share; the coordinator
                     writes scout-manifest.json into step-N, records the verdict, then purges
  _find_load_step    the newest *certified* step whose bytes re-verify (walking back, rejecting failures), decided
                     on the coordinator and broadcast; -1 when there is none (a fresh start, fail closed)
  _purge_stale_checkpoints  keep_latest_k checkpoints, never the newest certified nor a newer one awaiting evidence,
                     rejected ones first; runs after the commit, never right after an async dispatch

Not covered yet: `async_with_pinned_mem` (refused), load-time signature verification (bytes only), replay.
"""

from __future__ import annotations

import datetime
import os
import platform
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.config.override import derive, override

import scout_ckpt
from scout_ckpt import invariants as inv
from scout_ckpt import layout, manifest, policy
from scout_ckpt.digests import digest_files
from scout_ckpt.errors import NotFound, ScoutError
from scout_ckpt.integrations import folders
from scout_ckpt.ledger import Ledger
from scout_ckpt.verify import verify_files

COORDINATOR = 0

__all__ = ["ScoutCheckpointManager", "scout_checkpoint"]


def _verify_dcp(step_dir: Path, files: list[dict]) -> dict:
    return verify_files(step_dir, files)


class ScoutCheckpointManager(CheckpointManager):
    """TorchTitan's DCP checkpoint manager with scout-ckpt's evidence, verdicts and latest-clean loading."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        invariants: list = field(default_factory=lambda: ["finite"])
        """Invariant specs checked on the live state at every save (scout_ckpt.invariants)."""

        consensus: bool = True
        """Compare the live state across replicas (and the plain state across all ranks when sharded)."""

        scout_timeout_s: float = 600.0
        """Timeout of scout-ckpt's own gloo groups: a dead peer fails the save instead of hanging it."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.async_mode == "async_with_pinned_mem":
                raise ValueError("ScoutCheckpointManager supports async_mode 'disabled' and 'async'")
            inv.parse_specs(self.invariants)

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.checks = inv.parse_specs(config.invariants)
        self.root = Path(self.folder)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_coordinator = self.rank == COORDINATOR
        timeout = datetime.timedelta(seconds=config.scout_timeout_s)
        self._spg = dist.new_group(backend="gloo", timeout=timeout)
        self.mode = self._infer_mode()
        self.groups = None
        if config.consensus and self.world > 1:
            from scout_ckpt.consensus.groups import ConsensusGroups

            self.groups = ConsensusGroups.create(self.mode, self.world, timeout_s=config.scout_timeout_s)
        self.scout_policy = self._policy()
        self.topology = {"mode": self.mode, "world_size": self.world, "framework": "torchtitan",
                         "replica_groups": self.groups.groups if self.groups else None}
        self._pending: tuple | None = None
        self._saves = 0
        self.last_verdict: dict | None = None
        self.ledger: Ledger | None = None
        run_id = error = None
        if self.is_coordinator:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self.ledger = Ledger.open(self.root, create=True)
                folders.settle_writing(self.ledger, self.root, parse=layout.parse_step_dir, verify=_verify_dcp)
                run_id = f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
                self.ledger.begin_run(run_id, world_size=self.world, topology=self.topology, policy=self.scout_policy,
                                      versions=self._versions())
            except Exception as e:  # every rank must still reach the broadcast below
                error = f"{type(e).__name__}: {e}"
        self.run_id, error = self._bcast((run_id, error))
        if error:
            raise ScoutError(f"scout-ckpt could not open the ledger in {self.root}: {error}")

    # ---- configuration -------------------------------------------------------------------------------------

    def _infer_mode(self) -> str:
        from torch.distributed.tensor import DTensor

        params = [p for m in self.states["model"].model for p in m.parameters()]
        return "fsdp" if any(isinstance(p, DTensor) for p in params) else "ddp"

    def _policy(self) -> dict:
        """As the core Checkpointer's: consensus required; a sharded model (no replicas) may pass it as not
        applicable only when model-intrinsic checks beyond `finite` vouch for the single-owner shards."""
        require = ["bytes"] + (["invariants"] if self.checks else [])
        allow_na = []
        if self.groups is not None:
            require.append("consensus")
            if any(c.kind != "finite" for c in self.checks):
                allow_na.append("consensus")
        return {"require": require, "allow_not_applicable": allow_na, "invariants": [c.spec for c in self.checks],
                "layout": "dcp", "replay_targets": []}

    def _versions(self) -> dict:
        import torchtitan

        return {"scout_ckpt": scout_ckpt.__version__, "torch": torch.__version__,
                "torchtitan": getattr(torchtitan, "__version__", "0.3"), "python": platform.python_version()}

    # ---- collectives on the manager's own gloo group -------------------------------------------------------

    def _bcast(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=COORDINATOR, group=self._spg)
        return box[0]

    def _gather(self, obj) -> list | None:
        out = [None] * self.world if self.is_coordinator else None
        dist.gather_object(obj, out, dst=COORDINATOR, group=self._spg)
        return out

    # ---- save ----------------------------------------------------------------------------------------------

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Collective. Sync: returns after the commit (verdict in `last_verdict`). Async: after the dispatch; the
        commit runs when the upload has completed (next save, maybe_wait_for_saving or close)."""
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()  # commits the previous async save first
        self._saves += 1
        attempt = f"{self.run_id.rsplit('-', 1)[-1]}-{self._saves}"
        name = os.path.basename(self._create_checkpoint_id(curr_step))
        error = None
        if self.is_coordinator:
            try:
                folders.record_writing(self.ledger, curr_step, self.run_id, attempt, name)
                stale = self.root / name
                if stale.is_dir():  # an abandoned attempt (a walk-back past it): never mix its files in
                    layout.remove_dir(stale)
            except Exception as e:  # every rank must still reach the broadcast below
                error = f"{type(e).__name__}: {e}"
        error = self._bcast(error)
        if error:
            raise ScoutError(f"scout-ckpt could not begin the save of step {curr_step}: {error}")
        live = self._live_evidence()
        self._purging = False
        ok = CheckpointManager._save(self, curr_step, last_step)
        pending = (curr_step, attempt, name, live)
        if self.save_future is None:
            self._commit(*pending)
        else:
            self._pending = pending
        return ok

    def _live_evidence(self) -> dict:
        """Collective: consensus and invariants on the state being saved (identical evidence on every rank)."""
        states = self._flattened_model_states_sd()
        ev = {}
        if self.groups is not None:
            from scout_ckpt.consensus.save_time import save_time_consensus

            # the dataloader's state is per rank by design (TorchTitan keys it by dp rank)
            ev["consensus"] = save_time_consensus(states, self.groups,
                                                  names_filter=lambda n: not n.startswith("dataloader"))
        if self.checks:
            flat = {k: v for k, v in inv.flatten(states).items() if isinstance(v, torch.Tensor)}
            ev["invariants"] = inv.run_local(self.checks, flat, group=self._spg)
        return ev

    def _wait_for_saving(self) -> None:
        super()._wait_for_saving()  # the upload has completed on this rank
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._commit(*pending)

    def _close(self) -> None:
        if getattr(self, "save_future", None) is not None:
            self.maybe_wait_for_saving()
        super()._close()
        if getattr(self, "ledger", None) is not None:
            self.ledger.close()
            self.ledger = None

    def _commit(self, step: int, attempt: str, name: str, live: dict) -> None:
        """Collective: hash shares, then the coordinator publishes; every rank gets the same verdict."""
        dist.barrier(group=self._spg)  # every rank's files are written
        step_dir = self.root / name
        listing = self._bcast(folders.listing(step_dir) if self.is_coordinator else None)
        mine = folders.assign_shares(listing, self.world)[self.rank]
        got = digest_files([step_dir / p for p in mine if (step_dir / p).is_file()])
        rows = [{"path": p, "size": got[str(step_dir / p)][0], "digest": got[str(step_dir / p)][1], "rank": self.rank}
                for p in mine if str(step_dir / p) in got]
        gathered = self._gather(rows)
        verdict = None
        if self.is_coordinator:
            try:
                verdict = self._publish(step, attempt, step_dir, [f for g in gathered for f in g], listing, live)
            except Exception as e:  # every rank must still reach the broadcast below
                verdict = {"state": "error", "reasons": [{"code": "commit_failed", "detail": repr(e)}]}
        verdict = self._bcast(verdict)
        if verdict["state"] == "error":
            raise ScoutError(f"scout-ckpt: step {step} failed to commit: {verdict['reasons'][0]['detail']}")
        self.last_verdict = {"step": step, **verdict}

    def _publish(self, step: int, attempt: str, step_dir: Path, files: list[dict], listing, live: dict) -> dict:
        hashed = {f["path"] for f in files}
        reasons = [{"code": "missing_file", "file": p} for p, _ in listing if p not in hashed]
        if layout.DCP_METADATA not in hashed:
            reasons.append({"code": "missing_file", "file": layout.DCP_METADATA})
        files = sorted(files, key=lambda f: f["path"])
        ev = {"bytes": policy.evidence(policy.FAIL if reasons else policy.PASS, reasons, files=len(files),
                                       bytes=sum(f["size"] for f in files), hashed_by="ranks"), **live}
        v = policy.evaluate(self.scout_policy, ev)
        verdict = {"state": v.state, "reasons": v.reasons}
        m = manifest.build(step=step, run_id=self.run_id, attempt=attempt, world_size=self.world,
                           topology=self.topology, policy=self.scout_policy, files=files, evidence=ev,
                           verdict=verdict, invariants=self.scout_policy["invariants"], versions=self._versions())
        digest = manifest.write(step_dir, m)
        applied = self.ledger.record_commit(step, run_id=self.run_id, path=step_dir.name,
                                            nbytes=layout.dir_bytes(step_dir), manifest_digest=digest, files=files,
                                            evidence=ev, state=v.state, reasons=v.reasons, attempt=attempt)
        if applied is False:  # the row changed meanwhile (compare-and-set): what the ledger holds stands
            row = self.ledger.checkpoint(step)
            return {"state": row["state"], "reasons": row["reasons"]}
        folders.journal_commit(self.root, step, attempt, digest, v.state, v.reasons, "save")
        self._purging = True
        self._purge_stale_checkpoints()
        return verdict

    # ---- retention -----------------------------------------------------------------------------------------

    def _purge_stale_checkpoints(self) -> None:
        """Coordinator, after a durable commit only (the parent calls this right after dispatching a save: then it
        does nothing)."""
        if not getattr(self, "_purging", False) or self.keep_latest_k <= 0 or not self.is_coordinator:
            return
        self._purging = False
        folders.apply_retention(self.ledger, self.root, self.keep_latest_k, dirs=layout.list_step_dirs(self.root))

    # ---- load ----------------------------------------------------------------------------------------------

    def _find_load_step(self, folder: str = "") -> int:
        """Collective (called by the parent's load on every rank): the newest certified step whose bytes re-verify,
        or -1. The coordinator decides (rejecting in the ledger any that fail) and broadcasts."""
        step = None
        if self.is_coordinator:
            from scout_ckpt.recovery import latest_clean

            try:
                step = latest_clean(Path(folder or self.folder))["step"]
            except NotFound:
                step = -1
            except Exception as e:  # every rank must still reach the broadcast below
                step = f"{type(e).__name__}: {e}"
        step = self._bcast(step)
        if isinstance(step, str):
            raise ScoutError(f"scout-ckpt could not choose a checkpoint to load: {step}")
        return step


@override(target=CheckpointManager.Config, exact=True,
          description="scout-ckpt: certified checkpoints (evidence per save, load the newest certified step)")
def scout_checkpoint(cfg: CheckpointManager.Config, **options) -> ScoutCheckpointManager.Config:
    """`--override.imports scout_ckpt.integrations.torchtitan.scout_checkpoint` (options as JSON:
    `'scout_ckpt.integrations.torchtitan.scout_checkpoint={"invariants": ["finite"]}'`): the run's checkpoint
    config, every field kept, managed by ScoutCheckpointManager."""
    return derive(cfg, ScoutCheckpointManager.Config, **options)
