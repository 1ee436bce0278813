"""Certified DeepSpeed checkpoints: `install(engine, save_dir)` once after `deepspeed.initialize`, then the job's own
`engine.save_checkpoint(save_dir)` and `engine.load_checkpoint(save_dir)`, unchanged.

DeepSpeed (0.19.8) does not use DCP. `save_checkpoint` calls its engine's `CheckpointEngine` on every rank:
`create(info)`, then `save(state_dict, path)` for each file this rank writes (`torch.save`), then `commit(info)`,
then rank 0 writes `save_dir/latest` with plain `open()` and all ranks meet at a barrier. `install` puts a
`ScoutCheckpointEngine` there (wrapping DeepSpeed's own `TorchCheckpointEngine`, which still writes the bytes) and
wraps the instance's `save_checkpoint`. One save boundary, all ranks:

  1. create: the tag must be DeepSpeed's default `global_stepN` (the ledger is keyed by step); the coordinator
     records the row `writing` for it and removes a stale folder of an abandoned attempt at the same step
     (IntegrationRun.begin_save, collective), before any byte is written
  2. save (each file): DeepSpeed's torch.save, the writing rank digesting the file's bytes as they are written
     (integrations.hashed_save: no second read of the file), then it checks every tensor of the state dict it
     wrote for NaN/Inf (the one finite check, invariants/finite.py): no rank reads another rank's files
  3. commit: consensus (C3 over the data-parallel ranks) on the state every rank holds a full copy of (below); the
     digests and finite results go to the coordinator (a gather: every rank's files are on disk), which lists the
     tag folder (a file nobody digested is `missing_file`), writes scout-manifest.json, records the verdict
     (compare-and-set), journals it; every rank returns the same verdict (IntegrationRun.commit). This is the
     ledger's own cross-rank agreement: DeepSpeed's barrier comes only after commit
  4. `latest`: the wrapped save_checkpoint passes save_latest=False to DeepSpeed, so DeepSpeed never writes it;
     after DeepSpeed's final barrier rank 0 points `latest` at the tag only if the tag was certified
     (ds_folders.point_latest, atomic). At install, after settling what a crash left, the coordinator points
     `latest` at the newest certified tag whose bytes re-verify (walking back past any that fail), or moves it
     aside when there is none: `engine.load_checkpoint(save_dir)` (tag=None reads `latest`) loads certified state

What each ZeRO stage replicates, and so what consensus can compare (measured with DeepSpeed 0.19.8, fp32, CPU):
  stage 0   every rank holds the whole model, optimizer (moments) and LR scheduler: all compared; certifiable
  stage 1-2 every rank holds the whole model (gathered after each step) and the scheduler: compared. The
            optimizer's state (Adam moments, fp32 master partition: `zero_pp_rank_R_mp_rank_00_optim_states.pt`)
            is partitioned: each rank holds its part alone, so no replica vouches for it
  stage 3   parameters are partitioned too: only the scheduler and counters have replicas
Partitioned state is single-owner, as pure FSDP shards are: bytes and finite checks alone do not vouch for it, so
by default a checkpoint with any (stage 1-3) is `committed`, never certified, reason `zero_single_owner` naming
the stage and the state. `accept_single_owner=True` accepts bytes + finite checks for it (the run's policy says
so, in the ledger and every manifest). A fault inside the owner's own optimizer step at stage 1-2 is not seen by
consensus either way: the owner's updated partition is gathered to every rank, so the copies agree.

Replay (on by default at stages 0-2 with 2+ ranks; `install(..., replay=False)` turns it off): integrations.ds_replay,
which says what it wraps and covers.

Not supported (fail closed): tags other than `global_stepN` (refused at create), MoE or tensor/pipeline model
parallelism (consensus `topology_unsupported`: the ranks' model states are not replicas), DeepSpeed's decoupled
or fast writers (install refuses them), files written outside the tag folder (not part of the checkpoint).
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

import scout_ckpt
from scout_ckpt import policy
from scout_ckpt.errors import LiveStateCorrupt, ScoutError, StartRefused
from scout_ckpt.format.digests import digest_files
from scout_ckpt.integrations import ds_evidence, ds_folders, ds_replay, hashed_save
from scout_ckpt.integrations.ds_folders import LAYOUT, folder_name, parse_folder
from scout_ckpt.integrations.session import IntegrationRun, rejudge_committed
from scout_ckpt.options import ReplayOptions

log = logging.getLogger("scout_ckpt.deepspeed")

__all__ = ["install", "latest_clean", "ScoutCheckpointEngine"]

LIVE_CODES = ("consensus_attributed", "consensus_inconclusive", "invariant_failed", "replay_sdc", "replay_inconclusive")


def latest_clean(save_dir: str | os.PathLike, *, verify: bool = True) -> str | None:
    """The tag of the newest certified checkpoint under save_dir whose bytes still verify (walking back past, and
    rejecting, any that fail), for `engine.load_checkpoint(save_dir, tag=latest_clean(save_dir))`; None on a fresh
    run. Not collective: each rank that calls it re-hashes. With `install` this is what `latest` names already.

    Args:
        save_dir: the checkpoint directory.
        verify: re-hash the candidate's bytes (False: trust the ledger).
    """
    return ds_folders.latest_clean_tag(save_dir, verify=verify)


def install(
    engine,
    save_dir: str | os.PathLike,
    *,
    accept_single_owner: bool = False,
    consensus: bool = True,
    on_live_fault: str = "raise",
    timeout_s: float = 600.0,
    replay: ReplayOptions | bool = True,
) -> "ScoutCheckpointEngine":
    """Collective (every rank, after `deepspeed.initialize`, before `load_checkpoint`): certify every
    `engine.save_checkpoint(save_dir)` in `save_dir/scout-ledger.db` and keep `save_dir/latest` on the newest
    certified tag. Returns the installed checkpoint engine (`.last_verdict`, `.close()`).

    Args:
        engine: the engine `deepspeed.initialize` returned.
        save_dir: the directory the job passes to `engine.save_checkpoint` (the ROOT of the ledger).
        accept_single_owner: certify ZeRO 1-3 partitions on bytes + finite checks alone (see the module docstring)
        consensus: compare the replicated state across data-parallel ranks (needs >= 2 ranks)
        on_live_fault: "raise": a verdict showing the live state bad (replicas disagree, replay, NaN/Inf) raises
            LiveStateCorrupt on every rank after the save, ending the generation; "continue": log it
        timeout_s: timeout of the integration's own gloo groups (a dead peer fails the save, no hang)
        replay: SDC replay of the model's layers (and the optimizer's update where DeepSpeed steps a torch
            optimizer) across the data-parallel ranks, as the core's `replay=`: True (default: on at ZeRO stages
            0-2 with 2+ ranks, where a rank computing wrongly is averaged into every replica, which consensus
            then sees agree; off at stage 3, whose parameters are partitioned, with one WARNING), a
            ReplayOptions (asked for: refused where it cannot run), False
    """
    if on_live_fault not in ("raise", "continue"):
        raise ScoutError(f"on_live_fault must be 'raise' or 'continue' (got {on_live_fault!r})")
    inner = getattr(engine, "checkpoint_engine", None)
    if isinstance(inner, ScoutCheckpointEngine):
        return inner
    if inner is not None and (inner.is_decoupled() or type(inner) is not TorchCheckpointEngine):
        raise ScoutError(
            f"scout-ckpt wraps DeepSpeed's TorchCheckpointEngine; this engine uses "
            f"{type(inner).__name__} (remove the checkpoint writer / datastates configuration)"
        )
    from scout_ckpt import options

    options.check_group("replay", replay)  # a wrong spelling fails here, before anything is installed
    asked = options.as_replay(replay)
    scout = ScoutCheckpointEngine(
        engine,
        save_dir,
        inner=inner,
        accept_single_owner=accept_single_owner,
        consensus=consensus,
        on_live_fault=on_live_fault,
        timeout_s=timeout_s,
        replay=asked,
    )
    engine.checkpoint_engine = scout
    original = engine.save_checkpoint

    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        # DeepSpeed never writes `latest` (save_latest=False): rank 0 points it at the tag after the verdict
        scout.sweep()  # before any byte: every target replayed on the save step's capture (collective)
        scout.in_save = True
        try:
            out = original(
                save_dir,
                tag=tag,
                client_state={} if client_state is None else client_state,
                save_latest=False,
                **kwargs,
            )
        finally:
            scout.in_save, scout._current = False, None
        scout.after_save(save_latest)
        return out

    save_checkpoint.__doc__ = original.__doc__
    engine.save_checkpoint = save_checkpoint
    if scout.replay is not None:
        ds_replay.wrap(engine, scout)
    scout.start()
    return scout


class ScoutCheckpointEngine(CheckpointEngine):
    """DeepSpeed's CheckpointEngine with scout-ckpt's evidence and commit (see the module docstring); the bytes are
    written by the wrapped TorchCheckpointEngine. Every method DeepSpeed calls on every rank is collective here
    where the module docstring says so.

    Args:
        engine: the DeepSpeed engine.
        save_dir: the checkpoint directory (the ROOT of the ledger).
        inner: the engine that writes the bytes (default: a TorchCheckpointEngine of the engine's config).
        accept_single_owner, consensus, on_live_fault, timeout_s: as for `install`.
        replay: as `install` passes it (options.as_replay's form: None for the default).
    """

    def __init__(
        self,
        engine,
        save_dir,
        *,
        inner=None,
        accept_single_owner=False,
        consensus=True,
        on_live_fault="raise",
        timeout_s=600.0,
        replay: ReplayOptions | bool | None = None,
    ):
        super().__init__(None)
        self.name = "ScoutCheckpointEngine"
        self.engine = engine
        self.inner = inner if inner is not None else TorchCheckpointEngine(getattr(engine, "_config", None))
        self.root = Path(save_dir)
        self.accept_single_owner, self.on_live_fault = accept_single_owner, on_live_fault
        self.stage = int(engine.zero_optimization_stage())
        self.run = IntegrationRun(self.root, framework="deepspeed", timeout_s=timeout_s)
        self.unsupported = self._unsupported_topology()
        self.groups = None
        if consensus and self.run.world > 1 and not self.unsupported:
            from scout_ckpt.consensus.groups import ConsensusGroups
            from scout_ckpt.consensus.mesh import legacy_topology

            self.groups = ConsensusGroups.from_topology(legacy_topology("ddp", self.run.world), timeout_s=timeout_s)
        self.replay = ds_replay.start(
            engine, self.run, stage=self.stage, unsupported=self.unsupported, groups=self.groups, replay=replay
        )
        self.policy = self._policy(consensus and self.run.world > 1)
        self.topology = {
            "mode": "ddp" if self.run.world > 1 else "single",
            "world_size": self.run.world,
            "framework": "deepspeed",
            "layout": LAYOUT,
            "zero_stage": self.stage,
            "replica_groups": self.groups.groups if self.groups else None,
        }
        self.last_verdict: dict | None = None
        self.in_save = False  # inside the wrapped save_checkpoint: only those create/save/commit are a checkpoint
        self._current: tuple[int, str, str] | None = None  # (step, tag, attempt) of the save in progress
        self._written: list[dict] = []
        self._nonfinite: list[str] = []
        self._unhashed: list[str] = []

    # ---- set-up ---------------------------------------------------------------------------------------------

    def _unsupported_topology(self) -> str | None:
        """Why the ranks' model states are not data-parallel replicas of each other, or None."""
        e = self.engine
        if getattr(e, "has_moe_layers", False):
            return "MoE experts differ per rank"
        try:
            from deepspeed.utils import groups as ds_groups

            dp = ds_groups._get_data_parallel_world_size()
        except Exception:  # noqa: BLE001 - an engine without DeepSpeed's groups: say so, fail closed
            return "the data-parallel world size is unknown"
        if dp != self.run.world:
            return f"model or pipeline parallelism (data-parallel size {dp} of world {self.run.world})"
        return None

    def _policy(self, consensus: bool) -> dict:
        """What "certified" means for this run: bytes, the writers' finite checks, consensus over replicas, and
        `zero_partitions` (single-owner partitions vouched for, or accepted by the option)."""
        require = ["bytes", "invariants"] + (["consensus"] if consensus else []) + ["zero_partitions"]
        allow_na = ["zero_partitions"] if self.accept_single_owner else []
        # "invariants": [] -- the finite check is the writers' at save; `certify` re-verifies the bytes and keeps
        # the recorded invariants (no offline reader for DeepSpeed's pickles: see docs/integrations/deepspeed.md)
        if self.replay is not None:  # required where it runs; not_applicable only without engine.step() calls
            require.append("replay")
            allow_na.append("replay")
        return {
            "require": require,
            "allow_not_applicable": allow_na,
            "invariants": [],
            "layout": LAYOUT,
            "replay_targets": [list(t) for t in self.replay.targets()] if self.replay is not None else [],
            "zero_stage": self.stage,
            "accept_single_owner": self.accept_single_owner,
        }

    def _versions(self) -> dict:
        import deepspeed

        return {
            "scout_ckpt": scout_ckpt.__version__,
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "python": platform.python_version(),
        }

    def start(self) -> None:
        """Collective: open the ledger, settle interrupted saves (their in-place folders removed), begin the run,
        then point `latest` at the newest certified tag that verifies (or move it aside)."""

        def after(ledger, run_id):
            for s in self.run.settled:
                if s["after"] != "writing":
                    log.warning(
                        "scout-ckpt: step %d of an interrupted save settled: %s (%s)", s["step"], s["after"], s["why"]
                    )
            again = rejudge_committed(ledger, self.root, run_id, self.policy, "zero_partitions")
            if again:
                log.warning(
                    "scout-ckpt: %s re-judged under this run's policy (accept_single_owner=True): "
                    "certified on their recorded bytes + finite checks",
                    ", ".join(map(folder_name, again)),
                )

        self.run.start(topology=self.topology, policy=self.policy, versions=self._versions(), after=after)
        self.run.bind_replay(self.replay, self.policy)
        if self.replay is not None:
            self.replay.begin(int(self.engine.global_steps))
        if self.stage >= 1 and not self.accept_single_owner and self.run.is_coordinator:
            log.warning(
                "scout-ckpt: ZeRO stage %d keeps single-owner partitions (%s) that no replica can vouch "
                "for: its checkpoints are saved and recorded but not certified (zero_single_owner). "
                "install(..., accept_single_owner=True) certifies them on bytes + finite checks",
                self.stage,
                "optimizer state" if self.stage < 3 else "parameters and optimizer state",
            )
        tag = self.run.on_coordinator(
            f"point {self.root}/latest at a certified tag", lambda: ds_folders.repoint_latest(self.root)
        )
        if tag is None:
            pending = self.run.on_coordinator(f"read the ledger in {self.root}", self._uncertified_tags)
            if pending:
                # never a fresh start over saved state that is only unvouched (not found bad): a person decides
                raise StartRefused(
                    f"{self.root}: no certified checkpoint, but {len(pending)} saved tag(s) exist that are not "
                    f"rejected ({', '.join(pending[-4:])}); the job does not start from step 0 over them. "
                    "Fix: install(..., accept_single_owner=True) re-judges them on bytes + finite checks and "
                    "resumes from the newest (`scout-ckpt ls` shows why each is not certified), or move them out "
                    "of the save_dir to start over"
                )

    def _uncertified_tags(self) -> list[str]:
        """Coordinator: the tags whose folders exist and whose rows are committed (not certified, not rejected)."""
        ledger = self.run.ledger
        assert ledger is not None  # the coordinator holds the ledger
        rows = ledger.checkpoints(states=("committed",))
        return [
            f"{r['path']} ({(r['reasons'] or [{}])[0].get('code', 'committed')})"
            for r in rows
            if (self.root / r["path"]).is_dir()
        ]

    def close(self) -> None:
        """Every rank, at the end of training (optional but recommended): the ledger closed and the side groups
        released after a barrier on the integration's own group (IntegrationRun.close)."""
        groups = list(self.groups.process_groups) if self.groups is not None else []
        if self.replay is not None:
            groups += self.replay.process_groups
            self.replay.close()
            self.replay = None
        self.run.close(groups=groups)
        self.groups = None

    def sweep(self) -> None:
        """Every rank, at the start of save_checkpoint (after the step it saves, before any byte is written): the
        replay sweep of the save step."""
        if self.replay is not None:
            self.replay.sweep(int(self.engine.global_steps))

    # ---- DeepSpeed's CheckpointEngine ----------------------------------------------------------------------

    def create(self, info):
        """Every rank, before any file of the tag is written: the `writing` row (collective). Outside
        save_checkpoint (`save_16bit_model`, an export to a file of the caller's choosing, also calls create / save
        / commit with tag global_stepN) everything passes through to DeepSpeed's engine unrecorded: that file is
        not a checkpoint, and the tag folder of the same step must not be touched."""
        if not self.in_save:
            self._current = None
            return self.inner.create(info)
        step = parse_folder(str(info.tag))
        if step is None:
            raise ScoutError(
                f"scout-ckpt certifies DeepSpeed tags named global_stepN (DeepSpeed's default, "
                f"save_checkpoint(dir) without tag=); got tag {info.tag!r}"
            )
        if Path(info.save_dir).resolve() != self.root.resolve():
            raise ScoutError(f"scout-ckpt was installed for {self.root}; save_checkpoint got {info.save_dir}")
        self._written, self._nonfinite, self._unhashed = [], [], []
        attempt = self.run.begin_save(step, folder_name(step), remove_stale=True)
        self._current = (step, str(info.tag), attempt)
        self.inner.create(info)

    def makedirs(self, path, exist_ok=False):
        self.inner.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str):
        """This rank's file: DeepSpeed's torch.save, digested from the bytes as they are written (hashed_save: the
        file's digest without reading it back), then the finite check of every tensor in what was written."""
        rel = None
        if self._current is not None:  # else a save outside save_checkpoint (none in DeepSpeed 0.19.8): not ours
            step_dir = self.root / self._current[1]
            rel = os.path.relpath(os.path.abspath(path), os.path.abspath(step_dir))
        if rel is None or rel.startswith("..") or type(self.inner) is not TorchCheckpointEngine:
            self.inner.save(state_dict, path)
            if rel is None:
                return
            if rel.startswith(".."):
                self._unhashed.append(str(path))
                return
            size, digest = digest_files([path])[str(path)]
        else:
            # what TorchCheckpointEngine.save does (torch.save with its serialization setting), digested as written
            size, digest = hashed_save.save(
                state_dict, path, _use_new_zipfile_serialization=self.inner.zipfile_serialization
            )
        self._written.append({"path": Path(rel).as_posix(), "size": size, "digest": digest, "rank": self.run.rank})
        self._nonfinite += [f"{Path(rel).as_posix()}:{n}" for n in ds_evidence.nonfinite_tensors(state_dict)]

    def load(self, path: str, map_location=None):
        return self.inner.load(path, map_location=map_location)

    def commit(self, info):
        """Every rank, after its files and before DeepSpeed's barrier: evidence, gather, manifest, ledger verdict
        (collective; every rank gets the same verdict or the same ScoutError)."""
        if self._current is None:  # outside save_checkpoint (see create)
            return self.inner.commit(info)
        step, tag, attempt = self._current
        run = self.run
        live = ds_evidence.live(
            self.engine,
            stage=self.stage,
            unsupported=self.unsupported,
            groups=self.groups,
            world=self.run.world,
            accept_single_owner=self.accept_single_owner,
        )
        gathered = run.gather(
            {"rank": run.rank, "files": self._written, "nonfinite": self._nonfinite, "outside": self._unhashed}
        )
        files, listing = [], []
        if run.is_coordinator:
            files = sorted((f for g in gathered for f in g["files"]), key=lambda f: f["path"])
            from scout_ckpt.integrations.folders import listing as list_folder

            listing = list_folder(self.root / tag)
            bad = [
                {
                    "code": "invariant_failed",
                    "check": "finite",
                    "ranks": [g["rank"]],
                    "tensors": g["nonfinite"][:8],
                    "n_tensors": len(g["nonfinite"]),
                }
                for g in gathered
                if g["nonfinite"]
            ]
            live["invariants"] = policy.evidence(
                policy.FAIL if bad else policy.PASS, bad, specs=["finite"], checked_by="writers", checked_at="save"
            )
            outside = [p for g in gathered for p in g["outside"]]
            if outside:
                live["invariants"]["files_outside_tag"] = outside[:8]
            if self.replay is not None:
                live["replay"] = self.replay.evidence(step)
        verdict = run.commit(
            step,
            attempt,
            self.root / tag,
            files,
            listing,
            live,
            run_policy=self.policy,
            topology=self.topology,
            versions=self._versions(),
            layout=LAYOUT,
            tag=tag,
        )
        self.last_verdict = {"step": step, "tag": tag, **verdict}
        self._current = None
        self.inner.commit(info)
        if run.is_coordinator:
            from scout_ckpt.ops.views import reason_text

            log.warning(
                "scout-ckpt: %s %s%s",
                tag,
                verdict["state"],
                f" ({reason_text(verdict['reasons'])})" if verdict["reasons"] else "",
            )
        return True

    def after_save(self, save_latest: bool) -> None:
        """Every rank, after DeepSpeed's final barrier: rank 0 points `latest` at the tag if it was certified (a
        failure to do so leaves the previous certified tag there: logged, not raised); then a verdict showing the
        live state bad raises LiveStateCorrupt on every rank unless on_live_fault="continue".

        Args:
            save_latest: DeepSpeed's own `save_latest` of this save (whether `latest` is to be written at all).
        """
        v = self.last_verdict
        if v is None:
            return
        if save_latest and v["state"] == "certified" and self.run.is_coordinator:
            try:
                ds_folders.point_latest(self.root, v["tag"])
            except OSError as e:
                log.warning("scout-ckpt: could not point %s/latest at %s: %s", self.root, v["tag"], e)
        live = sorted({r.get("code") for r in v["reasons"] if r.get("code") in LIVE_CODES})
        if live and self.on_live_fault == "raise":
            raise LiveStateCorrupt(v["step"], {**v, "live_fault": live})
