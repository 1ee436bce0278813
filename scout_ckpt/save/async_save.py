"""The async save path of a Checkpointer: the staged copy, the commit thread, and the error it leaves behind.

Why a module of its own: an async save is a second protocol running beside training (a thread that begins, writes,
gathers evidence and commits on side groups of its own), with its own state (the thread, its error, the staging
buffer kept between saves). The Checkpointer decides *what* a save proves (its evidence and commit, shared by both
paths); this module decides *when and on which thread* an async save's steps run.

Protocol (every rank, in the same order): save() waits for the previous async save (`wait`), then

- POSIX ROOT (`start_posix`): the training thread holds only for what needs the live state: the staged copy (a
  memory copy into a buffer kept between saves, storage.StagingCache) and, where the evidence cannot come from
  that copy (`evidence_from_staged`), the live evidence. The commit thread then runs what a sync save runs, in the
  same order: the writing row and temp dir (Committer.begin, still before any byte is written), the DCP write of
  the staged copy with consensus hashing it meanwhile, the evidence, the commit. So save() blocks about as long as
  dcp.async_save's own staging.
- object store (`start_store`): the live evidence first, then dcp.async_save; the commit thread waits for the
  upload and commits.

Errors are latched, not thrown from the thread: a failed commit thread records its error (and tells the observer
this rank is a victim; on the coordinator, rejects the attempt's `writing` row, `commit_failed`, and removes what
it wrote, unless it was published), and the training thread raises it as ScoutError at its next
step()/save()/wait()/close().

Nothing here holds a reference to the Checkpointer between saves (the commit thread gets it as an argument and
drops it when it ends): a reference cycle would keep its process groups alive past destroy_process_group.
"""

from __future__ import annotations

import datetime
import threading

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from scout_ckpt.consensus.flatten import holds_dtensor
from scout_ckpt.consensus.in_flight import InFlightDigests
from scout_ckpt.errors import ScoutError
from scout_ckpt.save.loading import materialize
from scout_ckpt.save.storage import ScoutWriter, StagingCache


def evidence_from_staged(ck, flat: dict) -> bool:
    """Whether an async save may take its live evidence from the staged copy in the commit thread: only when
    no replay or shard evidence runs collectives on the side groups from the training thread meanwhile, and
    the state holds no DTensor (DCP's staging of those is not a plain copy)."""
    return ck.replay is None and ck.shard is None and not holds_dtensor(flat)


class AsyncSaves:
    """The pending async save of one Checkpointer (at most one at a time) and its two gloo side groups: `write_pg`
    for DCP's write, `commit_pg` for the commit's collectives (begin, evidence, finish). Created in the
    Checkpointer's constructor, on every rank in the same order (side groups are made at start-up)."""

    def __init__(self, timeout: datetime.timedelta):
        self.write_pg = dist.new_group(backend="gloo", timeout=timeout)
        self.commit_pg = dist.new_group(backend="gloo", timeout=timeout)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stage_cache: StagingCache | None = None  # POSIX: the host copy reused between saves

    @property
    def process_groups(self) -> list:
        return [self.write_pg, self.commit_pg]

    # ---- starting a save (training thread) ----------------------------------------------------------------

    def start_posix(self, ck, step: int, state: dict, attempt: str) -> None:
        """An async save to a POSIX ROOT (see the module docstring); returns once the state is staged."""
        pending = ck._committer.pending(step, attempt)
        if ck.shard is not None:
            ck._record_shard_faults(ck.shard.flush())
        flat = materialize(state)
        live = (
            None
            if evidence_from_staged(ck, flat)
            else ck._live_evidence(step, flat, ck._start_consensus(flat, background=False))
        )
        if self._stage_cache is None:
            self._stage_cache = StagingCache()
        writer = ScoutWriter(
            pending.tmp, step=step, fault_hook=ck.fault_hook, check_finite=ck.finite, stage_cache=self._stage_cache
        )
        staged = writer.stage(flat)
        del flat
        self._start(step, self._commit_posix, ck, pending, writer, staged, live)

    def start_store(self, ck, step: int, flat: dict, hashing, pending, writer) -> None:
        """An async save to an object store, after begin: the writer keeps no staged copy, so the evidence comes
        from the live state first; then dcp.async_save, and the commit thread waits for its upload."""
        live = ck._live_evidence(step, flat, hashing)
        resp = dcp.async_save(flat, storage_writer=writer, process_group=self.write_pg, planner=ck._plans.planner())
        upload = getattr(resp, "upload_completion", resp)
        self._start(step, self._commit_store, ck, upload, pending, writer, live)

    def _start(self, step: int, target, *args) -> None:
        self._thread = threading.Thread(target=target, args=args, name=f"scout-commit-{step}", daemon=True)
        self._thread.start()

    # ---- the commit thread --------------------------------------------------------------------------------

    def _commit_posix(self, ck, pending, writer, staged: dict, live: dict | None) -> None:
        """Begin, write, evidence (from the staged copy when `live` is None), commit; every collective on the
        async side groups, in the same order on every rank."""
        in_flight = InFlightDigests()  # the staged copy's consensus, partly signed by the writer as it writes
        try:
            ck._committer.begin(pending.step, pending.attempt, self.commit_pg, pending=pending)
            ck._hook("before_write", pending.step)
            hashing = ck._start_consensus(staged, background=True, in_flight=in_flight) if live is None else None
            writer.in_flight = in_flight
            dcp.save(staged, storage_writer=writer, process_group=self.write_pg, planner=ck._plans.planner())
            if live is None:  # the staged copy is the state at the save boundary; the commit waits for it
                live = ck._live_evidence(pending.step, staged, hashing, group=self.commit_pg)
            del staged, hashing
            ck._commit(pending, writer, live, self.commit_pg)
        except BaseException as e:  # surfaced on the training thread at the next step()/save()/wait()
            self._failed(ck, e, pending)
        finally:
            in_flight.release()

    def _commit_store(self, ck, upload, pending, writer, live: dict) -> None:
        """Waits for dcp.async_save's upload, commits."""
        try:
            upload.result()
            ck._commit(pending, writer, live, self.commit_pg)
        except BaseException as e:  # surfaced on the training thread at the next step()/save()/wait()
            self._failed(ck, e, pending)

    def _failed(self, ck, e: BaseException, pending) -> None:
        self._error = e
        if ck.observer is not None:  # a peer died during the commit: this rank is a victim, not the culprit
            ck.observer.heartbeat.error()
        if ck.is_coordinator:  # nothing was published: the row is settled now, not at the next start
            ck._committer.abandon(pending, e)

    # ---- the training thread's side -----------------------------------------------------------------------

    def join(self) -> None:
        """Block until the pending save's commit thread has ended (committed or failed); raises nothing."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait(self) -> None:
        """`join`, then raise the commit thread's error, if any (once)."""
        self.join()
        self.raise_error()

    def raise_error(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise ScoutError(f"async checkpoint failed: {e}") from e

    def release(self) -> None:
        """Drop the staging buffer (close)."""
        self._stage_cache = None
