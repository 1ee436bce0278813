"""The save hook a training script holds. Every public method is collective unless it says otherwise.

A save boundary is the commit protocol of scout_ckpt/save/commit.py (writing row, temp dir with owner record, digests,
manifest, rename, ledger, retention) around the evidence of scout_ckpt/save/evidence/boundary.py: consensus (hashed here,
during the write), invariants and signatures on the live state, the writers' finite checks, replay coverage, and the
verdict they give. Loading walks back from the newest certified checkpoint past any whose bytes or loaded values do
not match what was saved, rejecting each in the ledger (the walk-back is scout_ckpt/save/loading.py; the async save path,
its commit thread and latched errors, scout_ckpt/save/async_save.py; this class is the facade over save, load and
shutdown: it decides when each step of a save runs, on which thread and group).
"""

from __future__ import annotations

import contextlib
import datetime
import fnmatch
import os
import time
import uuid

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from scout_ckpt import invariants as inv
from scout_ckpt import object_store, options, policy
from scout_ckpt.consensus.groups import ConsensusGroups
from scout_ckpt.consensus.in_flight import InFlightDigests
from scout_ckpt.consensus.save_time import start_consensus
from scout_ckpt.errors import CommitError, ScoutError, StartRefused, one_line_refusals
from scout_ckpt.ledger import Ledger, fsdetect
from scout_ckpt.observer import Observer
from scout_ckpt.ops.startup import open_run_ledger
from scout_ckpt.options import (
    FleetOptions,
    LocalTierOptions,
    ObserverOptions,
    ReplayOptions,
    ShardEvidenceOptions,
)
from scout_ckpt.save import commit, fault_points, placement, run_facts
from scout_ckpt.save import log as scout_log
from scout_ckpt.save.app_state import RankLocal
from scout_ckpt.save.async_save import AsyncSaves
from scout_ckpt.save.evidence.boundary import SaveEvidence
from scout_ckpt.save.evidence.replay import ReplayEvidence
from scout_ckpt.save.evidence.shard import ShardEvidence
from scout_ckpt.save.fault_points import FaultHook
from scout_ckpt.save.gc_hold import collection_held
from scout_ckpt.save.lineage import Lineage
from scout_ckpt.save.loading import LatestCleanLoader  # noqa: F401  (re-exported)
from scout_ckpt.save.loading import materialize as _materialize
from scout_ckpt.save.planner import PlanCache
from scout_ckpt.save.storage import ScoutWriter

COORDINATOR = commit.COORDINATOR


def _hook_or_noop(fault_hook: FaultHook | None) -> FaultHook:
    # Not a bound method of the Checkpointer: a reference cycle would keep its process groups alive past
    # destroy_process_group, and their teardown at interpreter exit then stalls the job's exit by seconds.
    return fault_hook if fault_hook is not None else (lambda point, step: None)


