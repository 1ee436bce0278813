"""The save hook a training script holds. Every public method is collective unless it says otherwise.

Commit protocol of one save boundary at step S (ARCHITECTURE.md, "One save boundary"):

  1. coordinator: ledger row `writing` (attempt id = incarnation + save counter, the same on every rank)
  2. all ranks: evidence on the live state (finite values, consensus, invariants, signatures)
  3. all ranks: DCP writes into ROOT/.step-S.tmp-<attempt>/ (sync, or async on our own gloo group)
  4. all ranks, once the write has finished everywhere: hash the files *this rank* wrote; gather to coordinator
  5. coordinator: scout-manifest.json (fsync) -> rename to step-S (atomic) -> fsync(ROOT) -> ledger commit
  6. coordinator: retention, only after 5 is durable

A SIGKILL anywhere leaves no step-S directory (the temp dir is removed at the next start and the `writing` row
becomes `rejected/save_interrupted`) or a complete one with its manifest (a `writing` row whose directory and
manifest exist is completed from the manifest at the next start).
"""

from __future__ import annotations

import contextlib
import datetime
import fnmatch
import os
import platform
import shutil
import threading
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

import scout_ckpt
from scout_ckpt import invariants as inv
from scout_ckpt import layout, manifest, policy, retention
from scout_ckpt.consensus.groups import ConsensusGroups
from scout_ckpt.consensus.save_time import save_time_consensus
from scout_ckpt.consensus.signatures import REPLICA_PREFIX, full_signatures
from scout_ckpt.digests import digest_files
from scout_ckpt.errors import ScoutError
from scout_ckpt.ledger import Ledger
from scout_ckpt.observer import Observer
from scout_ckpt.recovery import record_bytes_failure, trusted_manifest
from scout_ckpt.replay import ReplayRunner, coverage as replay_coverage
from scout_ckpt.storage import FaultHook, ScoutWriter
from scout_ckpt.verify import verify_files

COORDINATOR = 0
# One replay target every 10 steps keeps amortized replay cost near 3% of training time (bench/
# consensus_overhead.py); certification then waits up to (targets x interval) steps for full coverage.
DEFAULT_REPLAY_INTERVAL = 10


class LoadVerificationError(ScoutError):
    """The state loaded does not match the signatures recorded when it was saved."""


