"""Loading with walk-back: a restarted job loads the newest certified checkpoint whose bytes and loaded values
match what was saved, rejecting each one that does not and falling back to the next older one, in one call.

Why a module of its own, beside replay_evidence.py and shard_evidence.py: the load path shares nothing with the
save path but the process group and the ledger. It has its own protocol (choose on the coordinator, verify bytes
on every rank, load, compare the loaded values' signatures with the manifest's, reject and walk back) and its own
failure modes (a damaged candidate is the checkpoint's fault and is rejected; one whose files could not be read
now, an I/O error with no fault found, is passed over for this load and keeps its state; a state without places
for the saved values is the caller's and raises). Kept apart, `Checkpointer` stays a facade over save, load and
shutdown, and a framework's checkpoint manager (integrations/) can read one module to do the same walk-back.

Every function here is collective over `LatestCleanLoader.group` unless it says "coordinator"; every rank gets
the same outcome (the candidate is broadcast, byte verdicts are all_gathered, signatures come from one
all_reduce), so no rank walks back while another loads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from scout_ckpt import policy
from scout_ckpt.consensus.full import REPLICA_PREFIX, full_signatures
from scout_ckpt.consensus.mesh import full_signable
from scout_ckpt.consensus.signatures import flatten_state
from scout_ckpt.errors import (
    CheckpointsUnreadable,
    CheckpointsUnverified,
    LoadVerificationError,
    ScoutError,
    StateOverwritten,
)
from scout_ckpt.format.verify import COULD_NOT_CHECK, only_unchecked, verify_files
from scout_ckpt.ledger import Ledger, journal
from scout_ckpt.ops.rebuild_ledger import UNVERIFIED
from scout_ckpt.ops.recovery import record_verification_failure, trusted_manifest
from scout_ckpt.save import local_tier_rows as local_rows
from scout_ckpt.save import log as scout_log
from scout_ckpt.save.verified_reader import VerifiedFileSystemReader, is_metadata_changed

COORDINATOR = 0


def materialize(state: dict) -> dict:
    """Shallow copy with Stateful values replaced by their state_dict(): what DCP itself would save."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}