class Checkpointer:
    """Certified DCP checkpoints under `root`.

    The grouped options (`replay`, `observer`, `shard_evidence`, `local`, `fleet`) each have one spelling: their
    frozen dataclass of scout_ckpt/options.py (a docstring per field, a misspelled field fails at once, on every
    rank), or a bool: True (the default) turns the group on with its defaults wherever the job can use them, False
    turns it off. A dict is refused with one line naming the dataclass; a config file's table converts with
    `XOptions.from_dict` (or `options.from_config` for a whole table of these keywords). A save whose evidence shows
    the live state bad raises LiveStateCorrupt (see `save`) unless `on_live_fault="continue"`. The fleet record
    (docs/fleet.md): at start each rank checks whether its device is a persistent suspect there (`on_suspect`), and
    the coordinator's recorder thread appends this run's attributed verdicts.

    Opening a Checkpointer on a ROOT where another process is saving leaves that save alone: start-up settles
    only `writing` rows and temp dirs whose owner is provably dead (commit.reconcile). A ledger lost beside
    checkpoints (missing, empty, not SQLite) is rebuilt from their manifests and the journal first; one that
    cannot be read otherwise stops the start on every rank with an error naming `scout-ckpt ledger rebuild`
    (ops/startup.py): a job never trains from step 0 over existing checkpoints.

    `root` may be an object-store URI (`s3://bucket/prefix`, the `scout-ckpt[s3]` extra): the ledger then lives
    in `ledger_dir` (local or shared POSIX), `storage_options` go to fsspec (s3fs: client_kwargs=
    {"endpoint_url": ...}); see scout_ckpt.object_store.

    Args:
        root: the checkpoints' directory, or an object-store URI (`s3://bucket/prefix`).
        model: the model being trained (wrapped or not); what consensus, replay and the observer look at.
        optimizer: its optimizer; replay and shard evidence check its update.
        mesh: the job's DeviceMesh, whose dims say which ranks hold replicas (default: the root mesh of the
            model's DTensor parameters; a model without DTensors and no mesh is DDP over the world).
        async_save: save() returns after staging a host copy; the write and commit run in a thread.
        keep: retention after each durable commit: the `keep` newest certified checkpoints (None: keep all).
        replay: SDC replay. True (default): ReplayOptions() wherever the job can replay (2+ ranks and a model
            with something to replay; otherwise one WARNING says it is off). A ReplayOptions: on with those
            settings, and a model with nothing to replay is refused (NoTargets). False: off.
        observer: the out-of-band observer. True (default): ObserverOptions(); an ObserverOptions; False: off.
        invariants: model-intrinsic checks, e.g. ["finite"].
        consensus: compare replicas bit for bit at each save (C3).
        finite: the writers' NaN/Inf check of every tensor written.
        consensus_exclude: fnmatch patterns of state keys left out of consensus (per-rank values).
        verify_load: compare loaded values with the signatures recorded at save.
        timeout_s: the side groups' collective timeout, in seconds.
        shard_evidence: shard replay and the at-rest guard for single-owner shards. True (default): on for
            sharded layouts (FSDP2, HSDP) with a supported optimizer (an unsupported one: off, with a WARNING),
            otherwise off. A ShardEvidenceOptions: on with those settings whatever the layout (an unsupported
            optimizer is refused). False: off.
        on_live_fault: "raise" (LiveStateCorrupt ends the generation) or "continue".
        ledger_journal: SQLite journal mode of the ledger: "auto", "wal" or "delete".
        ledger_dir: where the ledger lives when `root` is an object store.
        storage_options: fsspec options for an object-store `root`.
        local: the fast tier (node-local saves with peer copies): LocalTierOptions, or False (default: off).
        fleet: the fleet record shared by jobs. True (default): the store SCOUT_CKPT_FLEET names, none when it is
            unset; a path: that store (FleetOptions' other defaults); a FleetOptions; False: none, whatever the
            environment.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        mesh=None,
        async_save: bool = False,
        keep: int | None = None,
        replay: ReplayOptions | bool = True,
        observer: ObserverOptions | bool = True,
        invariants: list | None = None,
        consensus: bool = True,
        finite: bool = True,
        consensus_exclude: tuple[str, ...] = (),
        verify_load: bool = True,
        timeout_s: float = 600.0,
        shard_evidence: ShardEvidenceOptions | bool = True,
        on_live_fault: str = "raise",
        ledger_journal: str | None = None,
        ledger_dir: str | os.PathLike | None = None,
        storage_options: dict | None = None,
        local: LocalTierOptions | bool = False,
        fleet: FleetOptions | str | os.PathLike | bool = True,
    ):
        fault_hook = fault_points.current()  # tests and the demo only: scout_ckpt.testing.fault_points
        one_line_refusals()  # an uncaught refusal (StartRefused, LiveStateCorrupt) ends the job as one line
        # Every option is checked here, the same on every rank, before anything collective (options.py): one
        # spelling per group, then the components' internal form (None: the defaults where they apply).
        for name, value in (
            ("replay", replay),
            ("observer", observer),
            ("shard_evidence", shard_evidence),
            ("local", local),
            ("fleet", fleet),
        ):
            options.check_group(name, value)
        replay, observer = options.as_replay(replay), options.as_observer(observer)
        shard_evidence, local = options.as_shard_evidence(shard_evidence), options.as_local(local)
        storage = options.as_storage(
            ledger_dir=ledger_dir, storage_options=storage_options, ledger_journal=ledger_journal
        )
        options.check_scalars(
            keep=keep, timeout_s=timeout_s, on_live_fault=on_live_fault, consensus_exclude=consensus_exclude
        )
        fleet = options.as_fleet(fleet)
        if not dist.is_initialized():
            raise ScoutError("Checkpointer needs an initialized default process group (init_process_group)")
        if fleet is not None:  # before any collective: a rank on a persistent suspect device may exit here
            from scout_ckpt.fleet.startup import check_this_rank

            check_this_rank(fleet, dist.get_rank())
        # "auto" | "wal" | "delete" (ledger/fsdetect.py); checked on every rank before anything collective
        self.ledger_journal = fsdetect.resolve_mode(storage.ledger_journal)
        self.model, self.optimizer = model, optimizer
        self._resumed_at: int | None = None  # the step load_latest_clean loaded, until a save of another step
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        scout_log.warn_restart_env(self.rank, os.environ)
        # self.root is where the ledger lives: ROOT itself, or ledger_dir for an object-store URI (self.store).
        self.store, self.root = object_store.locate(
            root,
            ledger_dir=storage.ledger_dir,
            storage_options=dict(storage.storage_options) if storage.storage_options is not None else None,
            coordinator=self.rank == COORDINATOR,
        )
        self.is_coordinator = self.rank == COORDINATOR
        self.async_save, self.keep, self.fault_hook = async_save, keep, fault_hook
        self.lineage = Lineage(on_live_fault)  # a save that finds the live state bad taints what follows it
        self.finite = finite
        topo = self._topology(mesh)
        self.mode, self.mesh_shape = topo["mode"], tuple(topo["mesh_shape"])
        timeout = datetime.timedelta(seconds=timeout_s)
        # Side groups are created at startup, in the same order on all ranks (docs/pytorch-facts.md): never the training
        # group, so checkpoint traffic cannot interleave with (or deadlock against) training collectives.
        self._pg = dist.new_group(backend="gloo", timeout=timeout)
        # Async saves (scout_ckpt/save/async_save.py): two more side groups, the commit thread and its latched error.
        self._async = AsyncSaves(timeout) if async_save else None
        self._last_verdict: dict | None = None
        self._step_started = time.monotonic()
        self._closed = False
        self._saves = 0
        self._plans = PlanCache()  # DCP's plans, reused while the state's layout is unchanged (save/planner.py)
        self._bookkeeping_s = 0.0
        self._rank_local: tuple[str, ...] = ()
        self._save_started = time.monotonic()
        self._save_started_wall = time.time()

        self.checks = inv.parse_specs(invariants) if invariants else []  # bad specs fail here, not at a save
        self.consensus, self.consensus_exclude, self.verify_load = consensus, tuple(consensus_exclude), verify_load
        self.groups = ConsensusGroups.from_topology(topo, timeout_s=timeout_s) if (consensus or replay) else None
        # Replay by default at every topology with two or more ranks: consensus alone cannot see a rank whose
        # forward or backward is wrong (its gradient is averaged into every replica, which then agree on it), so
        # replicated topologies (DDP, HSDP, the frameworks' DDP) need replay as much as single-owner shards do.
        # Where it stays off by default (off_by_default), start() says so once (replay=True still asks for it).
        off = ReplayEvidence.off_by_default(self.world_size, self.mode)
        self.replay = ReplayEvidence.start(
            replay,
            model=model,
            optimizer=optimizer,
            groups=self.groups,
            auto_on=self.groups is not None and off is None,
            off_reason=off,
        )
        self.shard = ShardEvidence.start(
            shard_evidence,
            mode=self.mode,
            model=model,
            optimizer=optimizer,
            group=self._pg,
            timeout_s=timeout_s,
            no_replicas=all(len(g) < 2 for g in topo.get("replica_groups") or [[0]]),
        )
        # What this run's saves prove and what "certified" requires of them (save_evidence.py).
        self._evidence = SaveEvidence(
            checks=self.checks,
            finite=finite,
            consensus=consensus,
            verify_load=verify_load,
            replay=self.replay,
            shard=self.shard,
            mode=self.mode,
            is_coordinator=self.is_coordinator,
            lineage=self.lineage,
            world_size=self.world_size,
        )
        self.policy = self._evidence.policy
        self._evidence.warn_if_never_certifies()
        self.topology = {
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
        }
        self.ledger: Ledger | None = None
        run_id, refusal = None, None
        if self.is_coordinator:
            try:  # a lost ledger beside checkpoints is rebuilt, never started afresh (ops/startup.py)
                self.root.mkdir(parents=True, exist_ok=True)
                self.ledger = open_run_ledger(self.root, journal=self.ledger_journal, store=self.store)
                commit.reconcile(self.ledger, self.root, store=self.store)
                run_id = f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
                self.ledger.begin_run(
                    run_id,
                    world_size=self.world_size,
                    topology=self.topology,
                    policy=self.policy,
                    versions=self._versions(),
                )
            except Exception as e:  # every rank must still reach the broadcast below, and raise with it
                refusal = e
        run_id, why = self._broadcast((run_id, None if refusal is None else str(refusal) or type(refusal).__name__))
        if why is not None:
            if self.ledger is not None:
                self.ledger.close()
            if isinstance(refusal, ScoutError):
                raise refusal  # the coordinator's own error; every other rank raises StartRefused with its text
            raise StartRefused(why) from refusal
        self.run_id = run_id
        self._evidence.bind(ledger=self.ledger, run_id=self.run_id)
        if self.replay is not None:
            self.replay.bind(
                ledger=self.ledger,
                root=self.root,
                run_id=self.run_id,
                policy=self.policy,
                is_coordinator=self.is_coordinator,
            )
        placement.record(self.ledger, self.run_id, self.rank, self._pg)  # host / node / local rank of every rank
        self._fleet = None
        if fleet is not None and self.is_coordinator:  # the fleet record, from a thread of its own (docs/fleet.md)
            from scout_ckpt.fleet.recorder import FleetRecorder

            self._fleet = FleetRecorder(fleet.path, self.root, fleet.interval_s)
        self._committer = commit.Committer(
            self.root,
            self.run_id,
            self.rank,
            self.ledger,
            keep=keep,
            hook=_hook_or_noop(fault_hook),
            store=self.store,
            manifest_fields={
                "world_size": self.world_size,
                "topology": self.topology,
                "policy": self.policy,
                "invariants": self.policy["invariants"],
                "versions": self._versions(),
            },
        )
        self.observer = None
        self._shared_observer = None
        side_groups = (
            [self._pg]
            + (self._async.process_groups if self._async else [])
            + (self.groups.process_groups if self.groups else [])
            + (self.replay.process_groups if self.replay is not None else [])
        )
        if observer and Observer.running() is not None:
            # One observer per process: a second Checkpointer here (a teacher beside a student, a second ROOT)
            # shares the one that watches this process, and its side groups are not training collectives.
            self._shared_observer = Observer.running()
            self._shared_observer.ignore(*side_groups)
            scout_log.logger.info(
                "observer: this process's observer (started by an earlier Checkpointer) watches this one too"
            )
        elif observer:
            self.observer = Observer.start(
                self.root,
                rank=self.rank,
                world_size=self.world_size,
                run_id=self.run_id,
                ignore_groups=side_groups,
                **observer.start_kwargs(),
            )
        if self.observer is not None and model is not None:
            self.observer.attach(model, optimizer)
        from scout_ckpt.save.local_tier import LocalTier  # the fast tier (local=): its own module

        self.local = LocalTier(local, self, timeout) if local is not None else None
        self._loader = LatestCleanLoader(
            self.root,
            self.rank,
            self.world_size,
            self._pg,
            self.ledger,
            self.run_id,
            verify_load,
            _hook_or_noop(fault_hook),
            store=self.store,
            local=self.local,
        )

    # ---- configuration (save/run_facts.py) -----------------------------------------------------------------

    def _topology(self, mesh) -> dict:
        return run_facts.topology(self.model, mesh, self.world_size)

    def _versions(self) -> dict:
        return run_facts.versions()

    # ---- small collectives on our own group ----------------------------------------------------------------

    def _broadcast(self, obj, group=None):
        box = [obj]
        dist.broadcast_object_list(box, src=COORDINATOR, group=group or self._pg)
        return box[0]

    def _hook(self, point: str, step: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point, step)

    # ---- per-step hook -------------------------------------------------------------------------------------

    def step(self, step: int, state: dict | None = None, loss: float | None = None) -> None:
        """Per-step hook, after the optimizer step: records the step's wall time and drives the SDC replay
        schedule (collective on the checkpointer's side groups at scheduled steps, never the training group).
        The time reported to the observer runs from one call to the next, less the coordinator's ledger work.
        With the fast tier (`local=`), `state` is saved to it when `step % local.every == 0` (collective; it
        blocks for a staging copy and the live evidence, and commits in the background: `local.last_verdict`;
        a verdict showing the live state bad raises LiveStateCorrupt at the next step() or save()).

        Args:
            step: the number of optimizer steps taken so far (the same on every rank).
            state: with the fast tier, the state to save to it at this step (as for save()).
            loss: this rank's loss of the step (a float; a tensor is read with .item()), on every rank or none: a
                non-finite loss or a spike triggers triage (docs/fleet.md).
        """
        if step != self._resumed_at:
            self._resumed_at = None  # trained past the loaded step: its save is a new checkpoint
        now = time.monotonic()
        # The coordinator's own ledger bookkeeping (last step's replay rows) is not training time: left in, it
        # would widen the spread the straggler rule measures and hide a real straggler.
        self.last_step_s = max(0.0, now - self._step_started - self._bookkeeping_s)
        self._step_started = now
        self._bookkeeping_s = 0.0
        if self._async is not None:
            self._async.raise_error()
        self._raise_live_fault()
        if self.observer is not None:
            self.observer.step(step, duration_s=self.last_step_s)
        if self.shard is not None:
            self._record_shard_faults(self.shard.on_step(step))
        if self.replay is not None:
            self._bookkeeping_s = self.replay.on_step(step, loss)
        if self.local is not None:
            t0 = time.monotonic()
            self.local.on_step(step, state)  # a local save is not training time either
            self._bookkeeping_s += time.monotonic() - t0

    def _record_shard_faults(self, bad: list[dict]) -> None:
        """Coordinator: a shard whose update did not recompute bit for bit is an `sdc` event naming the rank; the
        save evidence (ShardEvidence.live) rejects every later checkpoint the fault's window reaches, and
        ShardEvidence.revoke the already committed ones it may be in."""
        if not (bad and self.is_coordinator):
            return
        for r in bad:
            self.ledger.add_event(
                "sdc",
                step=r.get("step"),
                ranks=r.get("ranks") or [],
                run_id=self.run_id,
                detail={"source": "shard_replay", "reasons": (r.get("reasons") or [])[:8]},
            )
        if self._async is not None:  # an async save still committing may hold the fault: let it land first
            self._async.join()
        self.shard.revoke(self.ledger, self.root, bad)

    def parameters_written(self) -> None:
        """Call after writing parameters or optimizer state outside `optimizer.step()` (a projection onto a
        constraint set, an EMA written back) and before the next save: the at-rest check then takes the new values
        as the legitimate ones instead of reporting them as changed at rest. Local, cheap; a no-op without
        shard evidence."""
        if self.shard is not None:
            self.shard.resign()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Annotate a phase of the training step (forward, backward, optimizer, data) for the hang observer.

        Args:
            name: the phase ("forward", "backward", "optimizer", "data", ...): a context manager around it.
        """
        if self.observer is None:
            yield
        else:
            with self.observer.phase(name):
                yield

    # ---- save ----------------------------------------------------------------------------------------------

    def save(self, step: int, state: dict) -> dict | None:
        """Save the state after `step` optimizer steps; every rank calls it with the same step.

        Sync: returns the verdict on every rank, the manifest's: {"state": "certified" | "committed" |
        "rejected", "reasons": [{"code", ...}], "live_fault": [kinds]} ("live_fault" only when the evidence
        showed the live state bad; an error in the ledger write or retention after the rename is recorded as an
        event, never raised). With the fast tier, a local save still committing is waited for first: a live fault
        it found taints this save's lineage. Async: returns None at once; the commit happens when the upload has
        completed everywhere, and its failure is raised at the next step()/save()/wait().

        A verdict with "live_fault" (replicas disagreed, replay or a shard's update did not recompute, a shard
        changed at rest, non-finite values, a hardware fault) means every later checkpoint descends from bad
        state: by default (`on_live_fault="raise"`) save raises LiveStateCorrupt on every rank, after the
        verdict is durable, so the generation ends together and torchrun restarts from the latest clean step
        (async: at the next step()/save()/wait()). With "continue" training goes on and every later save is
        rejected (`lineage_tainted`) until `load_latest_clean` loads a clean checkpoint.

        Raises on every rank: SaveRefused when the coordinator cannot start the save (the step is quarantined
        and this incarnation wrote it; a later one sets the quarantined folder aside and saves the step anew),
        CommitError when nothing was published; an async save to a POSIX ROOT begins in its commit thread, so
        both come from its next step()/save()/wait() (as ScoutError, the cause chained).

        Args:
            step: the number of optimizer steps taken before this state (the same on every rank).
            state: {name: Stateful or state dict} as for dcp.save, e.g. {"app": ModelOptimizerState(model, opt)}.
        """
        if self._closed:
            raise ScoutError("Checkpointer is closed")
        if step == self._resumed_at:
            # The state was just loaded from this step's certified checkpoint (a resume that saves at once, as
            # nanoGPT's loop does): that checkpoint already holds it, and a save never replaces a certified one.
            if self.is_coordinator:
                scout_log.logger.info("step %d: resumed from its certified checkpoint; not saved again", step)
            return {"state": "certified", "reasons": [], "not_saved": "resumed_from_this_step"}
        self._resumed_at = None
        if self.local is not None:
            self.local.wait()  # the local save this state descends from: its verdict is assessed with this one
        self._raise_live_fault()  # the previous async or local save's, if it found the live state bad
        t0 = time.monotonic()
        # no older-generation garbage collection while the save blocks training (save/gc_hold.py)
        with self.phase("checkpoint"), collection_held():
            try:
                verdict = self._save(step, state)
            except BaseException:
                # A collective of ours failed (a peer died mid-save): tell the observer this rank is a victim,
                # so that only the rank that really died is reported as a crash.
                if self.observer is not None:
                    self.observer.heartbeat.error()
                raise
            finally:
                # The save is not training compute: left in the next step's time, the coordinator's commit
                # work (manifest, ledger) made it look like a straggler on a loaded machine.
                self._bookkeeping_s += time.monotonic() - t0
        self._raise_live_fault()  # outside the phase: it stops the observer (the generation ends by decision)
        return verdict

    def _save(self, step: int, state: dict) -> dict | None:
        if self._async is not None:
            self._async.wait()
            if self.lineage.pending():
                return None  # the previous save found the live state bad: save() raises, outside the phase
        # A sync save's replay sweep runs beside its write (ReplayEvidence.start_sweep), joined before the evidence
        sweep = self._begin_boundary(step, state, overlap=not self.async_save)
        try:
            return self._save_after_boundary(step, state, sweep)
        finally:
            if sweep is not None:
                sweep.join()  # on every path: a failed save leaves no sweep running into the next steps

    def _save_after_boundary(self, step: int, state: dict, sweep) -> dict | None:
        # Every rank derives the same attempt id (no collective): this incarnation's id and a save counter.
        self._saves += 1
        attempt = f"{self.run_id.rsplit('-', 1)[-1]}-{self._saves}"
        if self.async_save and self.store is None:
            return self._async.start_posix(self, step, state, attempt)
        flat = _materialize(state)
        # Sync: consensus hashing (the one pass over every replicated byte) and then its exchange run in a
        # background thread, during DCP's write (the training thread is held, so the state cannot change
        # meanwhile). The hashing waits for the write to start (`in_flight.started`, set by the writer): before
        # it, begin and DCP's planning are CPU-bound and on the critical path, while the write mostly waits on the
        # disk (bench/_save_phases.py: hashing from the start delayed the write by 60 ms of 4 ranks on 2 cores);
        # the tensors this rank writes are signed by the writer as it writes them (consensus/in_flight.py). A
        # refused save leaves the hashing to finish unread, on every rank alike.
        in_flight = InFlightDigests()
        try:
            return self._save_sync_or_store(step, flat, attempt, in_flight, sweep)
        finally:
            in_flight.release()

    def _begin_boundary(self, step: int, state: dict, overlap: bool = False):
        """What every save boundary, durable or local (save/local_tier.py), starts with. With `overlap` the replay
        sweep is left running in its own thread and returned (PendingSweep: finish() before the evidence)."""
        self._save_started = time.monotonic()
        self._save_started_wall = time.time()
        sweep = None
        if self.replay is not None:
            # complete same-step replay evidence (collective on the replay's side groups)
            if overlap:
                sweep = self.replay.start_sweep(step)
            else:
                self.replay.sweep(step)
        # State that differs by rank on purpose (RankLocal) is saved per rank and never compared across ranks.
        self._rank_local = tuple(f"{k}." for k, v in state.items() if isinstance(v, RankLocal))
        if self.shard is not None:  # the shard replay of this step's update, in flight: decided before the evidence
            self._record_shard_faults(self.shard.flush())
        return sweep

    def _save_sync_or_store(
        self, step: int, flat: dict, attempt: str, in_flight: InFlightDigests, sweep=None
    ) -> dict | None:
        hashing = None if self.async_save else self._start_consensus(flat, background=True, in_flight=in_flight)
        pending = self._committer.begin(step, attempt, self._pg)
        self._hook("before_write", step)

        if self.async_save:
            hashing = self._start_consensus(flat, background=False)
        if self.store is not None:
            from scout_ckpt.save.object_store_io import writer_for  # fsspec: imported only for an object store

            writer = writer_for(
                self.store, pending.name, step=step, fault_hook=self.fault_hook, check_finite=self.finite
            )
        else:
            writer = ScoutWriter(pending.tmp, step=step, fault_hook=self.fault_hook, check_finite=self.finite)
        writer.in_flight = in_flight
        if self.async_save:  # object store: evidence from the live state, then dcp.async_save (async_save.py)
            return self._async.start_store(self, step, flat, hashing, pending, writer)
        try:
            dcp.save(flat, storage_writer=writer, process_group=self._pg, planner=self._plans.planner())
        except dcp.api.CheckpointException as e:
            # DCP gathered every rank's write result and raises the same CheckpointException (a BaseException: a
            # training loop's `except Exception` would not see it) on every rank, e.g. a full disk. Nothing was
            # published: the coordinator rejects the `writing` row and removes the temp dir now (the space is
            # freed for the next save), and every rank raises CommitError, an Exception, naming the cause. (A
            # collective that broke because a peer died raises something else: the row is then settled at the
            # restart as `save_interrupted`, by commit.reconcile.)
            if self.is_coordinator:
                self._committer.abandon(pending, e)
            raise CommitError(f"checkpoint {step} not saved: {commit.write_failure(e)}") from e
        if sweep is not None:
            try:
                sweep.finish()  # the replay rows in the ledger before the evidence reads its coverage
            except BaseException as e:  # nothing is published: the attempt is closed now, as for a failed write
                if self.is_coordinator:
                    self._committer.abandon(pending, e)
                raise
        live = self._live_evidence(step, flat, hashing)
        return self._commit(pending, writer, live, self._pg)

    def _start_consensus(self, flat: dict, background: bool, in_flight: InFlightDigests | None = None):
        """Consensus planned and hashed (local; in a background thread with `background`, from when the write
        has started, partly by the writer: `in_flight`), or None."""
        if not self.consensus:
            return None
        return start_consensus(
            flat, self.groups, names_filter=self._consensus_names, background=background, in_flight=in_flight
        )

    def _live_evidence(self, step: int, flat: dict, hashing, group=None) -> dict:
        """Evidence taken from the state at the save boundary (collective over `group`, default the checkpointer's
        group, and the consensus groups; SaveEvidence.live)."""
        return self._evidence.live(step, flat, hashing, group or self._pg, taken_at=self._save_started_wall)

    def _consensus_names(self, name: str) -> bool:
        if self._rank_local and name.startswith(self._rank_local):
            return False
        return not any(fnmatch.fnmatch(name, pat) for pat in self.consensus_exclude)

    def _commit(self, pending, writer: ScoutWriter, live: dict, group) -> dict:
        self._hook("after_write", pending.step)
        verdict = self._committer.finish(pending, writer, group, assess=lambda gathered: self._assess(gathered, live))
        self._last_verdict = verdict
        # the same on every rank (the coordinator's verdict, broadcast); the coordinator's event comes first
        self.lineage.note(
            pending.step, verdict, ledger=self.ledger if self.is_coordinator else None, run_id=self.run_id
        )
        scout_log.save_verdict(
            self.rank, pending.step, verdict, time.monotonic() - self._save_started, [k for k in self.policy["require"]]
        )
        if self._fleet is not None:
            self._fleet.nudge()  # the save's events reach the fleet store now, from the recorder's thread
        self._hook("after_commit", pending.step)
        return verdict

    def _assess(self, gathered: list[dict], live: dict) -> tuple[dict, dict, policy.Verdict]:
        """Coordinator: (evidence, signatures, verdict) of the save (SaveEvidence.assess)."""
        return self._evidence.assess(gathered, live)

    def wait(self) -> None:
        """Block until the pending async save is committed (or failed) on this rank; raises its error (as
        ScoutError, the cause chained) once, or LiveStateCorrupt when its verdict showed the live state bad."""
        if self._async is not None:
            self._async.wait()
        if self.local is not None:
            self.local.wait()
        self._raise_live_fault()

    def _raise_live_fault(self) -> None:
        e = self.lineage.take()
        if e is not None:
            # The generation ends by decision, on every rank: the observers are told so (a closed heartbeat), or
            # the rank that happens to leave first would be reported as a crash.
            if self.observer is not None:
                self.observer.stop()
                self.observer = None
            raise e

    @property
    def last_verdict(self) -> dict | None:
        return self._last_verdict

    @property
    def loaded_tier(self) -> str | None:
        """The tier the last load_latest_clean loaded from: "durable", "local" or None (nothing loaded)."""
        return self._loader.last_tier

    # ---- load ----------------------------------------------------------------------------------------------

    def load_latest_clean(self, state: dict) -> int | None:
        """Load the newest certified checkpoint whose bytes and loaded values match what was saved into `state`;
        return its step (None: nothing to load).

        Every rank calls it (collective on the checkpointer's own group) and every rank gets the same outcome.
        Each rank re-hashes a disjoint share of the files; then DCP loads, and full-tensor signatures of what was
        loaded are compared with those recorded at save. A checkpoint that fails either check is rejected in the
        ledger (bytes: the digest reasons; values: `load_mismatch` naming the tensors) and the next older certified
        one is loaded over the same state, in this same call: a restarted job resumes from the earlier step
        instead of crash-looping. Raises LoadVerificationError on every rank, and leaves the checkpoint as it is,
        when `state` has no place for saved values (the caller built it wrongly). The walk-back itself is
        scout_ckpt/save/loading.py.

        Args:
            state: the same shape of dict as given to save(), built for this job; loaded in place.
        """
        self.wait()
        with self.phase("checkpoint"):  # the coordinator's ledger writes after the load run while peers train on
            step = self._loader.load(state)
        # What was loaded (or the fresh start) is the new lineage: nothing before it taints the saves to come.
        self.lineage.clear()
        self._resumed_at = step
        if step is None:
            return None
        if self.replay is not None:
            self.replay.begin(step)
        if self.shard is not None:
            self.shard.after_load(step)
        return step

    # ---- shutdown ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the pending async save, then release resources. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._async is not None:
                self._async.release()
            self._plans.clear()
            if self.is_coordinator:
                self._committer.flush()
            if self.replay is not None:
                self.replay.close()
            if self.shard is not None:
                self.shard.close()
            if self.observer is not None:
                self.observer.stop()
            if self._fleet is not None:
                self._fleet.close()
            if self.ledger is not None:
                self.ledger.close()
            if self.local is not None:  # last: everything above is released even if its wait raises again
                self.local.close()  # frees this rank's writer lease: the orphan sweep may then take its folders

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
