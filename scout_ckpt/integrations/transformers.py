"""Certified checkpoints for the Hugging Face Trainer: `Trainer(callbacks=[ScoutTrainerCallback()])` and
`trainer.train(resume_from_checkpoint=latest_clean(output_dir))`.

The Trainer writes `output_dir/checkpoint-N/` itself (rank 0: model.safetensors, config.json, optimizer.pt,
scheduler.pt, trainer_state.json, training_args.bin; every rank: its rng_state_R.pth), then calls `on_save` on
every rank. One save boundary with this callback, all ranks (every method below is collective where it says so):

  1. on_step_end / on_epoch_end, when the Trainer has decided to save: the coordinator (rank 0) records the row
     `writing` for "checkpoint-N" (attempt id identical on every rank) and removes a stale folder of an abandoned
     attempt at the same step; a barrier keeps every rank from writing before that
  2. the Trainer writes the folder
  3. on_save: a barrier (every rank's rng_state file is on disk), then evidence on the live state: consensus of the
     model, optimizer, LR scheduler and global step across the data-parallel replicas (C3 over the DDP world), and
     the configured invariants (finite by default)
  4. the files are split over the ranks by size; each rank hashes its share; digests go to the coordinator
  5. coordinator: scout-manifest.json into the folder (temp + fsync + rename), the ledger commit with the
     verdict of the run's policy, then retention (the Trainer's save_total_limit, taken over: see below)
  6. the verdict is broadcast: every rank returns the same (an error on the coordinator is raised on all ranks)

A crash before 5 leaves a `writing` row; the next run's on_train_begin rejects it (`save_interrupted`) and removes
the partial folder, or records it from its manifest if only the ledger write was lost.

Retention: the Trainer deletes old folders (save_total_limit) *before* on_save, by age alone, so it can delete the
only certified folder. The callback takes it over: it sets `args.save_total_limit = None` when the Trainer starts
and, after each commit, deletes folders down to the same limit itself, never the newest certified one, nor one newer
that awaits evidence, nor a quarantined one, nor the Trainer's best-model folder.

Supported: one process, or DDP under torchrun (every rank holds the whole model). FSDP and DeepSpeed write
per-rank shards the callback does not compare; it refuses them rather than certify what it did not check.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

import scout_ckpt
from scout_ckpt import invariants as inv
from scout_ckpt import manifest, policy
from scout_ckpt.digests import digest_files
from scout_ckpt.errors import ScoutError
from scout_ckpt.integrations import folders
from scout_ckpt.layout import dir_bytes, remove_dir
from scout_ckpt.ledger import Ledger

log = logging.getLogger("scout_ckpt.transformers")
COORDINATOR = 0

__all__ = ["ScoutTrainerCallback", "latest_clean"]


def latest_clean(output_dir: str | os.PathLike, *, verify: bool = True) -> str | None:
    """The newest certified `checkpoint-N` under output_dir whose bytes still verify (re-hashed, walking back past
    any that fail, which are rejected in the ledger), as a path for `trainer.train(resume_from_checkpoint=...)`;
    None on a fresh run. Not collective: call it on every rank (each re-hashes) or on one and broadcast."""
    found = folders.latest_clean_row(output_dir, verify=verify)
    return found["path"] if found else None


class ScoutTrainerCallback(TrainerCallback):
    """Records, checks and certifies every `checkpoint-N` the Trainer saves, in `output_dir/scout-ledger.db`.

    invariants  invariant specs run on the live model and optimizer state at each save (default ["finite"])
    consensus   compare the live state across the data-parallel replicas (default True; needs >= 2 ranks)
    stop_on_reject  stop training (control.should_training_stop) when a checkpoint is rejected
    timeout_s   timeout of the callback's own gloo groups (a dead peer fails the save instead of hanging)
    """

    def __init__(self, *, invariants: list | None = None, consensus: bool = True, stop_on_reject: bool = False,
                 timeout_s: float = 600.0):
        specs = ["finite"] if invariants is None else list(invariants)
        self.checks = inv.parse_specs(specs)  # a bad spec fails here, not at the first save
        self.specs = [c.spec for c in self.checks]
        self.consensus, self.stop_on_reject, self.timeout_s = consensus, stop_on_reject, timeout_s
        self.limit: int | None = None
        self.last_verdict: dict | None = None
        self._ready = False
        self._saves = 0
        self._attempts: dict[int, str] = {}
        self.is_coordinator = False
        self.ledger: Ledger | None = None

    # ---- set-up ---------------------------------------------------------------------------------------------

    def _take_over_retention(self, args) -> None:
        if args.save_total_limit is not None and args.save_total_limit > 0:
            self.limit = int(args.save_total_limit)
            args.save_total_limit = None  # the Trainer would delete by age, before on_save: see the module doc

    @staticmethod
    def _refuse_sharded(args) -> None:
        if getattr(args, "fsdp", None) or getattr(args, "deepspeed", None):
            raise ScoutError("ScoutTrainerCallback supports one process or DDP; with FSDP or DeepSpeed each rank "
                             "writes its own shard, which the callback does not compare (remove the callback or "
                             "the sharding option)")

    def on_init_end(self, args, state, control, **kwargs):
        self._refuse_sharded(args)
        self._take_over_retention(args)

    def on_train_begin(self, args, state, control, **kwargs):
        """All ranks: side groups (collective, same order everywhere), settle what a crash left, begin the run."""
        self._refuse_sharded(args)
        self._take_over_retention(args)
        if self._ready:
            return
        self.root = Path(args.output_dir)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.is_coordinator = self.rank == COORDINATOR
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self._pg = dist.new_group(backend="gloo", timeout=timeout) if self.distributed else None
        self.groups = None
        if self.consensus and self.world > 1:
            from scout_ckpt.consensus.groups import ConsensusGroups

            self.groups = ConsensusGroups.create("ddp", self.world, timeout_s=self.timeout_s)
        self.policy = folders.run_policy(self.world if self.groups else 1, self.specs)
        self.topology = {"mode": "ddp" if self.world > 1 else "single", "world_size": self.world,
                         "framework": "transformers", "layout": folders.LAYOUT,
                         "replica_groups": self.groups.groups if self.groups else None}
        self.ledger: Ledger | None = None
        run_id = error = None
        if self.is_coordinator:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self.ledger = Ledger.open(self.root, create=True)
                settled = folders.settle_writing(self.ledger, self.root)
                for s in settled:
                    log.warning("scout-ckpt: %s of an interrupted save settled: %s", folders.folder_name(s["step"]),
                                s["state"])
                run_id = f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
                self.ledger.begin_run(run_id, world_size=self.world, topology=self.topology, policy=self.policy,
                                      versions=self._versions(), resumed_from=state.global_step or None)
                self._check_resume(state.global_step, run_id)
            except Exception as e:  # every rank must still reach the broadcast below
                error = f"{type(e).__name__}: {e}"
        run_id, error = self._bcast((run_id, error))
        if error:
            raise ScoutError(f"scout-ckpt could not open the ledger in {self.root}: {error}")
        self.run_id = run_id
        self._ready = True

    def _check_resume(self, step: int, run_id: str) -> None:
        """Coordinator: a run resumed (resume_from_checkpoint=True takes the newest folder, certified or not) from
        a folder scout-ckpt has not certified is told so, in the log and as a ledger event."""
        if not step:
            return
        row = self.ledger.checkpoint(step)
        if row is not None and row["state"] == "certified":
            return
        state = row["state"] if row else "unknown to the ledger"
        self.ledger.add_event("uncertified_resume", step=step, run_id=run_id, detail={"state": state})
        log.warning("scout-ckpt: this run resumed from %s, which is %s; resume with "
                    "trainer.train(resume_from_checkpoint=latest_clean(output_dir)) instead of True",
                    folders.folder_name(step), state)

    def _versions(self) -> dict:
        import transformers

        return {"scout_ckpt": scout_ckpt.__version__, "torch": torch.__version__,
                "transformers": transformers.__version__, "python": platform.python_version()}

    # ---- small collectives on the callback's own gloo group ------------------------------------------------

    def _bcast(self, obj):
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=COORDINATOR, group=self._pg)
        return box[0]

    def _gather(self, obj) -> list | None:
        if not self.distributed:
            return [obj]
        out = [None] * self.world if self.is_coordinator else None
        dist.gather_object(obj, out, dst=COORDINATOR, group=self._pg)
        return out

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self._pg)

    # ---- the save boundary ---------------------------------------------------------------------------------

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._begin(state.global_step, before_write=True)

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._begin(state.global_step, before_write=True)

    def _begin(self, step: int, *, before_write: bool) -> None:
        """Collective: the `writing` row before the Trainer writes (an interrupted save always leaves its record)."""
        if step in self._attempts or not self._ready:
            return
        self._saves += 1
        attempt = f"{self.run_id.rsplit('-', 1)[-1]}-{self._saves}"
        self._attempts[step] = attempt
        error = None
        if self.is_coordinator:
            try:
                folders.record_writing(self.ledger, step, self.run_id, attempt, folders.folder_name(step))
                stale = self.root / folders.folder_name(step)
                if before_write and stale.is_dir():  # an abandoned attempt's folder: never mix its files in
                    remove_dir(stale)
            except Exception as e:  # every rank must still reach the broadcast below
                error = f"{type(e).__name__}: {e}"
        error = self._bcast(error)
        if error:
            raise ScoutError(f"scout-ckpt could not begin the save of step {step}: {error}")

    def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if not self._ready:
            return control
        step = state.global_step
        self._begin(step, before_write=False)  # save_strategy "best": decided after on_step_end
        attempt = self._attempts.pop(step)
        self._barrier()  # every rank's files (rng_state_R.pth) are written before anyone lists or hashes
        live = self._live_evidence(state, model, optimizer, lr_scheduler)
        files = self._hash_share(step)
        verdict = None
        if self.is_coordinator:
            try:
                verdict = self._publish(step, attempt, files, live, state)
            except Exception as e:  # every rank must still reach the broadcast below
                verdict = {"state": "error", "reasons": [{"code": "commit_failed", "detail": repr(e)}]}
        verdict = self._bcast(verdict)
        if verdict["state"] == "error":
            raise ScoutError(f"scout-ckpt: checkpoint-{step} failed to commit: {verdict['reasons'][0]['detail']}")
        self.last_verdict = {"step": step, **verdict}
        if self.is_coordinator:
            from scout_ckpt.views import reason_text

            log.warning("scout-ckpt: checkpoint-%d %s%s", step, verdict["state"],
                        f" ({reason_text(verdict['reasons'])})" if verdict["reasons"] else "")
        if verdict["state"] == "rejected" and self.stop_on_reject:
            control.should_training_stop = True
        return control

    def _live_evidence(self, state, model, optimizer, lr_scheduler) -> dict:
        """Collective: consensus and invariants on the state in memory (identical evidence on every rank)."""
        live_state = {"model": model.state_dict() if model is not None else {},
                      "optimizer": optimizer.state_dict() if optimizer is not None else {},
                      "scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else {},
                      "trainer": {"global_step": state.global_step}}
        ev = {}
        if self.groups is not None:
            from scout_ckpt.consensus.save_time import save_time_consensus

            ev["consensus"] = save_time_consensus(live_state, self.groups)
        if self.checks:
            from scout_ckpt.consensus.signatures import flatten_state

            flat = {k: v for k, v in flatten_state({"model": live_state["model"],
                                                    "optimizer": live_state["optimizer"]}).items()
                    if isinstance(v, torch.Tensor)}
            ev["invariants"] = inv.run_local(self.checks, flat, group=self._pg if self.distributed else False)
        return ev

    def _hash_share(self, step: int) -> list[dict]:
        """Collective: the coordinator lists the folder; each rank hashes its share (by size); what a rank cannot
        see (no shared filesystem) comes back unhashed and the coordinator hashes it."""
        step_dir = self.root / folders.folder_name(step)
        listing = self._bcast(folders.listing(step_dir) if self.is_coordinator else None)
        mine = folders.assign_shares(listing, self.world)[self.rank]
        visible = [p for p in mine if (step_dir / p).is_file()]
        got = digest_files([step_dir / p for p in visible])
        rows = [{"path": p, "size": got[str(step_dir / p)][0], "digest": got[str(step_dir / p)][1],
                 "rank": self.rank} for p in visible]
        gathered = self._gather({"files": rows, "unseen": sorted(set(mine) - set(visible))})
        if not self.is_coordinator:
            return []
        files = [f for g in gathered for f in g["files"]]
        unseen = [p for g in gathered for p in g["unseen"]]
        if unseen:
            got = digest_files([step_dir / p for p in unseen if (step_dir / p).is_file()])
            files += [{"path": p, "size": got[k][0], "digest": got[k][1], "rank": self.rank}
                      for p in unseen if (k := str(step_dir / p)) in got]
        return sorted(files, key=lambda f: f["path"])

    def _publish(self, step: int, attempt: str, files: list[dict], live: dict, state) -> dict:
        """Coordinator: evidence -> verdict -> manifest (fsync) -> ledger -> retention."""
        step_dir = self.root / folders.folder_name(step)
        hashed = {f["path"] for f in files}
        missing = [{"code": "missing_file", "file": p} for p, _ in folders.listing(step_dir) if p not in hashed]
        ev = {"bytes": policy.evidence(policy.FAIL if missing or not files else policy.PASS,
                                       missing or ([] if files else [{"code": "no_files_recorded"}]),
                                       files=len(files), bytes=sum(f["size"] for f in files), hashed_by="ranks",
                                       ranks=sorted({f["rank"] for f in files}))}
        ev.update(live)
        v = policy.evaluate(self.policy, ev)
        verdict = {"state": v.state, "reasons": v.reasons}
        m = manifest.build(step=step, run_id=self.run_id, attempt=attempt, world_size=self.world,
                           topology=self.topology, policy=self.policy, files=files, evidence=ev, verdict=verdict,
                           invariants=self.specs, versions=self._versions(), layout=folders.LAYOUT)
        digest = manifest.write(step_dir, m)
        applied = self.ledger.record_commit(step, run_id=self.run_id, path=step_dir.name,
                                            nbytes=dir_bytes(step_dir), manifest_digest=digest, files=files,
                                            evidence=ev, state=v.state, reasons=v.reasons, attempt=attempt)
        if applied is False:  # the row changed meanwhile (compare-and-set): what the ledger holds stands
            row = self.ledger.checkpoint(step)
            return {"state": row["state"], "reasons": row["reasons"]}
        folders.journal_commit(self.root, step, attempt, digest, v.state, v.reasons, "save")
        for kind in ("consensus", "invariants"):
            for r in (ev.get(kind) or {}).get("reasons") or []:
                if r.get("code") in ("consensus_attributed", "consensus_inconclusive", "invariant_failed"):
                    self.ledger.add_event("sdc", step=step, ranks=r.get("ranks") or [], run_id=self.run_id,
                                          detail={"source": kind, **{k: x for k, x in r.items() if k != "ranks"}})
        if self.limit:
            best = folders.parse_folder(Path(state.best_model_checkpoint).name) if state.best_model_checkpoint \
                else None
            folders.apply_retention(self.ledger, self.root, self.limit, also_keep={best} if best else set())
        return verdict

    def on_train_end(self, args, state, control, **kwargs):
        if self.is_coordinator and self.ledger is not None:
            self.ledger.close()
            self.ledger = None
        self._ready = False