@dataclass
class LatestCleanLoader:
    """The walk-back load of one Checkpointer. `ledger` is the coordinator's (None on other ranks); `store` the
    object store when the checkpoints live on one (None: POSIX `root`); `hook(point, step)` the fault hook
    (called at after_load)."""

    root: Path
    rank: int
    world_size: int
    group: object
    ledger: Ledger | None
    run_id: str
    verify_load: bool
    hook: Callable[[str, int], None]
    store: object | None = None
    local: object | None = None  # save/local_tier.LocalTier: its certified steps are candidates too

    @property
    def last_tier(self) -> str | None:
        return getattr(self, "_tier", None)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == COORDINATOR

    def load(self, state: dict) -> int | None:
        """Collective: load the newest certified checkpoint that verifies into `state`; its step, or None when
        none is left (see Checkpointer.load_latest_clean)."""
        below = below_local = None
        t0 = time.monotonic()
        self._latched: str | None = None
        self._tier = None
        # certified steps passed over because they could not be read now (the same list on every rank: the
        # reasons are all-gathered); none left to load then is a refusal, never a fresh start over them
        self._unchecked: list[tuple[int, str, list[dict]]] = []
        # the step whose values a load put into `state` before they were found not to match (None: untouched)
        self._overwritten: int | None = None
        while True:
            cand = self._broadcast(self._next(below, below_local) if self.is_coordinator else None)
            if isinstance(cand, dict) and "latched" in cand:  # the same error on every rank, none left waiting
                raise ScoutError(cand["latched"])
            if isinstance(cand, dict) and "unverified" in cand:  # none left, but steps a rebuild could not vouch for
                if self._unchecked:
                    raise CheckpointsUnreadable(self._unreadable_text())
                raise CheckpointsUnverified(cand["unverified"])
            if isinstance(cand, dict) and cand.get("tier") == "local":
                if self._load_local(state, cand, t0):
                    return cand["step"]
                below_local = cand["step"]
                continue
            if cand is None:
                if self._unchecked:
                    raise CheckpointsUnreadable(self._unreadable_text())
                if self._overwritten is not None:
                    raise StateOverwritten(self._overwritten_text())
                if self.is_coordinator:
                    scout_log.fresh_start(
                        self.rank,
                        str(self.root),
                        [r for r in self.ledger.checkpoints(states=("committed", "writing", "rejected"))],
                    )
                return None
            step_dir = self.root / cand["path"] if self.store is None else self.store.uri_of(cand["path"])
            failed = cand["reasons"] + self._verify_bytes(cand, step_dir)
            if failed:
                # the same reasons on every rank (all_gathered), so every rank takes the same branch
                self._walk_past(cand["step"], failed)
                below = cand["step"]
                continue
            rank_local = _begin_rank_local(state, cand.get("world_size"))
            try:
                self._overwritten = cand["step"]  # from here `state` may hold some of its values
                differ = self._load_and_check(state, cand, step_dir)
            except CheckpointException as e:  # raised by DCP on every rank alike (it gathers the ranks' errors)
                failed = self._load_failure(e)
                if failed is None:
                    raise
                self._walk_past(cand["step"], failed)  # a file gone since verification: could not check
                below = cand["step"]
                continue
            finally:
                for v in rank_local:
                    v.end_load()
            if differ:
                self._on_coordinator(cand["step"], lambda c=cand, d=differ: self._reject_load_mismatch(c, d))
                scout_log.skipped(self.rank, cand["step"], [{"code": "load_mismatch", "tensors": differ[:4]}])
                below = cand["step"]
                continue
            if self.is_coordinator:
                try:  # bookkeeping: the load itself stands if it cannot be recorded
                    self.ledger.set_resumed_from(self.run_id, cand["step"])
                    self.ledger.mark_checked(cand["step"], ("bytes",), source="load")
                except Exception as e:  # noqa: BLE001
                    scout_log.logger.warning(
                        "resumed from step %d, but the ledger did not record it: %s: %s",
                        cand["step"],
                        type(e).__name__,
                        e,
                    )
            self._tier = "durable"
            scout_log.resumed(
                self.rank,
                cand["step"],
                str(step_dir),
                files=len(cand["files"]),
                nbytes=sum(f.get("size") or 0 for f in cand["files"]),
                ranks=self.world_size,
                signatures=bool(self.verify_load and cand["signatures"]),
                seconds=time.monotonic() - t0,
            )
            return cand["step"]

    def _walk_past(self, step: int, failed: list[dict]) -> None:
        """Every rank, with the same reasons: an I/O error with no fault found is walked past now and rejects
        nothing (could not check); anything else is recorded as the step's verification failure (coordinator,
        journal first) and the step is skipped."""
        if only_unchecked(failed):
            scout_log.could_not_check(self.rank, step, failed)
            self._unchecked.append((step, "durable", failed))
            return
        self._on_coordinator(
            step,
            lambda: record_verification_failure(
                self.ledger, step, policy.evidence(policy.FAIL, failed), source="load", root=self.root
            ),
        )
        scout_log.skipped(self.rank, step, failed)

    def _unreadable_text(self) -> str:
        """One line: which certified steps could not be read, why, and what to do."""
        from scout_ckpt.ops.views import reason_text

        steps = ", ".join(f"{s}" + (" (local)" if tier == "local" else "") for s, tier, _ in self._unchecked)
        return (
            f"refusing to start from step 0: certified checkpoint(s) {steps} under {self.root} could not be "
            f"read now ({reason_text(self._unchecked[0][2])}); nothing was rejected. Retry once the storage "
            f"answers (torchrun --max-restarts retries the job), or check it with `scout-ckpt resume "
            f"{self.root} --latest-clean`"
        )

    def _overwritten_text(self) -> str:
        """One line: the state passed in holds a rejected checkpoint's values and no older one is left."""
        return (
            f"refusing to start: load_latest_clean loaded checkpoint {self._overwritten} under {self.root} into "
            f"the state passed in, found its values did not match what was certified (rejected, or could not "
            f"be loaded whole), and no older certified checkpoint is left; the state holds those values, so "
            f"the job must not train on it. Restart the job (torchrun --max-restarts does): a fresh process "
            f"starts from fresh state"
        )

    def _load_local(self, state: dict, cand: dict, t0: float) -> bool:
        """Collective: a fast-tier candidate (save/local_tier.LocalTier.load re-verifies every rank's bytes); on
        failure the same reasons on every rank, the step rejected unless nothing could be checked."""
        failed = self.local.load(state, cand, self)
        if any(r.get("code") == "load_mismatch" for r in failed):  # applied, then found not to match
            self._overwritten = cand["step"]
        if failed:
            self._on_coordinator(cand["step"], lambda: self.local.reject(cand, failed))
            (scout_log.could_not_check if only_unchecked(failed) else scout_log.skipped)(
                self.rank, cand["step"], failed
            )
            if only_unchecked(failed):
                self._unchecked.append((cand["step"], "local", failed))
            return False
        if self.is_coordinator:
            try:
                self.ledger.set_resumed_from(self.run_id, cand["step"])
            except Exception as e:  # noqa: BLE001 - the load stands if it cannot be recorded
                scout_log.logger.warning("resumed from local step %d, unrecorded: %s", cand["step"], e)
        self._tier = "local"
        scout_log.resumed(
            self.rank,
            cand["step"],
            f"local:{cand['path']}",
            files=len(cand["files"]),
            nbytes=sum(f.get("size") or 0 for f in cand["files"]),
            ranks=self.world_size,
            signatures=bool(self.verify_load and cand["signatures"]),
            seconds=time.monotonic() - t0,
        )
        return True

    def _next(self, below: int | None, below_local: int | None = None) -> dict | None:
        """Coordinator: what the next broadcast carries: the next candidate (the newer of the durable tier's and
        the local tier's; a durable step wins at the same step), or {"latched": message} when a
        coordinator-only step failed (the other ranks are already waiting in this broadcast)."""
        if self._latched is None:
            try:
                durable = self._candidate(below)
                local = self.local.candidate(below_local) if self.local is not None else None
                if local is not None and (durable is None or local["step"] > durable["step"]):
                    return local
                return durable if durable is not None else self._unverified()
            except Exception as e:  # noqa: BLE001 - carried to every rank, raised there as a ScoutError
                self._latched = f"load_latest_clean could not choose a checkpoint: {type(e).__name__}: {e}"
        return {"latched": self._latched}

    def _unverified(self) -> dict | None:
        """Coordinator, when no candidate is left: {"unverified": message} when steps exist whose trust a ledger
        rebuild could not re-establish (committed, `unverified_after_rebuild`): a fresh start would train over
        them and replace them. None otherwise (a new run, or only rejected steps: a fresh start is the answer)."""
        rows = [
            r
            for r in self.ledger.checkpoints(states=("committed",))
            if any(x.get("code") == UNVERIFIED for x in r.get("reasons") or [])
        ]
        if not rows:
            return None
        steps = ", ".join(str(r["step"]) for r in reversed(rows[-8:]))
        return {
            "unverified": (
                f"refusing to start from step 0: checkpoint(s) {steps} under {self.root} exist, but a ledger rebuild "
                f"could not re-establish their certificates ({UNVERIFIED}: the journal {journal.JOURNAL_NAME} that "
                f"vouched for them is missing or broken) and no certified checkpoint is left. Restore the journal and "
                f"run `scout-ckpt ledger rebuild {self.root}`, or give a run that should start afresh its own ROOT"
            )
        }

    def _on_coordinator(self, step: int, record: Callable[[], None]) -> None:
        """Coordinator: record a trust-lowering verdict (journal first, then ledger: journal.record_transition).
        A failure is latched, not raised here: every rank raises it together at the next broadcast, and nothing
        is loaded from a walk-back whose rejection is not on record."""
        if not self.is_coordinator or self._latched is not None:
            return
        try:
            record()
        except Exception as e:  # noqa: BLE001
            self._latched = (
                f"could not record that checkpoint {step} failed verification ({type(e).__name__}: "
                f"{e}); nothing was loaded. The journal ({journal.JOURNAL_NAME}) and the ledger "
                f"under {self.root} must be writable"
            )

    @staticmethod
    def _load_failure(e: BaseException) -> list[dict] | None:
        """The reasons of a DCP load that failed for the candidate's sake, or None when it is the caller's (a
        state that does not fit): a `.metadata` changed since verification is damage (digest_mismatch); a file
        that could not be opened or read now is could-not-check (the next verification sees what it is)."""
        if is_metadata_changed(e):
            return [{"code": "digest_mismatch", "file": ".metadata", "detail": "changed after verification"}]
        failures = getattr(e, "failures", None) or {}
        errors = [v for v in failures.values() if isinstance(v, BaseException)]
        if errors and all(isinstance(x, OSError) for x in errors):
            return [{"code": COULD_NOT_CHECK, "detail": f"load: {type(errors[0]).__name__}: {errors[0]}"}]
        return None

    def _load_and_check(self, state: dict, cand: dict, step_dir) -> list[str]:
        """Collective: DCP loads the candidate into `state`; the saved tensors whose loaded values differ. The
        `.metadata` pickle is unpickled only if its bytes hash to the verified digest (save/verified_reader.py)."""
        if self.store is None:
            dcp.load(
                state,
                storage_reader=VerifiedFileSystemReader(str(step_dir), cand["metadata_digest"]),
                process_group=self.group,
            )
        else:  # .metadata is unpickled only if its digest is the verified one
            from scout_ckpt.save.object_store_io import reader_for  # fsspec: only for an object store

            dcp.load(
                state,
                storage_reader=reader_for(self.store, cand["path"], cand["metadata_digest"]),
                process_group=self.group,
            )
        self.hook("after_load", cand["step"])
        return self._loaded_differences(cand["step"], cand["signatures"], state)

    def _broadcast(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=COORDINATOR, group=self.group)
        return box[0]

    def _verify_bytes(self, cand: dict, step_dir) -> list[dict]:
        """Collective: each rank re-hashes a disjoint share of the candidate's files; every rank gets all reasons."""
        share = cand["files"][self.rank :: self.world_size]
        ev = (
            verify_files(step_dir, share, expect_complete=False)
            if self.store is None
            else self.store.verify(cand["path"], share, expect_complete=False)
        )
        results = [None] * self.world_size
        dist.all_gather_object(results, ev, group=self.group)
        return [r for e in results for r in e["reasons"]]

    def _candidate(self, below: int | None) -> dict | None:
        """Coordinator: the newest certified step below `below`, its files, and its manifest's signatures (or the
        reason the manifest cannot be trusted)."""
        while True:
            row = self.ledger.latest("certified", below=below)
            if row is None:
                return None
            copy = local_rows.row(self.ledger, row["step"])
            if copy is None or not policy.step_distrusted(copy["state"], copy.get("reasons") or []):
                break
            # a verdict on the step reached through its local copy (a quarantine, a revocation, a lineage taint)
            # holds for the durable folder too
            scout_log.logger.info(
                "step %d skipped: its local row is %s (%s)",
                row["step"],
                copy["state"],
                ", ".join(x.get("code", "?") for x in copy.get("reasons") or []),
            )
            below = row["step"]
        m, reasons = (
            trusted_manifest(self.root / row["path"], row) if self.store is None else self.store.trusted_manifest(row)
        )
        files = self.ledger.files(row["step"])
        return {
            "step": row["step"],
            "path": row["path"],
            "files": files,
            "world_size": (m or {}).get("world_size"),
            "signatures": (m or {}).get("signatures") or {},
            "reasons": reasons,
            "metadata_digest": next((f["digest"] for f in files if f["path"] == ".metadata"), None),
        }

    def _loaded_differences(self, step: int, expected: dict, state: dict) -> list[str]:
        """The saved tensors whose loaded values differ from the full-tensor signatures recorded at save
        (sharding-independent, so a checkpoint saved on N ranks verifies when loaded on M). The signatures come
        from one all_reduce, so every rank computes the same list. Raises LoadVerificationError when saved values
        have no place in `state`."""
        if not self.verify_load or not expected:
            return []
        state = materialize(state)
        unsigned = set(full_signable(flatten_state(state, keep_dtensor=True))[1])
        got = full_signatures(state, group=self.group, plain="replica", exclude=unsigned)
        absent = sorted(k for k in expected if k not in got and k not in unsigned)
        if absent:
            raise LoadVerificationError(
                f"checkpoint {step}: {len(absent)} saved value(s) have no place in the state passed to "
                f"load_latest_clean (e.g. {absent[0]}); build it with torch.distributed.checkpoint.state_dict."
                "get_state_dict so that optimizer state exists before loading"
            )
        # A plain tensor's value (xxh3) compares only with a plain tensor's: one that became a DTensor in a
        # resharded restart is vouched for by the byte digests alone.
        comparable = [
            k
            for k in expected
            if k in got and got[k].startswith(REPLICA_PREFIX) == expected[k].startswith(REPLICA_PREFIX)
        ]
        return sorted(k for k in comparable if got[k] != expected[k])

    def _reject_load_mismatch(self, cand: dict, differ: list[str]) -> None:
        """Coordinator: the loaded values are not what was certified; the checkpoint is rejected for good (CAS from
        certified: an operator's quarantine meanwhile stands), journaled beside the data, and an event recorded."""
        reasons = [{"code": "load_mismatch", "tensors": differ[:16], "count": len(differ)}]
        applied = journal.record_transition(
            self.ledger, self.root, cand["step"], "rejected", reasons, source="load", expect="certified"
        )
        self.ledger.add_event(
            "load_mismatch",
            step=cand["step"],
            run_id=self.run_id,
            detail={"differ": differ[:16], "count": len(differ), "rejected": applied},
        )


def _begin_rank_local(state: dict, saved_world: int | None) -> list:
    """Every top-level RankLocal of `state`, told the world size its rows were saved by (app_state.RankLocal)."""
    from scout_ckpt.save.app_state import RankLocal

    out = []
    for name, v in state.items():
        if isinstance(v, RankLocal):
            v.begin_load(saved_world if isinstance(saved_world, int) else None, repr(name))
            out.append(v)
    return out
