"""The commit protocol of one save boundary: how the state at step S becomes a durable, recorded checkpoint.

Who calls what, in order (docs/design.md, "The commit protocol"); `Checkpointer` drives it and owns the evidence:

  1. Committer.begin        collective. Coordinator: flush any earlier unrecorded commit, the attempt's lease
                            (settle.take_lease: an flock held until 3b, so that no settler in another PID namespace
                            takes the save for dead), ledger row `writing` (refused for a quarantined step), temp
                            dir ROOT/.step-S.tmp-<attempt>/ with its owner record. Then one broadcast: every rank
                            goes on, or every rank raises SaveRefused.
  2. (Checkpointer)         all ranks: live evidence, then DCP writes into PendingSave.tmp. An async save stages
                            its copy first and runs 1, 2 and 3 in its commit thread (1 still precedes any write).
  3. Committer.finish       collective, once the write has finished everywhere. Every rank: PendingSave.local_files
                            (digests of the files *this rank* wrote) -> gather to the coordinator (in a job of
                            several nodes through each node's aggregator and its node manifest: save/node_manifest.py).
                            Coordinator:
     3a. _publish           the Checkpointer's `assess` turns the gathered digests + live evidence into evidence and
                            a verdict -> scout-manifest.json (fsync) -> owner record removed -> rename to step-S ->
                            fsync(ROOT). From here on the checkpoint is durable and the verdict is the manifest's.
     3b. _record            ledger commit (compare-and-set on this attempt's `writing` row) and fault events.
     3c. _retain            retention (keep=N).
                            3b and 3c never fail the save: an error is recorded as an event, an unrecorded commit
                            is retried at the next save and at close (and settled by settle_writing if the process
                            dies first: the manifest holds everything the ledger needs).
                            Then one broadcast: every rank returns the same verdict, or raises CommitError when 3a
                            failed (nothing was published).
  4. reconcile              coordinator, at start-up: settle `writing` rows left by a dead save (settle_writing, the
                            one function certify and gc use too) and remove temp dirs whose owner is provably dead.

What a SIGKILL leaves: before 3a's rename, no step-S directory (a temp dir whose owner record names the dead
process, removed by the next start; the `writing` row becomes rejected/save_interrupted); after it, a complete
step-S with its manifest (the `writing` row is completed from the manifest at the next start).

Two commit strategies (Orbax has the same pair, for the same reason): on POSIX, PendingSave publishes by rename;
on an object store, which has no rename, object_store.attempts.ObjectPendingSave writes every attempt under its
own prefix and publishes by writing the manifest last (conditional create). Steps 1-4 are the same for both; the
ledger row's `path` is the step dir or the attempt prefix. reconcile then also aborts dead attempts' multipart
uploads and removes their objects (object_store.attempts.sweep), each recorded in the ledger first.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from scout_ckpt import policy
from scout_ckpt.errors import CommitError, SaveRefused
from scout_ckpt.format import layout, manifest
from scout_ckpt.format.digests import digest_files
from scout_ckpt.ledger import Ledger, journal
from scout_ckpt.ops import retention
from scout_ckpt.ops.settle import settle_writing, take_lease, this_process_owner, tmp_dir_alive
from scout_ckpt.save import node_manifest
from scout_ckpt.save.set_aside import set_aside_quarantined

COORDINATOR = 0


def write_failure(e: BaseException) -> str:
    """One line for why a write failed: DCP's CheckpointException carries every failed rank's exception (its own
    str is their tracebacks); the first distinct causes are named with their ranks."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(e).__name__}: {e}".splitlines()[0][:300]
    causes: dict[str, list[int]] = {}
    for rank, pair in sorted(failures.items()):
        exc = pair[0] if isinstance(pair, tuple) else pair
        seen = exc
        while seen is not None and not isinstance(seen, OSError):  # torch.save's RuntimeError hides ENOSPC
            seen = seen.__cause__ or seen.__context__
        exc = seen if seen is not None else exc
        causes.setdefault(f"{type(exc).__name__}: {exc}".splitlines()[0][:200], []).append(rank)
    return ranked_causes(causes, limit=3)


def ranked_causes(causes: dict[str, list[int]], limit: int | None = None) -> str:
    """{cause: [ranks]} as one line, "cause (ranks 0, 1); other (ranks 2)", the first `limit` causes."""
    return "; ".join(f"{cause} (ranks {', '.join(map(str, ranks))})" for cause, ranks in list(causes.items())[:limit])