def _materialize(state: dict) -> dict:
    """Shallow copy with Stateful values replaced by their state_dict(): what DCP itself would save."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}




class Checkpointer:
    """Certified DCP checkpoints under `root`.

    Options: `async_save` (dcp.async_save on the checkpointer's own gloo group), `keep` (retention after each
    durable commit), `mode` ("ddp", "fsdp", "hsdp"; inferred from DTensor parameters when omitted),
    `fault_hook(point, step)` (tests and the demo: called at named points of a save).
    """

    def __init__(self, root: str | os.PathLike, *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, mode: str | None = None,
                 mesh_shape: tuple[int, ...] | None = None, async_save: bool = False, keep: int | None = None,
                 replay: dict | bool | None = None, observer: dict | bool | None = None,
                 invariants: list | None = None, consensus: bool = True, finite: bool = True,
                 consensus_exclude: tuple[str, ...] = (), verify_load: bool = True,
                 fault_hook: FaultHook | None = None, timeout_s: float = 600.0):
        if not dist.is_initialized():
            raise ScoutError("Checkpointer needs an initialized default process group (init_process_group)")
        if keep is not None and keep < 1:
            raise ScoutError(f"keep must be at least 1 (got {keep})")
        self.root = Path(root)
        self.model, self.optimizer = model, optimizer
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_coordinator = self.rank == COORDINATOR
        self.async_save, self.keep, self.fault_hook = async_save, keep, fault_hook
        self.finite = finite
        self.mode, self.mesh_shape = self._infer_mode(mode, mesh_shape)
        timeout = datetime.timedelta(seconds=timeout_s)
        # Side groups are created at startup, in the same order on all ranks (TORCH-NOTES): never the training
        # group, so checkpoint traffic cannot interleave with (or deadlock against) training collectives.
        self._pg = dist.new_group(backend="gloo", timeout=timeout)
        self._async_pg = dist.new_group(backend="gloo", timeout=timeout) if async_save else None
        self._commit_pg = dist.new_group(backend="gloo", timeout=timeout) if async_save else None
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None
        self._last_verdict: dict | None = None
        self._step_started = time.monotonic()
        self._closed = False
        self._saves = 0
        self._bookkeeping_s = 0.0

        self.checks = inv.parse_specs(invariants) if invariants else []  # bad specs fail here, not at a save
        self.consensus, self.consensus_exclude, self.verify_load = consensus, tuple(consensus_exclude), verify_load
        self.groups = ConsensusGroups.create(self.mode, self.world_size, self.mesh_shape, timeout_s=timeout_s) \
            if (consensus or replay) else None
        self.replay = None
        if replay and model is not None:
            cfg = {"interval": DEFAULT_REPLAY_INTERVAL, **(replay if isinstance(replay, dict) else {})}
            self.replay = ReplayRunner(model, optimizer, groups=self.groups, **cfg)
            self.replay.begin(0)
        self._replay_events_seen = 0
        self._inv_previous: dict | None = None
        self.policy = self._policy()
        self.topology = {"mode": self.mode, "world_size": self.world_size, "mesh_shape": self.mesh_shape,
                         "replica_groups": self.groups.groups if self.groups else None}
        self.ledger: Ledger | None = None
        run_id = None
        if self.is_coordinator:
            self.root.mkdir(parents=True, exist_ok=True)
            self.ledger = Ledger.open(self.root, create=True)
            self._reconcile()
            run_id = f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
            self.ledger.begin_run(run_id, world_size=self.world_size, topology=self.topology, policy=self.policy,
                                  versions=self._versions())
        self.run_id = self._broadcast(run_id)
        self.observer = None
        if observer:
            cfg = {} if observer is True else dict(observer)
            self.observer = Observer.start(
                self.root, rank=self.rank, world_size=self.world_size, run_id=self.run_id,
                stall_s=cfg.pop("stall_s", 60.0), action=cfg.pop("action", "report"),
                ignore_groups=[g for g in (self._pg, self._async_pg, self._commit_pg) if g is not None]
                + ([self.groups.world_group] + ([self.groups.group] if self.groups.group else [])
                   if self.groups else []),
                **cfg)
        if self.observer is not None and model is not None:
            self.observer.attach(model)

    # ---- configuration -------------------------------------------------------------------------------------

    def _infer_mode(self, mode, mesh_shape):
        if mode is None:
            from torch.distributed.tensor import DTensor

            params = list(self.model.parameters()) if self.model is not None else []
            dt = next((p for p in params if isinstance(p, DTensor)), None)
            if dt is None:
                mode = "ddp"
            else:
                mesh_shape = mesh_shape or tuple(dt.device_mesh.shape)
                mode = "hsdp" if len(mesh_shape) == 2 else "fsdp"
        if mode not in ("ddp", "fsdp", "hsdp"):
            raise ScoutError(f"mode must be ddp, fsdp or hsdp (got {mode!r})")
        return mode, tuple(mesh_shape) if mesh_shape else None

    def _policy(self) -> dict:
        """What "certified" means for this run, stored in the ledger and every manifest."""
        require = ["bytes"]
        if self.finite or self.checks:
            require.append("invariants")
        allow_na = []
        if self.consensus:
            require.append("consensus")
            # Single-owner shards (pure FSDP) have no replica to compare with: only model-intrinsic checks the
            # user configured can vouch for them (`finite` alone misses a huge but finite flipped exponent).
            if self.checks:
                allow_na.append("consensus")
        if self.replay is not None:
            require.append("replay")
        finite = ["finite"] if self.finite and not any(c.kind == "finite" for c in self.checks) else []
        return {"require": require, "allow_not_applicable": allow_na,
                "invariants": [c.spec for c in self.checks] + finite,
                "replay_targets": [list(t) for t in self.replay.targets()] if self.replay else []}

    def _versions(self) -> dict:
        return {"scout_ckpt": scout_ckpt.__version__, "torch": torch.__version__,
                "python": platform.python_version()}

    # ---- small collectives on our own group ----------------------------------------------------------------

    def _broadcast(self, obj, group=None):
        box = [obj]
        dist.broadcast_object_list(box, src=COORDINATOR, group=group or self._pg)
        return box[0]

    def _gather(self, obj, group=None) -> list | None:
        out = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(obj, out, dst=COORDINATOR, group=group or self._pg)
        return out

    def _hook(self, point: str, step: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point, step)

    # ---- start-up reconciliation (coordinator) -------------------------------------------------------------

    def _reconcile(self) -> None:
        """Finish what a crash interrupted: drop temp dirs of dead saves, settle `writing` rows."""
        for tmp in layout.list_tmp_dirs(self.root):
            shutil.rmtree(tmp, ignore_errors=True)
        for row in self.ledger.checkpoints(states=("writing",)):
            step_dir = self.root / row["path"]
            try:
                m, digest = manifest.read(step_dir) if step_dir.is_dir() else (None, None)
            except ScoutError:
                m = None
            if m is not None and m.get("attempt") == row["attempt"]:
                # Renamed but the ledger write was lost: the manifest holds everything the ledger needed.
                v = m["verdict"]
                self.ledger.record_commit(row["step"], run_id=m.get("run_id"), path=row["path"],
                                          nbytes=layout.dir_bytes(step_dir), manifest_digest=digest, files=m["files"],
                                          evidence=m["evidence"], state=v["state"], reasons=v["reasons"],
                                          source="reconcile", attempt=row["attempt"])
            else:
                self.ledger.set_state(row["step"], "rejected",
                                      [{"code": "save_interrupted", "attempt": row["attempt"]}], source="reconcile")

    # ---- per-step hook -------------------------------------------------------------------------------------

    def step(self, step: int) -> None:
        """Per-step hook, after the optimizer step: records the step's wall time and drives the SDC replay
        schedule (collective on the checkpointer's side groups at scheduled steps, never the training group).
        The time reported to the observer runs from one call to the next, less the coordinator's ledger work."""
        now = time.monotonic()
        # The coordinator's own ledger bookkeeping (last step's replay rows) is not training time: left in, it
        # would widen the spread the straggler rule measures and hide a real straggler.
        self.last_step_s = max(0.0, now - self._step_started - self._bookkeeping_s)
        self._step_started = now
        self._bookkeeping_s = 0.0
        self._raise_pending_error()
        if self.observer is not None:
            self.observer.step(step, duration_s=self.last_step_s)
        if self.replay is not None:
            rows = self.replay.on_step(step)
            events = self.replay.events()
            new_events, self._replay_events_seen = events[self._replay_events_seen:], len(events)
            if self.is_coordinator and (rows or new_events):
                t0 = time.monotonic()
                self._record_replays(rows, new_events)
                self._settle_pending()
                self._bookkeeping_s = time.monotonic() - t0

    def _record_replays(self, rows: list[dict], events: list[dict]) -> None:
        self.ledger.add_replays([dict(r, run_id=self.run_id) for r in rows])
        for r in rows:
            if r["status"] in ("ATTRIBUTED", "INCONCLUSIVE"):
                self.ledger.add_event("sdc", step=r["step"], ranks=r["ranks"], run_id=self.run_id,
                                      detail={"source": "replay", "recipe": r["recipe"], "target": r["target"],
                                              "status": r["status"]})
        for e in events:
            self.ledger.add_event(e["kind"], step=e.get("step"), ranks=e.get("ranks"), detail=e.get("detail"),
                                  run_id=self.run_id)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Annotate a phase of the training step (forward, backward, optimizer, data) for the hang observer."""
        if self.observer is None:
            yield
        else:
            with self.observer.phase(name):
                yield

    # ---- save ----------------------------------------------------------------------------------------------

    def save(self, step: int, state: dict) -> dict | None:
        """Save the state after `step` optimizer steps. Sync: returns the verdict {"state", "reasons"} on
        every rank. Async: returns None at once; the commit happens when the upload has completed everywhere."""
        if self._closed:
            raise ScoutError("Checkpointer is closed")
        with self.phase("checkpoint"):
            try:
                return self._save(step, state)
            except BaseException:
                # A collective of ours failed (a peer died mid-save): tell the observer this rank is a victim,
                # so that only the rank that really died is reported as a crash.
                if self.observer is not None:
                    self.observer.heartbeat.error()
                raise

    def _save(self, step: int, state: dict) -> dict | None:
        self.wait()
        # Every rank derives the same attempt id (no collective): this incarnation's id and a save counter.
        self._saves += 1
        attempt = f"{self.run_id.rsplit('-', 1)[-1]}-{self._saves}"
        if self.is_coordinator:
            # Before any rank writes data: DCP's central planning waits for the coordinator, which gets there
            # only after this row is durable, so an interrupted save always leaves its record.
            self.ledger.record_writing(step, self.run_id, attempt, layout.step_dirname(step))
        tmp = self.root / layout.tmp_dirname(step, attempt)
        self._hook("before_write", step)

        flat = _materialize(state)
        live = self._live_evidence(step, flat)
        writer = ScoutWriter(tmp, step=step, fault_hook=self.fault_hook, check_finite=self.finite)
        if self.async_save:
            resp = dcp.async_save(flat, storage_writer=writer, process_group=self._async_pg)
            upload = getattr(resp, "upload_completion", resp)
            self._pending = threading.Thread(target=self._commit_async, args=(upload, step, attempt, writer, live),
                                             name=f"scout-commit-{step}", daemon=True)
            self._pending.start()
            return None
        dcp.save(flat, storage_writer=writer, process_group=self._pg)
        return self._commit(step, attempt, writer, live, self._pg)

    def _live_evidence(self, step: int, flat: dict) -> dict:
        """Evidence taken from the live state at the save boundary, before the write (collective)."""
        ev: dict = {}
        if self.consensus:
            ev["consensus"] = save_time_consensus(flat, self.groups, names_filter=self._consensus_names)
        if self.checks:
            res = inv.run_local(self.checks, inv.flatten(flat), group=self._pg, previous=self._inv_previous)
            self._inv_previous = res.get("values") or self._inv_previous
            ev["invariants"] = res
        if self.verify_load:
            ev["signatures"] = full_signatures(flat, group=self._pg, plain="replica")
        if self.replay is not None and self.is_coordinator:
            ev["replay"] = self._replay_evidence(step)
        return ev

    def _replay_evidence(self, step: int) -> dict:
        """Replay evidence for the state at `step`: this incarnation's replays since the previous certified step,
        including those after `step` (certification waits for each target's next clean replay)."""
        prev = self.ledger.latest("certified", below=step)
        rows = self.ledger.replays(run_id=self.run_id, after=prev["step"] if prev else None)
        return replay_coverage(rows, self.replay.targets(), step=step)

    def _settle_pending(self) -> None:
        """Coordinator: re-decide this incarnation's checkpoints that wait on replay evidence."""
        for row in self.ledger.checkpoints(states=("committed",)):
            if row["run_id"] != self.run_id:
                continue
            ev = self.ledger.evidence(row["step"])
            if (ev.get("replay") or {}).get("status") != policy.MISSING:
                continue
            new = self._replay_evidence(row["step"])
            if new["status"] == policy.MISSING and new["reasons"] == ev["replay"].get("reasons"):
                continue
            self.ledger.put_evidence(row["step"], {"replay": new}, source="replay")
            v = policy.evaluate(self.policy, self.ledger.evidence(row["step"]))
            if v.state != row["state"] or v.reasons != row["reasons"]:
                self.ledger.set_state(row["step"], v.state, v.reasons, source="replay")

    def _consensus_names(self, name: str) -> bool:
        return not any(fnmatch.fnmatch(name, pat) for pat in self.consensus_exclude)

    def _commit_async(self, upload, step, attempt, writer, live) -> None:
        try:
            upload.result()
            self._commit(step, attempt, writer, live, self._commit_pg)
        except BaseException as e:  # surfaced on the training thread at the next step()/save()/wait()
            self._pending_error = e
            if self.observer is not None:  # a peer died during the commit: this rank is a victim, not the culprit
                self.observer.heartbeat.error()

    def _commit(self, step: int, attempt: str, writer: ScoutWriter, live: dict, group) -> dict:
        self._hook("after_write", step)
        tmp = Path(writer.path)
        mine = sorted(writer.written | ({layout.DCP_METADATA} if self.is_coordinator else set()))
        known = writer.file_digests()  # hashed in flight; the rest (.metadata) is read back
        read_back = digest_files([tmp / f for f in mine if f not in known])
        known.update({Path(p).name: d for p, d in read_back.items()})
        files = [{"path": f, "size": known[f][0], "digest": known[f][1], "rank": self.rank} for f in mine]
        # Live evidence is identical on every rank (but `replay`, the coordinator's): only the coordinator's is
        # used, so the others send just what they wrote.
        gathered = self._gather({"rank": self.rank, "files": files, "finite_bad": writer.nonfinite}, group=group)
        verdict = None
        if self.is_coordinator:
            try:
                verdict = self._publish(step, attempt, tmp, gathered, live)
            except BaseException as e:
                verdict = {"state": "error", "reasons": [{"code": "commit_failed", "detail": repr(e)}]}
        verdict = self._broadcast(verdict, group=group)
        if verdict["state"] == "error":
            raise ScoutError(f"checkpoint {step} failed to commit: {verdict['reasons'][0]['detail']}")
        self._last_verdict = verdict
        self._hook("after_commit", step)
        return verdict

    def _evidence(self, step: int, gathered: list[dict], live: dict) -> tuple[dict, dict]:
        """(evidence, signatures): writers' digests and finite checks plus the live evidence of the boundary."""
        files = [f for g in gathered for f in g["files"]]
        live = dict(live)
        signatures = live.pop("signatures", {})
        ev = {"bytes": policy.evidence(policy.PASS, files=len(files), bytes=sum(f["size"] for f in files),
                                       hashed_by="writers")}
        if self.finite or self.checks:
            bad = [{"code": "invariant_failed", "check": "finite", "ranks": [g["rank"]], "tensors": g["finite_bad"][:8]}
                   for g in gathered if g["finite_bad"]]
            checks = live.pop("invariants", None)
            reasons = bad + (checks["reasons"] if checks else [])
            status = policy.PASS
            if checks and checks["status"] != policy.PASS:
                status = checks["status"]
            if bad:
                status = policy.FAIL
            ev["invariants"] = policy.evidence(status, reasons, specs=self.policy["invariants"],
                                               values=(checks or {}).get("values"))
        ev.update(live)
        return ev, signatures

    def _publish(self, step: int, attempt: str, tmp: Path, gathered: list[dict], live: dict) -> dict:
        """Coordinator: manifest -> rename -> ledger -> retention. The order is the commit protocol."""
        files = [f for g in gathered for f in g["files"]]
        ev, signatures = self._evidence(step, gathered, live)
        v = policy.evaluate(self.policy, ev)
        verdict = {"state": v.state, "reasons": v.reasons}
        m = manifest.build(step=step, run_id=self.run_id, attempt=attempt, world_size=self.world_size,
                           topology=self.topology, policy=self.policy, files=files, evidence=ev, verdict=verdict,
                           signatures=signatures, invariants=self.policy["invariants"], versions=self._versions())
        digest = manifest.write(tmp, m)
        self._hook("before_rename", step)
        final = layout.step_path(self.root, step)
        layout.commit_dir(tmp, final)
        self._hook("after_rename", step)
        self.ledger.record_commit(step, run_id=self.run_id, path=final.name, nbytes=layout.dir_bytes(final),
                                  manifest_digest=digest, files=files, evidence=ev, state=v.state,
                                  reasons=v.reasons, attempt=attempt)
        self._record_live_faults(step, ev)
        if self.keep:
            retention.apply(self.ledger, self.root, self.keep)
        return verdict

    def _record_live_faults(self, step: int, ev: dict) -> None:
        """A fault found in the live state at a save boundary is also an `sdc` event naming the rank(s)."""
        for kind, codes in (("consensus", ("consensus_attributed", "consensus_inconclusive")),
                            ("invariants", ("invariant_failed",))):
            for r in (ev.get(kind) or {}).get("reasons") or []:
                if r.get("code") in codes:
                    self.ledger.add_event("sdc", step=step, ranks=r.get("ranks") or [], run_id=self.run_id,
                                          detail={"source": kind, **{k: v for k, v in r.items() if k != "ranks"}})

    def wait(self) -> None:
        """Block until the pending async save is committed (or failed) on this rank."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        self._raise_pending_error()

    def _raise_pending_error(self) -> None:
        if self._pending_error is not None:
            e, self._pending_error = self._pending_error, None
            raise ScoutError(f"async checkpoint failed: {e}") from e

    @property
    def last_verdict(self) -> dict | None:
        return self._last_verdict

    # ---- load ----------------------------------------------------------------------------------------------

    def load_latest_clean(self, state: dict) -> int | None:
        """Load the newest certified checkpoint whose bytes verify; return its step (None: nothing to load).

        Each rank re-hashes a disjoint share of the files; a checkpoint that fails is rejected in the ledger and
        the next older certified one is tried. After loading, the state's signatures are compared with those
        recorded at save."""
        self.wait()
        below = None
        while True:
            cand = self._broadcast(self._candidate(below) if self.is_coordinator else None)
            if cand is None:
                return None
            step_dir = self.root / cand["path"]
            share = cand["files"][self.rank::self.world_size]
            ev = verify_files(step_dir, share, expect_complete=False)
            results = [None] * self.world_size
            dist.all_gather_object(results, ev, group=self._pg)
            failed = cand["reasons"] + [r for e in results for r in e["reasons"]]
            if failed:
                if self.is_coordinator:
                    record_bytes_failure(self.ledger, cand["step"], policy.evidence(policy.FAIL, failed),
                                         source="load")
                below = cand["step"]
                continue
            dcp.load(state, checkpoint_id=str(step_dir), process_group=self._pg)
            self._verify_loaded(cand["step"], cand["signatures"], state)
            if self.is_coordinator:
                self.ledger.set_resumed_from(self.run_id, cand["step"])
            if self.replay is not None:
                self.replay.begin(cand["step"])
            return cand["step"]

    def _candidate(self, below: int | None) -> dict | None:
        """Coordinator: the newest certified step below `below`, its files, and its manifest's signatures (or the
        reason the manifest cannot be trusted)."""
        row = self.ledger.latest("certified", below=below)
        if row is None:
            return None
        m, reasons = trusted_manifest(self.root / row["path"], row)
        return {"step": row["step"], "path": row["path"], "files": self.ledger.files(row["step"]),
                "signatures": (m or {}).get("signatures") or {}, "reasons": reasons}

    def _verify_loaded(self, step: int, expected: dict, state: dict) -> None:
        """Compare full-tensor signatures of what was loaded with those recorded at save (sharding-independent,
        so a checkpoint saved on N ranks verifies when loaded on M). A mismatch stops the job: continuing would
        train from state that is not what was certified."""
        if not self.verify_load or not expected:
            return
        got = full_signatures(_materialize(state), group=self._pg, plain="replica")
        absent = sorted(k for k in expected if k not in got)
        # A plain tensor's value (xxh3) compares only with a plain tensor's: one that became a DTensor in a
        # resharded restart is vouched for by the byte digests alone.
        comparable = [k for k in expected if k in got and got[k].startswith(REPLICA_PREFIX)
                      == expected[k].startswith(REPLICA_PREFIX)]
        differ = sorted(k for k in comparable if got[k] != expected[k])
        if absent or differ:
            if self.is_coordinator:
                self.ledger.add_event("load_mismatch", step=step, run_id=self.run_id,
                                      detail={"absent": absent[:16], "differ": differ[:16]})
            if absent:
                raise LoadVerificationError(
                    f"checkpoint {step}: {len(absent)} saved value(s) have no place in the state passed to "
                    f"load_latest_clean (e.g. {absent[0]}); build it with torch.distributed.checkpoint.state_dict."
                    "get_state_dict so that optimizer state exists before loading")
            raise LoadVerificationError(f"checkpoint {step}: loaded state differs from what was saved in "
                                        f"{len(differ)} tensor(s), e.g. {differ[0]}")

    # ---- shutdown ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the pending async save, then release resources. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self.replay is not None:
                self.replay.close()
            if self.observer is not None:
                self.observer.stop()
            if self.ledger is not None:
                self.ledger.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
