"""The fast tier: frequent certified saves of each rank's own state to node-local storage, with peer copies.

Why its own module: a local save shares the durable save's evidence (the Checkpointer's consensus, invariants,
finite check, replay sweep, shard evidence, verdict, lineage: called through the facade, never forked) but not
its format or commit: each rank writes its OWN state (its local tensors, DTensors as their local shards) with
torch.save to DIR/RUN_ID/step-NNNNNNNN/rank-R.pt, so restoring needs the same world size, ranks per node and mesh
(`layout`); a different one skips the tier with one INFO line.

One local save, at `ckpt.step(step, state)`:
  1. training thread (held), every rank: the live evidence exactly as a durable save takes it
     (SaveEvidence.live: consensus hashed in the background on its own groups, invariants, signatures, shard and
     replay evidence) and a staging copy of the rank's own state, into buffers reused from the previous local
     save (save/local_staging.py); then step() returns;
  2. the tier's commit thread, collective on the tier's own gloo group: serialize the copy, digest the bytes
     (xxh3-128, the durable tier's algorithm) before they are written, write rank-R.pt under a temp name, the
     finite check, all_gather (digest, size, host, and the coordinator's refusal of a step this run wrote and
     the operator quarantined: save/local_aside.py), then the rename, or nothing published when refused;
  3. peer copies (save/peer_copy.py): each rank's bytes go to the same local rank on the next `replicas` nodes;
     the receiver checks them against the owner's digest and writes peer-rank-R.pt only if they match;
  4. the verdict as a durable save's (SaveEvidence.assess on the coordinator), the ledger row (local_tier_rows:
     tier `local`, per-rank digests, where each copy lives) and the retention plan (ops/retention.decide_local),
     broadcast; every rank removes the files of dropped steps; the verdict feeds the lineage like a durable one
     (live state found bad: LiveStateCorrupt at the next step() or save()).

Collision rule: a durable and a local save of the same step coexist (other table, other directory); at load the
durable one wins. A quarantined step reached again by a later run is saved anew, the quarantined run's folder
kept (save/local_aside.py). Loading a local candidate (save/local_restore.py, called by save/loading.py's walk-back through
`LocalTier.load`) re-verifies every rank's bytes by digest, own node first, else a peer copy fetched over the
group; all ranks agree through one all_reduce or the candidate is walked past like a durable one.
"""

from __future__ import annotations

import io
import socket
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from scout_ckpt.errors import ScoutError
from scout_ckpt.format.digests import bytes_digest
from scout_ckpt.ledger import aside
from scout_ckpt.ops.retention import decide_local
from scout_ckpt.save import local_aside, local_files, local_restore, peer_copy
from scout_ckpt.save import local_tier_rows as rows
from scout_ckpt.save import log as scout_log
from scout_ckpt.save.commit import ranked_causes
from scout_ckpt.save.loading import materialize
from scout_ckpt.save.local_files import rank_files
from scout_ckpt.save.local_orphans import WriterLease, sweep
from scout_ckpt.save.local_staging import StagingBuffers
from scout_ckpt.save.local_state import local_tree as _local_tree
from scout_ckpt.save.local_state import local_world_size
from scout_ckpt.save.local_state import nonfinite as _nonfinite

COORDINATOR = 0


