"""Certified Megatron-Core `dist_checkpointing` saves: `MegatronCheckpointer(save_dir)` once after
`parallel_state.initialize_model_parallel`, then `ckpt.save(iteration, model.sharded_state_dict())` where the job
called `dist_checkpointing.save(sharded_state_dict, f"{save_dir}/iter_{iteration:07d}")`, and
`ckpt.load_latest_clean(sharded_state_dict)` for the resume. `save(sharded_state_dict, checkpoint_dir)` is the same
as a drop-in for `dist_checkpointing.save` (one checkpointer per save_dir, made on first use).

megatron-core (0.16.1) writes a torch_dist checkpoint through its own async writer (`FileSystemWriterAsync`, not
`torch.distributed.checkpoint.save`): each rank writes its `__R_I.distcp`, rank 0 `.metadata`, `common.pt` and
`metadata.json`; with `async_sharded_save=True` it returns an `AsyncRequest` whose finalize functions run on every
rank after every rank's write is done (the async queue agrees across ranks first); without it the same finalize
functions run in line. One save, all ranks:

  1. begin: the row `writing` for `iter_NNNNNNN` (IntegrationRun.begin_save: a stale folder of an abandoned attempt
     at the same iteration removed), then the folder made, before any byte is written
  2. live evidence, on the state being saved (collective, before the write): each rank digests every ShardedTensor
     piece it holds (key, global offset, local shape, flattened range) and checks it for NaN/Inf; the digests are
     gathered (one all_gather of 16-byte xxh3-128 digests on the integration's own gloo group). Ranks holding the same piece
     are its replicas (Megatron gives them different `replica_id`s: data-parallel copies, tensor-parallel-replicated
     layer norms); every replicated piece is compared (two copies that differ: `consensus_inconclusive`; three or
     more: the minority attributed, `consensus_attributed`). A piece only one rank holds (tensor-parallel shards at
     DP=1, the distributed optimizer's flattened ranges) has no replica to vouch for it: `single_owner`
  3. the write: `dist_checkpointing.save` (torch_dist, unchanged options)
  4. finalize (appended to the AsyncRequest, or in line): each rank digests its own `__R_*.distcp` (the writing rank,
     never a rank-0 re-read), rank 0 the files rank 0 wrote; the coordinator lists the folder (a file nobody
     digested is `missing_file`), writes scout-manifest.json, records the verdict (compare-and-set), journals it;
     every rank gets the same verdict (IntegrationRun.commit); rank 0 then points
     `latest_checkpointed_iteration.txt` at the iteration only if it was certified
  5. at start-up the tracker is pointed at the newest certified iteration that re-verifies (walking back), or moved
     aside when there is none; `latest_clean(save_dir)` gives that iteration for Megatron-LM's `--ckpt-step`

By default a checkpoint with single-owner pieces is `committed`, never certified (reason `single_owner`, naming how
many pieces and which keys); `accept_single_owner=True` accepts bytes + finite checks for them (the run's policy
says so). The consensus compares what the pieces hold at save; a fault before the data-parallel all-reduce that
every replica then shares is not seen by it (as with DDP).

Replay (on by default where data-parallel replicas hold whole parameters: DP >= 2 at TP = PP = 1, given
`model=`; the job calls `ckpt.step(iteration)` after each optimizer step): integrations.mg_replay, which says what it
covers and where it is off.

Not covered here: formats other than torch_dist (refused); the observer (the core Checkpointer's, not wired for
Megatron); a filesystem not shared by the ranks (the coordinator's listing must see every rank's files).
"""

from __future__ import annotations

import logging
import os
import platform
import re
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

import scout_ckpt
from scout_ckpt.errors import LiveStateCorrupt, ScoutError, StartRefused
from scout_ckpt.integrations import mg_evidence, mg_folders, mg_replay
from scout_ckpt.integrations.mg_folders import LAYOUT, folder_name, parse_folder
from scout_ckpt.integrations.session import COORDINATOR, IntegrationRun, rejudge_committed
from scout_ckpt.options import ReplayOptions, check_group

log = logging.getLogger("scout_ckpt.megatron")

