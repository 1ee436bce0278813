"""Certified checkpoints for the Hugging Face Trainer: `Trainer(callbacks=[ScoutTrainerCallback()])` and
`trainer.train(resume_from_checkpoint=latest_clean(output_dir))`.

The Trainer writes `output_dir/checkpoint-N/` itself (rank 0: model.safetensors, config.json, optimizer.pt,
scheduler.pt, trainer_state.json, training_args.bin; every rank: its rng_state_R.pth), then calls `on_save` on
every rank. One save boundary with this callback, all ranks (every method below is collective where it says so):

  1. on_step_end / on_epoch_end, when the Trainer has decided to save: the coordinator (rank 0) records the row
     `writing` for "checkpoint-N" (attempt id identical on every rank) and removes a stale folder of an abandoned
     attempt at the same step; a barrier keeps every rank from writing before that
  2. the Trainer writes the folder
  3. on_save: a barrier (every rank's rng_state file is on disk), then evidence on the live state: the replay
     sweep (every block, the embeddings, the head and the optimizer's update replayed on every replica with the
     save step's captured inputs; on by default with 2+ ranks, captured from on_step_end), consensus of the
     model, optimizer, LR scheduler and global step across the data-parallel replicas (C3 over the DDP world), and
     the configured invariants (finite by default)
  4. the files are split over the ranks by size; each rank hashes its share; digests go to the coordinator
  5. coordinator: scout-manifest.json into the folder (temp + fsync + rename), the ledger commit with the
     verdict of the run's policy, then retention (the Trainer's save_total_limit, taken over: see below)
  6. the verdict is broadcast: every rank returns the same (an error on the coordinator is raised on all ranks)

A crash before 5 leaves a `writing` row; the next run's on_train_begin settles it with the core's settle (owner
provably dead): rejected (`save_interrupted`) and the partial folder removed, or recorded from its manifest if only
the ledger write was lost. The save machinery (start-up, writing row, shared hashing, manifest, commit) is
`integrations.session.IntegrationRun`, the same as TorchTitan's manager's.

Retention: the Trainer deletes old folders (save_total_limit) *before* on_save, by age alone, so it can delete the
only certified folder. The callback takes it over: it sets `args.save_total_limit = None` when the Trainer starts
and, after each commit, applies the core retention rule with keep = the same limit (`retention.decide`: the
limit's newest certified folders, never the newest certified one, nor one newer that awaits evidence, nor a
quarantined one; rejected ones go first), and never the Trainer's best-model folder.

The core's out-of-band observer (hangs, desyncs, crashes, stragglers) runs on by default, watching the DDP wrapper
the Trainer trains (the callbacks receive the bare model: integrations.wrappers finds the wrapper).

Supported: one process, or DDP under torchrun (every rank holds the whole model). FSDP and DeepSpeed write
per-rank shards the callback does not compare; it refuses them rather than certify what it did not check.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

import scout_ckpt
from scout_ckpt import invariants as inv
from scout_ckpt.errors import ScoutError
from scout_ckpt.integrations import folders
from scout_ckpt.integrations.session import IntegrationRun
from scout_ckpt.options import ObserverOptions, ReplayOptions

log = logging.getLogger("scout_ckpt.transformers")

__all__ = ["ScoutTrainerCallback", "latest_clean"]


def latest_clean(output_dir: str | os.PathLike, *, verify: bool = True) -> str | None:
    """The newest certified `checkpoint-N` under output_dir whose bytes still verify (re-hashed, walking back past
    any that fail, which are rejected in the ledger), as a path for `trainer.train(resume_from_checkpoint=...)`;
    None on a fresh run. Not collective: call it on every rank (each re-hashes) or on one and broadcast.

    Args:
        output_dir: the Trainer's output_dir or the Lightning ROOT.
        verify: re-hash the candidate's bytes (False: trust the ledger).
    """
    found = folders.latest_clean_row(output_dir, verify=verify)
    return found["path"] if found else None


class ScoutTrainerCallback(TrainerCallback):
    """Records, checks and certifies every `checkpoint-N` the Trainer saves, in `output_dir/scout-ledger.db`.

    Args:
        invariants: invariant specs run on the live model and optimizer state at each save (default ["finite"])
        consensus: compare the live state across the data-parallel replicas (default True; needs >= 2 ranks)
        replay: SDC replay of the model's blocks and the optimizer's update across the replicas, as the core's
            `replay=`: True (default: on with 2 or more ranks), a ReplayOptions (asked for: refused where it cannot
            run), False
        observer: the out-of-band hang/straggler/crash observer, as the core's `observer=`: True (default), an
            ObserverOptions, False
        stop_on_reject: stop training (control.should_training_stop) when a checkpoint is rejected
        timeout_s: timeout of the callback's own gloo groups (a dead peer fails the save instead of hanging)
    """

    def __init__(
        self,
        *,
        invariants: list | None = None,
        consensus: bool = True,
        stop_on_reject: bool = False,
        timeout_s: float = 600.0,
        replay: ReplayOptions | bool = True,
        observer: ObserverOptions | bool = True,
    ):
        from scout_ckpt import options

        options.check_group("replay", replay)
        options.check_group("observer", observer)
        specs = ["finite"] if invariants is None else list(invariants)
        self.checks = inv.parse_specs(specs)  # a bad spec fails here, not at the first save
        self.specs = [c.spec for c in self.checks]
        self.consensus, self.stop_on_reject, self.timeout_s = consensus, stop_on_reject, timeout_s
        self.replay_option, self.observer_option = options.as_replay(replay), options.as_observer(observer)
        self.replay = None
        self.observer = None
        self.observer_attached: str | None = None  # what the observer found to watch ("counted": DDP's wrapper)
        self._step_started: float | None = None
        self.limit: int | None = None
        self.last_verdict: dict | None = None
        self.run: IntegrationRun | None = None
        self._attempts: dict[int, str] = {}

    @property
    def is_coordinator(self) -> bool:
        return self.run is not None and self.run.is_coordinator

    @property
    def ledger(self):
        return self.run.ledger if self.run is not None else None

    # ---- set-up ---------------------------------------------------------------------------------------------

    def _take_over_retention(self, args) -> None:
        if args.save_total_limit is not None and args.save_total_limit > 0:
            self.limit = int(args.save_total_limit)
            args.save_total_limit = None  # the Trainer would delete by age, before on_save: see the module doc

    @staticmethod
    def _refuse_sharded(args) -> None:
        if getattr(args, "fsdp", None) or getattr(args, "deepspeed", None):
            raise ScoutError(
                "ScoutTrainerCallback supports one process or DDP; with FSDP or DeepSpeed each rank "
                "writes its own shard, which the callback does not compare (remove the callback or "
                "the sharding option)"
            )

    def on_init_end(self, args, state, control, **kwargs):
        self._refuse_sharded(args)
        self._take_over_retention(args)

    def on_train_begin(self, args, state, control, **kwargs):
        """All ranks: side groups (collective, same order everywhere), settle what a crash left, begin the run."""
        self._refuse_sharded(args)
        self._take_over_retention(args)
        if self.run is not None:
            return
        run = IntegrationRun(args.output_dir, framework="transformers", timeout_s=self.timeout_s)
        self.groups = None
        if self.consensus and run.world > 1:
            from scout_ckpt.consensus.groups import ConsensusGroups
            from scout_ckpt.consensus.mesh import legacy_topology

            self.groups = ConsensusGroups.from_topology(legacy_topology("ddp", run.world), timeout_s=self.timeout_s)
        self._start_replay(args, kwargs.get("model"), kwargs.get("optimizer"))
        self.policy = folders.run_policy(run.world if self.groups else 1, self.specs)
        if self.replay is not None:  # required where it runs; not_applicable only without on_step_end calls
            self.policy["require"].append("replay")
            self.policy["allow_not_applicable"].append("replay")
            self.policy["replay_targets"] = [list(t) for t in self.replay.targets()]
        self.topology = {
            "mode": "ddp" if run.world > 1 else "single",
            "world_size": run.world,
            "framework": "transformers",
            "layout": folders.LAYOUT,
            "replica_groups": self.groups.groups if self.groups else None,
        }
        run.start(
            topology=self.topology,
            policy=self.policy,
            versions=self._versions(),
            resumed_from=state.global_step or None,
            after=lambda ledger, run_id: self._check_resume(ledger, state.global_step, run_id),
        )
        for s in run.settled:
            if s["after"] != "writing":
                log.warning(
                    "scout-ckpt: step %d of an interrupted save settled: %s (%s)", s["step"], s["after"], s["why"]
                )
        self.run = run
        run.bind_replay(self.replay, self.policy)
        if self.replay is not None:
            self.replay.begin(state.global_step or 0)
        self._start_observer(run, kwargs.get("model"), kwargs.get("optimizer"))

    def _start_replay(self, args, model, optimizer) -> None:
        """Every rank: the core's replay (save/evidence/replay.py) on the Trainer's model and optimizer, on by
        default where replicas exist (a rank computing wrongly is averaged into every replica, which consensus
        then sees agree); the sweep is armed for the Trainer's save steps."""
        from scout_ckpt.save.evidence.replay import ReplayEvidence

        self.replay = None
        if self.groups is None:
            if self.replay_option:
                raise ScoutError("replay was asked for (ReplayOptions) but needs 2 or more ranks and consensus=True")
            return
        self.replay = ReplayEvidence.start(
            self.replay_option, model=model, optimizer=optimizer, groups=self.groups, auto_on=True
        )
        steps = getattr(args, "save_steps", None)
        if (
            self.replay is not None
            and str(getattr(args, "save_strategy", "")).endswith("steps")
            and isinstance(steps, int)
            and steps >= 1
            and self.replay.runner.save_every is None
        ):
            self.replay.runner.save_every = steps

    def _start_observer(self, run: IntegrationRun, model, optimizer) -> None:
        """Every rank: the core's out-of-band observer (hangs, desyncs, crashes, stragglers), watching the DDP
        module the Trainer trains (its wrapper, found from the bare model the callbacks receive)."""
        from scout_ckpt.integrations.wrappers import ddp_wrapper_of
        from scout_ckpt.observer import Observer

        if not self.observer_option or not run.distributed:
            return
        ignore = (
            [run.pg]
            + (self.groups.process_groups if self.groups is not None else [])
            + (self.replay.process_groups if self.replay is not None else [])
        )
        self.observer = Observer.start(
            run.root,
            rank=run.rank,
            world_size=run.world,
            run_id=run.run_id,
            ignore_groups=ignore,
            **self.observer_option.start_kwargs(),
        )
        if model is not None:
            self.observer_attached = self.observer.attach(ddp_wrapper_of(model) or model, optimizer)

    def _check_resume(self, ledger, step: int, run_id: str) -> None:
        """Coordinator: a run resumed (resume_from_checkpoint=True takes the newest folder, certified or not) from
        a folder scout-ckpt has not certified is told so, in the log and as a ledger event."""
        if not step:
            return
        row = ledger.checkpoint(step)
        if row is not None and row["state"] == "certified":
            return
        state = row["state"] if row else "unknown to the ledger"
        ledger.add_event("uncertified_resume", step=step, run_id=run_id, detail={"state": state})
        log.warning(
            "scout-ckpt: this run resumed from %s, which is %s (resume_from_checkpoint=True takes the "
            "newest folder, certified or not); switch to `from scout_ckpt.integrations.transformers import "
            "latest_clean` and trainer.train(resume_from_checkpoint=latest_clean(args.output_dir)), or pass "
            "the folder `scout-ckpt resume %s --latest-clean` prints",
            folders.folder_name(step),
            state,
            Path(ledger.path).parent,
        )

    def _versions(self) -> dict:
        import transformers

        return {
            "scout_ckpt": scout_ckpt.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        }

    # ---- the save boundary ---------------------------------------------------------------------------------

    def on_step_end(self, args, state, control, **kwargs):
        """Every rank, after each optimizer step: the observer's heartbeat, the replay schedule (collective on the
        replay's side groups at scheduled steps), then the `writing` row when the Trainer will save."""
        now = time.monotonic()
        if self.observer is not None:
            took = now - self._step_started if self._step_started is not None else None
            self.observer.step(state.global_step, duration_s=took)
        self._step_started = now
        if self.replay is not None:
            self.replay.on_step(state.global_step)
        if control.should_save:
            self._begin(state.global_step, before_write=True)

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._begin(state.global_step, before_write=True)

    def _begin(self, step: int, *, before_write: bool) -> None:
        """Collective: the `writing` row before the Trainer writes (an interrupted save always leaves its record)."""
        if step in self._attempts or self.run is None:
            return
        self._attempts[step] = self.run.begin_save(step, folders.folder_name(step), remove_stale=before_write)

    def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self.run is None:
            return control
        run = self.run
        step = state.global_step
        self._begin(step, before_write=False)  # save_strategy "best": decided after on_step_end
        attempt = self._attempts.pop(step)
        run.barrier()  # every rank's files (rng_state_R.pth) are written before anyone lists or hashes
        if self.replay is not None:
            self.replay.sweep(step)  # every target replayed on the save step's capture (collective)
        live = self._live_evidence(state, model, optimizer, lr_scheduler)
        step_dir = run.root / folders.folder_name(step)
        files, listing = run.hash_share(step_dir)
        verdict = run.commit(
            step,
            attempt,
            step_dir,
            files,
            listing,
            live,
            run_policy=self.policy,
            topology=self.topology,
            versions=self._versions(),
            layout=folders.LAYOUT,
            after=lambda v, ev: self._retention(state),
        )
        self.last_verdict = {"step": step, **verdict}
        if run.is_coordinator:
            from scout_ckpt.ops.views import reason_text

            log.warning(
                "scout-ckpt: checkpoint-%d %s%s",
                step,
                verdict["state"],
                f" ({reason_text(verdict['reasons'])})" if verdict["reasons"] else "",
            )
        if verdict["state"] == "rejected" and self.stop_on_reject:
            control.should_training_stop = True
        return control

    def _retention(self, state) -> None:
        """Coordinator, after a recorded commit: the Trainer's save_total_limit, by the core rule. Its errors are
        recorded as events, never raised: a save whose verdict is recorded has succeeded."""
        if not self.limit:
            return
        best = folders.parse_folder(Path(state.best_model_checkpoint).name) if state.best_model_checkpoint else None
        try:
            folders.apply_retention(
                self.run.ledger,
                self.run.root,
                self.limit,
                dirs=folders.list_folders(self.run.root),
                also_keep={best} if best else set(),
            )
        except Exception as e:  # noqa: BLE001 -- see the docstring
            self.run.ledger.add_event("retention_error", run_id=self.run.run_id, detail={"error": repr(e)})

    def _live_evidence(self, state, model, optimizer, lr_scheduler) -> dict:
        """Collective: consensus and invariants on the state in memory (identical evidence on every rank)."""
        live_state = {
            "model": model.state_dict() if model is not None else {},
            "optimizer": optimizer.state_dict() if optimizer is not None else {},
            "scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else {},
            "trainer": {"global_step": state.global_step},
        }
        ev = {}
        if self.groups is not None:
            from scout_ckpt.consensus.save_time import save_time_consensus

            ev["consensus"] = save_time_consensus(live_state, self.groups)
        if self.checks:
            from scout_ckpt.consensus.signatures import flatten_state

            flat = {
                k: v
                for k, v in flatten_state({"model": live_state["model"], "optimizer": live_state["optimizer"]}).items()
                if isinstance(v, torch.Tensor)
            }
            ev["invariants"] = inv.run_local(self.checks, flat, group=self.run.pg if self.run.distributed else False)
        if self.replay is not None and self.run.is_coordinator:
            ev["replay"] = self.replay.evidence(state.global_step)
        return ev

    def on_train_end(self, args, state, control, **kwargs):
        """All ranks: the run's ledger closed and its side groups released (IntegrationRun.close)."""
        if self.run is not None:
            groups = list(self.groups.process_groups) if self.groups is not None else []
            if self.replay is not None:
                groups += self.replay.process_groups
                self.replay.close()
                self.replay = None
            if self.observer is not None:
                self.observer.stop()
                self.observer = None
            self.run.close(groups=groups)
            self.run = None
            self.groups = None