@dataclass(frozen=True)
class PendingSave:
    """One save attempt's temp dir: ROOT/.step-S.tmp-<attempt>/ (Orbax's TemporaryPath, for DCP).

    create         coordinator only, before any rank writes: mkdir + owner record (layout.create_tmp_dir). No
                   barrier here: Committer.begin's broadcast is the barrier that orders it before every write.
    local_files    every rank, after DCP finished: the files this rank wrote, with sizes and digests.
    finalize       coordinator only, after every rank's digests arrived: manifest, owner record dropped, atomic
                   rename to step-S. Returns the manifest's digest.
    """

    root: Path
    step: int
    attempt: str

    @property
    def name(self) -> str:
        """What the ledger row records as the checkpoint's path (relative to ROOT)."""
        return layout.step_dirname(self.step)

    @property
    def tmp(self) -> Path:
        return self.root / layout.tmp_dirname(self.step, self.attempt)

    @property
    def final(self) -> Path:
        return layout.step_path(self.root, self.step)

    def create(self, owner: dict) -> None:
        layout.create_tmp_dir(self.tmp, owner)

    def local_files(self, writer, rank: int) -> list[dict]:
        mine = sorted(writer.written | ({layout.DCP_METADATA} if rank == COORDINATOR else set()))
        known = writer.file_digests()  # hashed in flight; the rest (.metadata) is read back
        read_back = digest_files([self.tmp / f for f in mine if f not in known])
        known.update({Path(p).name: d for p, d in read_back.items()})
        return [{"path": f, "size": known[f][0], "digest": known[f][1], "rank": rank} for f in mine]

    def finalize(self, m: dict, hook: Callable[[str, int], None]) -> str:
        # the temp dir's fsync is commit_dir's, before the rename: it makes the manifest's entry and the owner
        # record's removal durable together (one fsync of the directory instead of two)
        digest = manifest.write(self.tmp, m, sync_dir=False)
        hook("before_rename", self.step)
        layout.drop_owner(self.tmp)
        layout.commit_dir(self.tmp, self.final)
        return digest

    def published(self) -> bool:
        """Whether the rename happened (the step is durable whatever the error after it)."""
        return self.final.is_dir() and not self.tmp.exists()

    def nbytes(self, files: list[dict]) -> int:
        return layout.dir_bytes(self.final)

    def discard(self) -> None:
        """Coordinator, after a failed publish: this process owns the temp dir and knows the save is dead."""
        shutil.rmtree(self.tmp, ignore_errors=True)


# assess(gathered) -> (evidence, signatures, verdict): the Checkpointer's evidence gathering (coordinator only).
Assess = Callable[[list[dict]], "tuple[dict, dict, policy.Verdict]"]


