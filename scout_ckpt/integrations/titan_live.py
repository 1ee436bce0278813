"""The live evidence of one TorchTitan save, taken beside its write: consensus over the replica dims of the mesh, the
configured invariants and the full-tensor signatures for the load check, as ScoutCheckpointManager records them.

Why beside the write: the full-tensor signatures sign every byte of the rank's shards (the additive kernel of
consensus/kernels.py), seconds at 100 MB per rank; taken before the write, as a plain call, they doubled a
TorchTitan save (docs/benchmarks.md, "A framework user's save"). The core Checkpointer takes the same evidence in a
background thread during DCP's write; this does the same for TorchTitan's own write:

  start()   (main thread, before the parent's `_save`) consensus planned and started in its own thread
            (consensus.save_time.start_consensus(background=True): hashing, then the exchange on the consensus
            groups, which nothing else uses during a save); in a second thread this rank's DTensor partial
            signatures (consensus.full.shard_partials: local) and then the invariants (invariants.run_local:
            its all_reduces on the run's group, which nothing else uses while the write runs)
  result()  (main thread, after the parent's `_save` returned or raised) waits for both threads, then the one
            all_reduce of `full_signatures` on the run's group, with the partials taken instead of recomputed (the
            same values: the same function of the same bits)

The state cannot change in between: TorchTitan's training thread is inside `_save` until `result()` returns (an
async mode stages its copy inside the parent's `_save`; the live tensors are only read). The collectives keep one
order on every rank: each group is used by one thread at a time. What is checked, and the evidence recorded, are
those the same calls made one after another before the write recorded."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from scout_ckpt import invariants as inv

if TYPE_CHECKING:
    from scout_ckpt.consensus.save_time import PendingConsensus

__all__ = ["LiveEvidence"]

_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _pool() -> ThreadPoolExecutor:
    """One thread per process for the partial signatures and the invariants (made again in a forked child)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="scout-titan-live"))
    return _POOL[1]


class LiveEvidence:
    """The evidence of one save (see the module docstring).

    Args:
        mgr: the ScoutCheckpointManager (its groups, checks, run's group, `_signed`).
        states: the state dict TorchTitan writes, held unchanged until `result()` returns.
        signatures: take the full-tensor signatures for the load check.
        names_filter: consensus's selection (state that differs per rank by design left out).
    """

    def __init__(self, mgr, states: dict, *, signatures: bool, names_filter) -> None:
        self.mgr, self.states, self.signatures, self.names_filter = mgr, states, signatures, names_filter
        self._consensus: PendingConsensus | None = None
        self._local: Future | None = None
        self._signed: tuple[dict, list[str]] | None = None

    def start(self) -> "LiveEvidence":
        """Main thread, before the write: the background work started (local planning here, no collective)."""
        m = self.mgr
        if m.consensus:
            from scout_ckpt.consensus.save_time import start_consensus

            self._consensus = start_consensus(self.states, m.groups, names_filter=self.names_filter, background=True)
        if self.signatures:
            self._signed = m._signed(self.states)
        if m.checks or self._signed is not None:
            self._local = _pool().submit(self._beside_write)
        return self

    def _beside_write(self) -> tuple[dict, dict | None]:
        """Background: (this rank's DTensor partial signatures, the invariants' evidence or None)."""
        from scout_ckpt.consensus.full import shard_partials

        partials = shard_partials(self._signed[0]) if self._signed is not None else {}
        checks = None
        if self.mgr.checks:
            flat = {k: v for k, v in inv.flatten(self.states).items() if isinstance(v, torch.Tensor)}
            checks = inv.run_local(self.mgr.checks, flat, group=self.mgr.run.pg)
        return partials, checks

    def wait(self) -> None:
        """Main thread, when the write failed: both threads joined, their errors dropped (the save's own error is
        the one raised), so nothing runs on into the next steps."""
        for f in (self._local, getattr(self._consensus, "_exchanged", None)):
            if f is not None:
                try:
                    f.result()
                except Exception:  # noqa: BLE001 -- see the docstring
                    pass

    def result(self) -> dict:
        """Main thread, after the write: {"consensus", "invariants", "signatures", "unsigned"} as configured (the
        same on every rank); collective on the run's group when signatures are taken."""
        ev: dict = {}
        try:
            partials, checks = self._local.result() if self._local is not None else ({}, None)
            if self._consensus is not None:
                ev["consensus"] = self._consensus.finish()
        except BaseException:
            self.wait()  # the other thread too: its collectives must not run on into the next steps
            raise
        if checks is not None:
            ev["invariants"] = checks
        if self._signed is not None:
            from scout_ckpt.consensus.full import full_signatures

            flat, unsigned = self._signed
            ev["signatures"] = full_signatures(flat, group=self.mgr.run.pg, plain="replica", partials=partials)
            ev["unsigned"] = unsigned
        return ev