class LocalTier:
    """One Checkpointer's fast tier. `ck` is the Checkpointer (its evidence, lineage, ledger and group)."""

    def __init__(self, opts, ck, timeout):
        self.opts, self.ck = opts, ck
        # the commit thread's own group (created here, at start-up, in the same order on every rank: docs/pytorch-facts.md)
        self._group = dist.new_group(backend="gloo", timeout=timeout)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_verdict: dict | None = None
        self.base = Path(opts.dir)
        self.rank, self.world = ck.rank, ck.world_size
        self.local_world = local_world_size(self.world)
        self.host = socket.gethostname()
        self.layout = {
            "world_size": self.world,
            "local_world_size": self.local_world,
            "mode": ck.mode,
            "mesh_shape": list(ck.mesh_shape),
        }
        self.holders = peer_copy.ring_holders(self.rank, self.world, self.local_world, opts.replicas)
        self.layout_told = False  # the INFO line of a layout that cannot restore: once (local_restore)
        self._warned_no_state = False
        self.last_blocking_s: float | None = None
        self.last_phases: dict | None = None
        self.last_loaded: dict | None = None  # {"step", "fetched": [ranks whose file came from a peer]}
        self.staging = StagingBuffers()  # reused from save to save (save/local_staging.py)
        # this rank's writer lease on DIR/RUN_ID, before it writes anything there; then the orphans of earlier
        # incarnations go (save/local_orphans.py)
        try:
            self.writer_lease: WriterLease | None = WriterLease.take(self.base / ck.run_id, self.rank)
        except OSError as e:  # never raised here: the other ranks are about to meet in the sweep's broadcast
            self.writer_lease = None  # (a DIR this rank cannot write fails its first local save, as before)
            scout_log.logger.warning("local tier: no writer lease in %s: %s", self.base / ck.run_id, e)
        self.swept = self._sweep_orphans()

    @property
    def node(self) -> int:
        return self.rank // self.local_world

    def due(self, step: int) -> bool:
        return step % self.opts.every == 0

    def step_dir(self, run_id: str, step: int) -> Path:
        return self.base / run_id / f"step-{step:08d}"

    def _sweep_orphans(self) -> list[str]:
        """Collective on the tier's group: the coordinator names this ROOT's earlier runs and the live rows'
        folders (nothing, when it does not hold ROOT's run lease or cannot read the ledger: could not check);
        local rank 0 of each node removes that node's orphaned step folders (local_orphans.sweep)."""
        known = None
        if self.rank == COORDINATOR:
            try:
                lease = getattr(self.ck.ledger, "run_lease", None)
                if lease is not None and lease.held:
                    earlier = {r["id"] for r in self.ck.ledger.runs()} - {self.ck.run_id}
                    live = {r["dir"] for r in rows.rows(self.ck.ledger) if r["state"] != "deleted"}
                    live |= aside.kept_dirs(self.ck.ledger)  # quarantined copies set aside (save/local_aside.py)
                    known = (earlier, live)
            except Exception as e:  # noqa: BLE001 - could not check: nothing is removed
                scout_log.logger.warning("local tier: orphaned step folders not checked: %s: %s", type(e).__name__, e)
        box = [known]
        dist.broadcast_object_list(box, src=COORDINATOR, group=self._group)
        if box[0] is None or self.rank % self.local_world != 0:
            return []
        removed = sweep(self.base, self.ck.run_id, *box[0])
        if removed:
            scout_log.logger.info(
                "local tier: removed %d orphaned step folder(s) of earlier runs on node %d "
                "(killed before their commit): %s",
                len(removed),
                self.node,
                ", ".join(removed),
            )
        return removed

    def close(self) -> None:
        """Wait for the pending commit, then free this rank's writer lease (its file stays, free)."""
        try:
            self.wait()
        finally:
            if self.writer_lease is not None:
                self.writer_lease.release()

    def warn_no_state(self) -> None:
        if not self._warned_no_state:
            self._warned_no_state = True
            scout_log.logger.warning(
                "local tier configured (every %d steps) but step() got no state: pass "
                "ckpt.step(step, state) to save to it",
                self.opts.every,
            )

    # ---- save ----------------------------------------------------------------------------------------------

    def on_step(self, step: int, state: dict | None) -> None:
        """Checkpointer.step's part: the local save when it is due."""
        if state is None:
            self.warn_no_state()
            return None
        if not self.due(step):
            return None
        with self.ck.phase("checkpoint"):
            if self.ck._async is not None:
                self.ck._async.wait()  # an async durable save still committing finishes first
            self.save(step, state)

    def save(self, step: int, state: dict) -> None:
        """Collective: the local save of the state after `step` optimizer steps (the module docstring). Blocks
        for the staging copy and the live evidence; the write, the peer copies and the commit run in this tier's
        commit thread on its own gloo group, and their outcome reaches the lineage (a live fault is raised at the
        next step()) and `last_verdict`; an error is raised at the next local save or `wait`."""
        ck, t0 = self.ck, time.monotonic()
        self.wait()
        ck._begin_boundary(step, state)
        flat = materialize(state)
        # consensus hashes and exchanges on its own groups in a background thread meanwhile (as during a durable
        # sync save's write): the training thread is held, so the state cannot change under it
        hashing = ck._start_consensus(flat, background=True)
        phases = {"begin": time.monotonic()}
        # the staging copy (training may change `flat` once we return), into the buffers of the previous save:
        # its commit thread, the buffers' only other reader, was joined by wait() above
        staged = self.staging.stage(flat)
        phases["stage"] = time.monotonic()
        live = ck._live_evidence(step, flat, hashing)
        phases["evidence"] = time.monotonic()
        del flat
        self._thread = threading.Thread(
            target=self._finish_guarded, args=(step, staged, live, t0, phases), name=f"scout-local-{step}", daemon=True
        )
        self._thread.start()
        self.last_blocking_s = time.monotonic() - t0

    def wait(self) -> None:
        """Block until the pending local commit has finished on this rank; raise its error once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        e, self._error = self._error, None
        if e is not None:
            raise ScoutError(f"local save failed: {type(e).__name__}: {e}") from e

    def _finish_guarded(self, step: int, staged: dict, live: dict, t0: float, phases: dict) -> None:
        try:
            self._finish(step, staged, live, t0, phases)
        except BaseException as e:  # noqa: BLE001 - latched, raised on the training thread (wait)
            self._error = e

    def _finish(self, step: int, staged: dict, live: dict, t0: float, phases: dict) -> None:
        """Commit thread, collective on the tier's own group: write, peer copies, verdict, ledger, retention."""
        ck, group = self.ck, self._group
        blob = self._serialize(staged)
        digest = bytes_digest(blob)
        finite_bad = _nonfinite(staged) if ck.finite else []
        del staged
        rel = f"{ck.run_id}/step-{step:08d}"
        own = self.base / rel / f"rank-{self.rank}.pt"
        # this run's save of a step it wrote and the operator quarantined is refused before any file is published
        # (save/local_aside.py); the coordinator's answer travels with the table below
        refused = self._refusal(step) if self.rank == COORDINATOR else None
        # A write that fails (a full or failing node-local disk) must not leave the other ranks in the gather
        # below: every rank goes through the whole protocol and the step is rejected for it (save/local_files).
        staged, failed = local_aside.stage(own, blob)
        table = [None] * self.world
        dist.all_gather_object(
            table,
            {
                "digest": digest,
                "size": len(blob),
                "host": self.host,
                "dir": str(self.base),
                "failed": failed,
                "refused": refused,
            },
            group=group,
        )
        refused = table[COORDINATOR]["refused"]
        if refused is not None:
            local_aside.discard(staged)
        elif staged is not None:
            failed = local_aside.publish(staged, own)
        ck._hook("local_written", step)  # fault injection (tests): the rank's file is written, nothing recorded
        phases["write"] = time.monotonic()
        copies = []
        # the same table on every rank: all skip the exchange alike when a rank's own file is missing (the step is
        # rejected: copies of it would only take space on disks that may be as full) or the save is refused
        if refused is None and not any(t["failed"] for t in table):
            for owner, data in peer_copy.ring_exchange(
                blob, self.rank, self.world, self.local_world, self.opts.replicas, group
            ).items():
                ok = bytes_digest(data) == table[owner]["digest"] and len(data) == table[owner]["size"]
                path = self.base / rel / f"peer-rank-{owner}.pt"
                copy = {
                    "rank": owner,
                    "holder": self.rank,
                    "host": self.host,
                    "node": self.node,
                    "path": str(path),
                    "verified": ok,
                }
                if ok:
                    error = local_files.try_write(path, data)
                    if error:  # the owner's own file stands; this copy is missing (`copies` evidence)
                        copy.update(verified=False, error=error)
                copies.append(copy)
        del blob
        phases["copies"] = time.monotonic()
        mine = {
            "rank": self.rank,
            "finite_bad": finite_bad,
            "copies": copies,
            "failed": failed,
            "files": []
            if failed or refused is not None
            else [
                {
                    "path": f"rank-{self.rank}.pt",
                    "size": table[self.rank]["size"],
                    "digest": digest,
                    "rank": self.rank,
                    "host": self.host,
                    "node": self.node,
                    "where": str(own),
                }
            ],
        }
        gathered = [None] * self.world if self.rank == COORDINATOR else None
        dist.gather_object(mine, gathered, dst=COORDINATOR, group=group)
        out = None
        if self.rank == COORDINATOR:
            assert gathered is not None
            unwritten = {g["rank"]: g["failed"] for g in gathered if g["failed"]}  # staged, or published
            if refused is not None:  # nothing was published: the quarantined copy is as it was
                out = ({"state": "rejected", "reasons": [refused]}, [])
            else:
                out = self._commit(step, rel, gathered, live, unwritten)
        box = [out]
        dist.broadcast_object_list(box, src=COORDINATOR, group=group)
        verdict, drops = box[0]
        self._remove(drops)
        ck.lineage.note(step, verdict, ledger=ck.ledger if ck.is_coordinator else None, run_id=ck.run_id)
        self.last_verdict = {"step": step, **verdict}
        marks, last = {}, t0
        for name, at in phases.items():
            marks[name], last = round(at - last, 4), at
        marks["commit"] = round(time.monotonic() - last, 4)
        self.last_phases = marks  # seconds per phase of the last save (bench/fast_tier.py reports them)
        if self.rank == COORDINATOR:
            scout_log.logger.info(
                "local step %d: %s, committed %.3f s after the save began (%d peer copies per rank)",
                step,
                verdict["state"],
                time.monotonic() - t0,
                len(self.holders),
            )

    def _serialize(self, flat: dict) -> bytes:
        buf = io.BytesIO()
        torch.save(_local_tree(flat), buf)
        return buf.getvalue()

    def _commit(self, step: int, rel: str, gathered: list[dict], live: dict, unwritten: dict[int, str]):
        """Coordinator: evidence and verdict (the durable save's SaveEvidence.assess), the ledger row, the
        retention plan. Returns (verdict, drops) for the broadcast; an error is a rejected verdict, never raised
        (every rank is waiting in the broadcast)."""
        ck = self.ck
        if unwritten:  # {rank: why its own file could not be written}, from the table every rank gathered
            return self._reject_unwritten(step, rel, gathered, unwritten)
        try:
            ev, signatures, v = ck._evidence.assess(gathered, live)
            verdict = {"state": v.state, "reasons": v.reasons}
            from scout_ckpt import policy

            live_fault = policy.live_faults(ev)
            if live_fault:
                verdict["live_fault"] = live_fault
            files = [f for g in gathered for f in g["files"]]
            copies = [c for g in gathered for c in g["copies"]]
            missing = sorted({f["rank"] for f in files} - {c["rank"] for c in copies if c["verified"]})
            if self.holders and missing:
                ev["copies"] = {"status": "fail", "ranks_without_verified_copy": missing}
            previous = rows.row(ck.ledger, step)
            if (
                previous is not None
                and previous["state"] == "quarantined"
                and not local_aside.set_aside(previous, ck.run_id)
            ):
                # quarantined by the operator during this save of this run's step: the decision stands
                why = {"code": "quarantined", "detail": local_aside.REFUSED}
                own = [] if previous.get("dir") == rel else [{"step": step, "dir": rel, "copies": copies}]
                return {"state": "rejected", "reasons": [why]}, own

            def record() -> None:
                rows.record(
                    ck.ledger,
                    step=step,
                    run_id=ck.run_id,
                    state=v.state,
                    dir=rel,
                    world_size=self.world,
                    layout=self.layout,
                    files=files,
                    copies=copies,
                    evidence=ev,
                    signatures=signatures,
                    reasons=v.reasons,
                )

            # a later run that reached a quarantined step: the earlier run's folder is kept, not dropped
            aside_ = local_aside.record_over(ck.ledger, step, previous, ck.run_id, record)
            drops = []
            if previous is not None and previous.get("dir") != rel and not aside_:
                drops.append({"step": step, "dir": previous["dir"], "copies": previous.get("copies") or []})
            every = {r["step"]: r for r in rows.rows(ck.ledger)}
            # a quarantined local step is kept, as retention keeps a durable one: the operator's to release
            plan = {s: r["state"] for s, r in every.items() if r["state"] != "quarantined"}
            for s in decide_local(plan, self.opts.keep):
                # a rejected step keeps why it was rejected beside why it went (`ls`, `explain` still say it)
                kept = (every[s].get("reasons") or [])[:8] if every[s]["state"] == "rejected" else []
                rows.set_state(
                    ck.ledger,
                    s,
                    "deleted",
                    [{"code": "retention", "keep": self.opts.keep}, *kept],
                    expect=every[s]["state"],
                )
                drops.append({"step": s, "dir": every[s]["dir"], "copies": every[s].get("copies") or []})
            return verdict, drops
        except Exception as e:  # noqa: BLE001 - see the docstring
            scout_log.logger.warning("local step %d not recorded: %s: %s", step, type(e).__name__, e)
            return {"state": "rejected", "reasons": [{"code": "commit_failed", "detail": repr(e)}]}, []

    def _refusal(self, step: int) -> dict | None:
        """Coordinator, in the commit thread before the table is gathered: local_aside.refusal, or None when the
        ledger cannot be read now (the commit checks the row again)."""
        try:
            return local_aside.refusal(self.ck.ledger, step, self.ck.run_id)
        except Exception as e:  # noqa: BLE001 - every rank is about to meet in the gather
            scout_log.logger.warning("local step %d: quarantine not checked: %s: %s", step, type(e).__name__, e)
            return None

    def _reject_unwritten(self, step: int, rel: str, gathered: list[dict], failed: dict[int, str]):
        """Coordinator: a rank could not write its file (a full node-local disk): nothing about the state was
        found wrong, so no live fault and training goes on; the step is rejected (`commit_failed`, the causes
        with their ranks, as a durable save's write failure) and every rank removes what it wrote of it. The
        next local save tries again."""
        causes: dict[str, list[int]] = {}
        for r, why in sorted(failed.items()):
            causes.setdefault(why, []).append(r)
        detail = ranked_causes(causes)
        reasons = [{"code": "commit_failed", "ranks": sorted(failed), "detail": detail}]
        scout_log.logger.warning(
            "local step %d not saved: %s; training goes on, the next local save tries again", step, detail
        )
        try:
            previous = rows.row(self.ck.ledger, step)
            # an earlier run's row of this step, in a folder of its own, stays as it is (its files are untouched)
            if previous is None or previous.get("dir") == rel:
                rows.record(
                    self.ck.ledger,
                    step=step,
                    run_id=self.ck.run_id,
                    state="rejected",
                    dir=rel,
                    world_size=self.world,
                    layout=self.layout,
                    files=[f for g in gathered for f in g["files"]],
                    copies=[],
                    evidence={},
                    signatures={},
                    reasons=reasons,
                )
        except Exception as e:  # noqa: BLE001 - the files go anyway: they never were a checkpoint
            scout_log.logger.warning("local step %d: its rejection was not recorded: %s: %s", step, type(e).__name__, e)
        return {"state": "rejected", "reasons": reasons}, [{"step": step, "dir": rel, "copies": []}]

    def _remove(self, drops: list[dict]) -> None:
        """Every rank: its own file and the peer copies it holds of each dropped step; then the emptied dirs."""
        for d in drops:
            step_dir = self.base / d["dir"]
            for _, path in rank_files(step_dir, self.rank, self.local_world):
                path.unlink(missing_ok=True)
            for p in (step_dir, step_dir.parent):
                try:
                    p.rmdir()
                except OSError:
                    pass

    # ---- load (save/local_restore.py) ----------------------------------------------------------------------

    def candidate(self, below: int | None) -> dict | None:
        """Coordinator: the newest certified local step below `below` that this job's layout can restore."""
        return local_restore.candidate(self, below)

    def load(self, state: dict, cand: dict, loader) -> list[dict]:
        """Collective: load `cand` into `state` re-verified by digest ([] when loaded, else the reasons)."""
        return local_restore.load(self, state, cand, loader)

    def reject(self, cand: dict, reasons: list[dict]) -> None:
        """Coordinator: a local candidate whose bytes or loaded values failed is rejected for good."""
        local_restore.reject(self, cand, reasons)