@dataclass
class Committer:
    """The commit protocol for one Checkpointer. `ledger` is the coordinator's (None on other ranks);
    `manifest_fields` are the run's fixed manifest entries (world_size, topology, policy, invariants, versions);
    `store` the object_store.store.ObjectStore when the checkpoints live on an object store (None: POSIX ROOT;
    `root` is then the ledger_dir)."""

    root: Path
    run_id: str
    rank: int
    ledger: Ledger | None
    manifest_fields: dict
    keep: int | None = None
    hook: Callable[[str, int], None] = lambda point, step: None
    unrecorded: list[dict] = field(default_factory=list)  # durable commits the ledger has not taken yet
    unrecorded_events: list[dict] = field(default_factory=list)  # bookkeeping errors the ledger did not take
    store: object | None = None
    leases: dict = field(default_factory=dict)  # attempt -> settle.Lease held by the coordinator for a save

    def pending(self, step: int, attempt: str):
        if self.store is not None:
            from scout_ckpt.object_store.attempts import ObjectPendingSave

            return ObjectPendingSave(self.store, step, attempt)
        return PendingSave(self.root, step, attempt)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == COORDINATOR

    # ---- 1. begin --------------------------------------------------------------------------------------------

    def begin(self, step: int, attempt: str, group, pending=None) -> PendingSave:
        """Collective on `group`: the `writing` row and the temp dir exist before any rank writes data (DCP's
        central planning waits for the coordinator, which gets there only after this), or every rank raises.
        `pending` (from `pending(step, attempt)`): an async save names its temp dir, stages and returns to
        training first, and begins in its commit thread, still before any byte is written."""
        pending = pending if pending is not None else self.pending(step, attempt)
        refusal = None
        if self.is_coordinator:
            self.flush()
            owner = this_process_owner()
            try:
                if self.ledger.run_lease is not None:  # another job saving into this ROOT: refused
                    self.ledger.run_lease.check()
                # the lease first: from the moment the `writing` row exists, a held lock says the save is alive
                self.leases[attempt] = take_lease(self.root, attempt)
                before = self.ledger.checkpoint(step)
                if (
                    self.store is None
                    and before is not None
                    and before["state"] == "quarantined"
                    and before.get("run_id") != self.run_id  # a later incarnation: it resumed from before step
                ):
                    set_aside_quarantined(
                        self.ledger, self.root, step, before, pending.name, source="save", run_id=self.run_id
                    )
                self.ledger.record_writing(
                    step, self.run_id, attempt, pending.name, owner=owner, keep_certified=True, over_quarantined=True
                )
                pending.create({"run_id": self.run_id, "attempt": attempt, **owner})
            except Exception as e:  # every rank must still reach the broadcast below
                refusal = str(e) or type(e).__name__
                self._release_lease(attempt)  # no save in flight: a settler may decide the row by its owner
        refusal = _broadcast(refusal, group)
        if refusal is not None:
            raise SaveRefused(f"checkpoint {step} not saved: {refusal}")
        return pending

    # ---- 3. finish -------------------------------------------------------------------------------------------

    def finish(self, pending, writer, group, assess: Assess) -> dict:
        """Collective on `group`, after DCP's write finished on every rank: returns the verdict
        {"state", "reasons"} on every rank, or raises CommitError on every rank if nothing was published."""
        files = pending.local_files(writer, self.rank)
        report = {"rank": self.rank, "files": files, "finite_bad": writer.nonfinite}
        world = dist.get_world_size(group)
        nodes = node_manifest.plan(self.rank, world) if world == dist.get_world_size() else None
        if nodes is None:  # one node: every rank's rows to the coordinator
            gathered = _gather(report, group)
        else:  # many nodes: a node manifest per node (a file of the temp dir, or an object of the attempt)
            store = self.store
            target = pending.tmp if store is None else (lambda rel, data: store.write_object(pending.name, rel, data))
            gathered = node_manifest.gather(nodes, self.rank, report, target, pending.step, pending.attempt, group)
        verdict = None
        if self.is_coordinator:
            verdict = self._publish(pending, gathered, assess)
        verdict = _broadcast(verdict, group)
        if verdict["state"] == "error":
            raise CommitError(f"checkpoint {pending.step} failed to commit: {verdict['reasons'][0]['detail']}")
        return verdict

    def _publish(self, pending, gathered: list[dict], assess: Assess) -> dict:
        """Coordinator: 3a, then (only once durable) 3b and 3c."""
        try:
            failed = [g["error"] for g in gathered if g.get("error")]
            if failed:  # a node manifest was not written: nothing may be published without it
                raise OSError("; ".join(failed[:3]))
            files = [f for g in gathered for f in g["files"]]
            ev, signatures, v = assess(gathered)
            verdict = {"state": v.state, "reasons": v.reasons}
            live_fault = policy.live_faults(ev)
            if live_fault:  # every rank learns it with the verdict: the lineage is tainted (Checkpointer.save)
                verdict["live_fault"] = live_fault
            m = manifest.build(
                step=pending.step,
                run_id=self.run_id,
                attempt=pending.attempt,
                files=files,
                evidence=ev,
                verdict=verdict,
                signatures=signatures,
                **self.manifest_fields,
            )
            digest = pending.finalize(m, self.hook)
        except BaseException as e:  # every rank must still reach the verdict broadcast
            self.abandon(pending, e)
            return {"state": "error", "reasons": [{"code": "commit_failed", "detail": repr(e)}]}
        try:
            self.hook("after_rename", pending.step)
            self._record(
                {
                    "step": pending.step,
                    "run_id": self.run_id,
                    "path": pending.name,
                    "nbytes": pending.nbytes(files),
                    "manifest_digest": digest,
                    "files": files,
                    "evidence": ev,
                    "state": v.state,
                    "reasons": v.reasons,
                    "attempt": pending.attempt,
                }
            )
        finally:
            # published (and recorded, or kept for flush: a settler completes it from the manifest alike)
            self._release_lease(pending.attempt)
        self._retain(pending.step)
        return verdict

    def _release_lease(self, attempt: str) -> None:
        lease = self.leases.pop(attempt, None)
        if lease is not None:
            lease.release()

    def abandon(self, pending, error: BaseException) -> None:
        """Coordinator, after a save that failed before its publish (here, or an async save's commit thread): the
        `writing` row becomes rejected (`commit_failed`, the error) and the temp dir or the attempt's objects go,
        now rather than at the next start. Nothing is touched if the step was published. Idempotent; never
        raises (a failure is a `bookkeeping_error` event)."""
        try:
            published = pending.published()
        except Exception:
            return  # cannot tell (the store is unreachable): leave it to settle_writing, never delete (lease held)
        if published:  # the commit happened: the step is durable and settle_writing completes it from the manifest
            self._release_lease(pending.attempt)
            return

        # The rejection is recorded before anything is deleted (on an object store: the intent comes first). When
        # the disk is full the record itself may fail: the unpublished data is removed anyway (it never was a
        # checkpoint), and the record is tried again in the space that freed.
        def record() -> None:
            journal.record_transition(
                self.ledger,
                self.root,
                pending.step,
                "rejected",
                [{"code": "commit_failed", "detail": write_failure(error)}],
                source="save",
                expect="writing",
                attempt=pending.attempt,
            )

        recorded = self._guard("commit_failed_cleanup", pending.step, record)
        self._guard("commit_failed_discard", pending.step, pending.discard)
        if not recorded:
            self._guard("commit_failed_cleanup", pending.step, record)
        self._release_lease(pending.attempt)

    # ---- 3b. record ------------------------------------------------------------------------------------------

    def _record(self, commit: dict) -> None:
        """Ledger commit and the events of live faults. A failure (busy timeout, disk full) keeps the commit for
        a retry: the checkpoint is durable whatever the ledger says."""
        ok = self._guard("ledger_commit", commit["step"], lambda: self._apply(commit))
        if not ok:
            self.unrecorded.append(commit)

    def _apply(self, commit: dict) -> None:
        c = dict(commit)
        step = c.pop("step")
        if self.ledger.record_commit(step, **c):  # False: the row changed meanwhile (kept as superseded)
            journal.journal_verdict(
                self.root, step, c["attempt"], c["manifest_digest"], c["state"], c["reasons"], "save"
            )
        self._record_live_faults(step, commit["evidence"])

    def _record_live_faults(self, step: int, ev: dict) -> None:
        """A fault found in the live state at a save boundary is also an event naming the rank(s): `sdc` where some
        ranks' state is wrong, `divergence` where every rank's state fails the same invariant (NaN everywhere is
        the training's numerics, not one chip: a restart from the same state diverges again)."""
        world = int(self.manifest_fields.get("world_size") or 0)
        failed = [r for r in (ev.get("invariants") or {}).get("reasons") or [] if r.get("code") == "invariant_failed"]
        everywhere = world > 0 and {x for r in failed for x in (r.get("ranks") or [])} >= set(range(world))
        if everywhere:
            checks = sorted({str(r.get("check")) for r in failed})
            self.ledger.add_event(
                "divergence",
                step=step,
                ranks=list(range(world)),
                run_id=self.run_id,
                detail={
                    "source": "invariants",
                    "checks": checks,
                    "tensors": [t for r in failed for t in (r.get("tensors") or [])][:8],
                    "reason": "every rank's state fails the invariant: the run diverged",
                },
            )
        for kind, codes in (
            ("consensus", ("consensus_attributed", "consensus_inconclusive")),
            ("invariants", () if everywhere else ("invariant_failed",)),
            ("at_rest", ("at_rest_changed",)),
        ):
            for r in (ev.get(kind) or {}).get("reasons") or []:
                if r.get("code") in codes:
                    self.ledger.add_event(
                        "sdc",
                        step=step,
                        ranks=r.get("ranks") or [],
                        run_id=self.run_id,
                        detail={"source": kind, **{k: v for k, v in r.items() if k != "ranks"}},
                    )

    def flush(self) -> None:
        """Coordinator: retry commits and events the ledger did not take (at the next save and at close)."""
        pending, self.unrecorded = self.unrecorded, []
        for commit in pending:
            self._record(commit)
        events, self.unrecorded_events = self.unrecorded_events, []
        for e in events:
            try:
                self.ledger.add_event("bookkeeping_error", **e)
            except Exception:
                self.unrecorded_events.append(e)

    # ---- 3c. retain ------------------------------------------------------------------------------------------

    def _retain(self, step: int) -> None:
        if not self.keep:
            return

        def run():
            self.hook("retention", step)
            retention.apply(self.ledger, self.root, self.keep, store=self.store, sweep=False)

        self._guard("retention", step, run)

    # ---- bookkeeping errors ----------------------------------------------------------------------------------

    def _guard(self, what: str, step: int, fn: Callable[[], object]) -> bool:
        """Run post-commit bookkeeping; an exception becomes a `bookkeeping_error` event (kept for flush() and
        said on stderr if the ledger cannot take the event either) instead of failing a save already durable."""
        try:
            fn()
            return True
        except Exception as e:
            event = {
                "step": step,
                "run_id": self.run_id,
                "when": time.time(),
                "detail": {"what": what, "error": f"{type(e).__name__}: {e}"},
            }
            try:
                self.ledger.add_event("bookkeeping_error", **event)
            except Exception as e2:  # the ledger is busy too: keep the event for flush()
                self.unrecorded_events.append(event)
                print(
                    f"scout-ckpt: step {step}: {what} failed after the commit ({e}); event kept for later ({e2})",
                    file=sys.stderr,
                )
            return False