__all__ = ["MegatronCheckpointer", "save", "latest_clean", "write_tracker"]

LIVE_CODES = ("consensus_attributed", "consensus_inconclusive", "invariant_failed", "replay_sdc", "replay_inconclusive")
DISTCP_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


def latest_clean(save_dir: str | os.PathLike, *, verify: bool = True) -> int | None:
    """The newest certified iteration under save_dir whose bytes still verify (walking back past, and rejecting,
    any that fail), for Megatron-LM's `--ckpt-step`; None on a fresh run. Not collective.

    Args:
        save_dir: Megatron-LM's `--save` directory.
        verify: re-hash the candidate's bytes (False: trust the ledger).
    """
    return mg_folders.latest_clean_iteration(save_dir, verify=verify)


def write_tracker(save_dir: str | os.PathLike, *, verify: bool = True) -> int | None:
    """Point `latest_checkpointed_iteration.txt` at the newest certified iteration that verifies (or move it aside
    when there is none); returns that iteration. Call it on one rank, after Megatron-LM wrote its tracker.

    Args:
        save_dir: Megatron-LM's `--save` directory.
        verify: re-hash the candidates' bytes (False: trust the ledger).
    """
    return mg_folders.repoint_tracker(save_dir, verify=verify)


_CHECKPOINTERS: dict[str, "MegatronCheckpointer"] = {}


def save(sharded_state_dict, checkpoint_dir: str | os.PathLike, **kwargs):
    """Drop-in for `dist_checkpointing.save(sharded_state_dict, checkpoint_dir, ...)` where checkpoint_dir is
    `SAVE_DIR/iter_NNNNNNN`: the MegatronCheckpointer of SAVE_DIR (made on first use, collective) saves and
    certifies it (a MegatronCheckpointer already made for SAVE_DIR is the one used). Returns what
    dist_checkpointing.save returns (the AsyncRequest with scout-ckpt's finalize
    appended when async_sharded_save=True, else None); the verdict is the checkpointer's `last_verdict`.

    Args:
        sharded_state_dict: what `model.sharded_state_dict()` (and the optimizer's) returned, as for dist_checkpointing.
        checkpoint_dir: `SAVE_DIR/iter_NNNNNNN`.
        kwargs: dist_checkpointing.save's own options (`sharded_strategy`, `async_sharded_save`, ...).
    """
    path = Path(checkpoint_dir)
    iteration = parse_folder(path.name)
    if iteration is None:
        raise ScoutError(f"scout-ckpt certifies Megatron folders named iter_NNNNNNN; got {path.name!r}")
    key = str(path.parent.resolve())
    if key not in _CHECKPOINTERS:
        _CHECKPOINTERS[key] = MegatronCheckpointer(path.parent)
    ckpt = _CHECKPOINTERS[key]
    out = ckpt.save(iteration, sharded_state_dict, async_save=kwargs.pop("async_sharded_save", False), **kwargs)
    return out if not isinstance(out, dict) else None