# ---- 4. start-up ---------------------------------------------------------------------------------------------


def reconcile(ledger: Ledger, root: Path, *, source: str = "startup", store=None) -> dict:
    """Coordinator, before its first save: finish what a dead save left. `writing` rows go to settle_writing
    (left alone while their owner lives); a temp dir is removed only when its owner is provably dead, so another
    process's save in flight on the same ROOT is never touched. Trash dirs (already out of the step-* namespace)
    are removed. On an object store (`store`), dead attempts' multipart uploads are aborted and their objects
    removed (object_store.attempts.sweep: listed before the ledger is read, recorded before deleted)."""
    if store is not None:
        from scout_ckpt.object_store.attempts import sweep

        settled = settle_writing(ledger, root, source=source, store=store)
        return {"settled": settled, **sweep(ledger, store, source=source), "time": time.time()}
    settled = settle_writing(ledger, root, source=source)
    removed, left = [], []
    for tmp in layout.list_tmp_dirs(root):
        if layout.TRASH_RE.match(tmp.name) or tmp_dir_alive(root, tmp) is False:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp.name)
        else:
            left.append(tmp.name)
    return {"settled": settled, "removed": removed, "left": left, "time": time.time()}


# The first broadcast of _broadcast carries the payload's length and up to this many bytes of it: a refusal or a
# verdict fits, so the common case is one collective instead of broadcast_object_list's two (size, then data).
_FIRST = 4096


def _broadcast(obj, group):
    """`obj` from the coordinator on every rank of `group` (pickled, as broadcast_object_list does): one
    fixed-size broadcast, and a second one only for a payload longer than _FIRST - 8 bytes (every rank reads the
    length from the first, so all make the same second call or none)."""
    import pickle

    mine = dist.get_rank() == COORDINATOR
    buf = torch.zeros(_FIRST, dtype=torch.uint8)
    data = b""
    if mine:
        data = pickle.dumps(obj)
        head = data[: _FIRST - 8]
        buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        if head:
            buf[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    dist.broadcast(buf, src=COORDINATOR, group=group)
    n = int(buf[:8].view(torch.int64)[0])
    rest = n - (_FIRST - 8)
    if rest > 0:
        tail = (
            torch.frombuffer(bytearray(data[_FIRST - 8 :]), dtype=torch.uint8)
            if mine
            else torch.empty(rest, dtype=torch.uint8)
        )
        dist.broadcast(tail, src=COORDINATOR, group=group)
    if mine:
        return obj
    payload = buf[8 : 8 + min(n, _FIRST - 8)].numpy().tobytes() + (tail.numpy().tobytes() if rest > 0 else b"")
    return pickle.loads(payload)  # the coordinator's own pickle, trusted as broadcast_object_list trusts it


def _gather(obj, group) -> list | None:
    out = [None] * dist.get_world_size(group) if dist.get_rank(group) == COORDINATOR else None
    dist.gather_object(obj, out, dst=COORDINATOR, group=group)
    return out