class MegatronCheckpointer:
    """Certified dist_checkpointing saves under one save_dir (see the module docstring). Collective to construct
    (every rank, after torch.distributed and parallel_state are initialized): opens the ledger, settles what a crash
    left, points the tracker at the newest certified iteration.

    Args:
        save_dir: Megatron-LM's `--save` directory (the ROOT of the ledger).
        accept_single_owner: certify pieces one rank holds (TP shards at DP=1, the distributed optimizer's ranges) on
            bytes and finite checks alone (the run's policy says so); default: such checkpoints stay `committed`.
        consensus: compare the pieces data-parallel ranks hold in common (needs >= 2 replicas).
        on_live_fault: "raise" (LiveStateCorrupt on every rank, ending the generation) or "continue".
        update_tracker: keep `latest_checkpointed_iteration.txt` on the newest certified iteration.
        timeout_s: timeout of the integration's own gloo group.
        model: the model the job trains (a module, Megatron's DistributedDataParallel around it, or the list of
            one model chunk Megatron-LM builds), for replay; without it replay is off (one WARNING at start).
        replay: SDC replay across the data-parallel ranks (see the module docstring), as the core's `replay=`:
            True (default: on where it can run, else one WARNING), a ReplayOptions (asked for: refused where it
            cannot run), False (off).
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        *,
        accept_single_owner: bool = False,
        consensus: bool = True,
        on_live_fault: str = "raise",
        update_tracker: bool = True,
        timeout_s: float = 600.0,
        model: torch.nn.Module | list | None = None,
        replay: ReplayOptions | bool = True,
    ):
        if on_live_fault not in ("raise", "continue"):
            raise ScoutError(f"on_live_fault must be 'raise' or 'continue' (got {on_live_fault!r})")
        check_group("replay", replay)  # a wrong spelling fails here, before anything collective
        self.root = Path(save_dir)
        self.accept_single_owner, self.on_live_fault = accept_single_owner, on_live_fault
        self.update_tracker = update_tracker
        self.run = IntegrationRun(self.root, framework="megatron", timeout_s=timeout_s)
        self.consensus = consensus and self.run.world > 1
        # the data-parallel ring replay runs on (TP = PP = 1: every rank a replica), or None
        self.replay, self.groups = mg_replay.start(self.run, replay, model, timeout_s)
        self.policy = self._policy()
        self.topology = {
            "mode": "megatron" if self.run.world > 1 else "single",
            "world_size": self.run.world,
            "framework": "megatron",
            "layout": LAYOUT,
            **mg_replay.parallel_sizes(),
        }
        self.last_verdict: dict | None = None
        self._start()
        _CHECKPOINTERS[str(self.root.resolve())] = self  # the drop-in `save` of this save_dir uses this one

    # ---- set-up ---------------------------------------------------------------------------------------------

    def _policy(self) -> dict:
        """What "certified" means: bytes (each writer's digests), the finite check of every piece, consensus over
        the pieces that have replicas, and `single_owner` (pieces no replica vouches for, accepted by option)."""
        require = ["bytes", "invariants"] + (["consensus"] if self.consensus else []) + ["single_owner"]
        allow_na = ["single_owner", "consensus"] if self.accept_single_owner else []
        if self.replay is not None:  # required where it runs; not_applicable only without ckpt.step() calls
            require.append("replay")
            allow_na.append("replay")
        return {
            "require": require,
            "allow_not_applicable": allow_na,
            "invariants": [],
            "layout": LAYOUT,
            "replay_targets": [list(t) for t in self.replay.targets()] if self.replay is not None else [],
            "accept_single_owner": self.accept_single_owner,
        }

    def _versions(self) -> dict:
        from importlib.metadata import version

        return {
            "scout_ckpt": scout_ckpt.__version__,
            "torch": torch.__version__,
            "megatron_core": version("megatron-core"),
            "python": platform.python_version(),
        }

    def _start(self) -> None:
        def after(ledger, run_id):
            for s in self.run.settled:
                if s["after"] != "writing":
                    log.warning(
                        "scout-ckpt: iteration %d of an interrupted save settled: %s (%s)",
                        s["step"],
                        s["after"],
                        s["why"],
                    )
            again = rejudge_committed(ledger, self.root, run_id, self.policy, "single_owner")
            if again:
                log.warning(
                    "scout-ckpt: %s re-judged under this run's policy (accept_single_owner=True): "
                    "certified on their recorded bytes + finite checks",
                    ", ".join(map(folder_name, again)),
                )

        self.run.start(topology=self.topology, policy=self.policy, versions=self._versions(), after=after)
        self.run.bind_replay(self.replay, self.policy)
        it = self.run.on_coordinator(
            f"point {self.root}/{mg_folders.TRACKER} at a certified iteration",
            lambda: (
                mg_folders.repoint_tracker(self.root)
                if self.update_tracker
                else mg_folders.latest_clean_iteration(self.root)
            ),
        )
        if it is None:
            pending = self.run.on_coordinator(f"read the ledger in {self.root}", self._uncertified)
            if pending:
                # never a fresh start over saved state that is only unvouched (not found bad): a person decides
                raise StartRefused(
                    f"{self.root}: no certified checkpoint, but {len(pending)} saved iteration(s) exist that are "
                    f"not rejected ({', '.join(pending[-4:])}); the job does not start from iteration 0 over them. "
                    "Fix: MegatronCheckpointer(..., accept_single_owner=True) re-judges them on bytes + finite "
                    "checks and resumes from the newest (`scout-ckpt ls` shows why each is not certified), or "
                    "move them out of the save_dir to start over"
                )

    def _uncertified(self) -> list[str]:
        rows = self.run.ledger.checkpoints(states=("committed",))
        return [
            f"{r['path']} ({(r['reasons'] or [{}])[0].get('code', 'committed')})"
            for r in rows
            if (self.root / r["path"]).is_dir()
        ]

    def close(self) -> None:
        """Every rank, at the end of training: the ledger closed, the integration's gloo groups released."""
        groups = list(self.groups.process_groups) if self.groups is not None else []
        if self.replay is not None:
            groups += self.replay.process_groups
            self.replay.close()
            self.replay = None
        self.run.close(groups=groups)
        self.groups = None
        _CHECKPOINTERS.pop(str(self.root.resolve()), None)

    def step(self, iteration: int, loss: float | None = None) -> None:
        """Every rank, after each optimizer step (as the core Checkpointer's `step`): replay's rotation and the
        arming of the next step's capture. A job that never calls it gets no replay evidence (its saves say so,
        `replay_no_step_hook`). No-op where replay is off.

        Args:
            iteration: the iteration just completed (Megatron-LM's `iteration` after `train_step`).
            loss: the step's loss, for the loss triage of a spike (optional).
        """
        if self.replay is not None:
            self.replay.on_step(int(iteration), loss)

    # ---- save ------------------------------------------------------------------------------------------------

    def save(self, iteration: int, sharded_state_dict, *, async_save: bool = False, **save_kwargs):
        """Collective: save `sharded_state_dict` into save_dir/iter_NNNNNNN with dist_checkpointing.save (torch_dist)
        and certify it. Sync: returns the verdict {"state", "reasons"} (also `last_verdict`). async_save=True:
        returns the AsyncRequest with scout-ckpt's finalize appended; schedule it as Megatron-LM does
        (`AsyncCallsQueue.schedule_async_request`); the verdict is `last_verdict` once it is finalized. A verdict
        that shows the live state bad raises LiveStateCorrupt on every rank unless on_live_fault="continue".

        Args:
            iteration: the training iteration (the folder is iter_NNNNNNN).
            sharded_state_dict: as for dist_checkpointing.save.
            async_save: return dist_checkpointing's AsyncRequest with scout-ckpt's finalize appended.
            save_kwargs: dist_checkpointing.save's own options (a torch_dist strategy only).
        """
        strategy = save_kwargs.get("sharded_strategy")
        if strategy is not None:
            backend = strategy[0] if isinstance(strategy, tuple) else getattr(strategy, "backend", None)
            if backend != "torch_dist":
                raise ScoutError(f"scout-ckpt certifies the torch_dist format; got {backend!r}")
        iteration = int(iteration)
        name = folder_name(iteration)
        step_dir = self.root / name
        # every target replayed on the save step's capture, in a thread of its own beside the evidence and the write
        # (ReplayEvidence.start_sweep: replay's own gloo group); finished before save() returns, so the training
        # thread is held meanwhile and the rows are in the ledger before the finalize reads them
        sweep = self.replay.start_sweep(iteration) if self.replay is not None else None
        try:
            attempt = self.run.begin_save(iteration, name, remove_stale=True)
            self.run.on_coordinator(f"create {step_dir}", lambda: step_dir.mkdir(parents=True, exist_ok=True))
            live = self._live_evidence(sharded_state_dict)
            if async_save:
                request = dist_checkpointing.save(
                    sharded_state_dict, str(step_dir), async_sharded_save=True, **save_kwargs
                )
            else:
                dist_checkpointing.save(sharded_state_dict, str(step_dir), **save_kwargs)
            if sweep is not None:
                sweep.finish()
        finally:
            if sweep is not None:
                sweep.join()  # on every path: a failed save leaves no sweep running into the next steps
        if async_save:
            request.add_finalize_fn(lambda: self.finalize(iteration, attempt, live))
            return request
        return self.finalize(iteration, attempt, live)

    def finalize(self, iteration: int, attempt: str, live: dict) -> dict:
        """Collective, every rank, after every rank's write (Megatron's own finalize functions first): digests by the
        writing ranks, manifest, verdict, tracker. Returns the verdict (the same on every rank).

        Args:
            iteration: the iteration saved.
            attempt: the save attempt's id (from the `writing` row).
            live: the live evidence gathered before the write.
        """
        run = self.run
        step_dir = self.root / folder_name(iteration)
        files, listing = run.hash_share(step_dir, writer=_writer_of)
        if self.replay is not None and run.is_coordinator:  # the ledger's replay rows: the coordinator's
            live = {**live, "replay": self.replay.evidence(iteration)}
        verdict = run.commit(
            iteration,
            attempt,
            step_dir,
            files,
            listing,
            live,
            run_policy=self.policy,
            topology=self.topology,
            versions=self._versions(),
            need_metadata=True,
            layout=LAYOUT,
            iteration=iteration,
        )
        self.last_verdict = {"step": iteration, "iteration": iteration, **verdict}
        if run.is_coordinator:
            from scout_ckpt.ops.views import reason_text

            log.warning(
                "scout-ckpt: %s %s%s",
                folder_name(iteration),
                verdict["state"],
                f" ({reason_text(verdict['reasons'])})" if verdict["reasons"] else "",
            )
            if self.update_tracker and verdict["state"] == "certified":
                try:
                    mg_folders.point_tracker(self.root, iteration)
                except OSError as e:  # the previous certified iteration stays named: logged, not raised
                    log.warning(
                        "scout-ckpt: could not point %s/%s at %d: %s", self.root, mg_folders.TRACKER, iteration, e
                    )
        run.barrier()
        bad = sorted({r.get("code") for r in verdict["reasons"] if r.get("code") in LIVE_CODES})
        if bad and self.on_live_fault == "raise":
            raise LiveStateCorrupt(iteration, {**self.last_verdict, "live_fault": bad})
        return verdict

    # ---- load ------------------------------------------------------------------------------------------------

    def load_latest_clean(self, sharded_state_dict, **load_kwargs):
        """Collective: (iteration, state dict) of the newest certified iteration whose bytes re-verify (the
        coordinator walks back past, and rejects, any that fail), loaded with dist_checkpointing.load; None on a
        fresh run.

        Args:
            sharded_state_dict: the state dict to load into, as for dist_checkpointing.load.
            load_kwargs: dist_checkpointing.load's own options.
        """

        def find():
            found = mg_folders.latest_clean_iteration(self.root)
            if found is not None and self.update_tracker:
                mg_folders.point_tracker(self.root, found)
            return found

        it = self.run.on_coordinator(f"find the newest certified iteration in {self.root}", find)
        if it is None:
            return None
        loaded = dist_checkpointing.load(sharded_state_dict, str(self.root / folder_name(it)), **load_kwargs)
        if self.replay is not None:
            self.replay.begin(it)  # the schedule and coverage start again from the loaded iteration
        return it, loaded

    # ---- evidence on the live state --------------------------------------------------------------------------

    def _live_evidence(self, sharded_state_dict) -> dict:
        """Collective: consensus over replicated pieces and the finite check of every piece (identical on every
        rank), and the `single_owner` evidence (integrations.mg_evidence)."""
        mine = mg_evidence.local_pieces(sharded_state_dict)
        if self.run.distributed:
            every = [None] * self.run.world
            dist.all_gather_object(every, mine, group=self.run.pg)
        else:
            every = [mine]
        return mg_evidence.evidence(every, consensus=self.consensus, accept_single_owner=self.accept_single_owner)


# ---- pure helpers ----------------------------------------------------------------------------------------------


def _writer_of(path: str) -> int:
    """The rank that wrote a file of a torch_dist folder: `__R_I.distcp` rank R, the rest (`.metadata`,
    `common.pt`, `metadata.json`) rank 0."""
    m = DISTCP_RE.match(path)
    return int(m.group(1)) if m else COORDINATOR
