"""The data position of an Accelerate-prepared DataLoader, saved and restored so that a resumed run draws the same
batches, in the same order, with the same dropout masks, as the uninterrupted run.

Why the obvious fixes are wrong (accelerate 1.15, torch 2.13; accelerate/data_loader.py, torch/utils/data/):

- The epoch's order is drawn once, when a pass starts: `RandomSampler.__iter__` draws a `randperm` from the
  sampler's generator (the one `prepare` creates and synchronizes from rank 0 at every pass) or, with no
  generator (one process), from a seed it draws from torch's global RNG. Mid-epoch, that generator has already
  drawn the epoch's order: saving its current state and restoring it gives the *next* epoch's order. What
  reproduces the epoch is the generators' state when the pass started.
- Creating a DataLoader iterator draws from torch's global RNG (`_BaseDataLoaderIter._base_seed`, unless the
  DataLoader has its own generator). The uninterrupted run drew it at the epoch's start; a resumed run that
  creates its iterator mid-epoch draws once more, and every dropout mask after it shifts.
- `SeedableRandomSampler` (DataLoaderConfiguration(use_seedable_sampler=True)) reseeds from initial_seed + epoch,
  and the epoch is `DataLoaderShard.iteration`, which a new process starts at 0.

So `TrackedDataLoader` wraps the prepared loader (every attribute is the prepared one's) and, at the start of every
pass, snapshots torch's global RNG state and the state of every generator that shapes the order; it counts the
batches it has handed out. `DataPosition` saves, per loader: passes started, batches handed out in the current
pass, whether a pass is in progress, `iteration`, those snapshots, the generators' current states, and a seedable
sampler's initial seed. A resumed pass in progress: the snapshots are put back, the pass is rebuilt with
accelerate's own `skip_first_batches` (the batch sampler skips indices; no skipped batch is loaded), its first
batch is drawn, and torch's global RNG is set back to the checkpoint's. A checkpoint taken between passes restores
the generators' current states and `iteration`; the next pass then starts as it did in the uninterrupted run.

A checkpoint taken after the last batch of an epoch (inside the loop, as a save every N steps lands) resumes
*inside* that pass with nothing left to hand out: the script's own end-of-epoch code (evaluation, logging) then runs
as it did in the uninterrupted run.

Not covered: a dataset whose `__getitem__` draws random numbers (augmentation) from torch's global RNG or in
DataLoader workers (skipped batches are not loaded, so those draws are not replayed: make each sample a function of
(seed, index)); `use_stateful_dataloader=True` (torchdata's StatefulDataLoader) and iterable datasets split by
`dispatch_batches` (written through accelerate's own skipping, not tested); a restart on another world size (each
rank's shard of the data changes: rows of ranks that no longer exist are dropped with a WARNING, see RankLocal).
"""

from __future__ import annotations

import torch
from accelerate.data_loader import SeedableRandomSampler, get_sampler, skip_first_batches
from torch.distributed.checkpoint.stateful import Stateful

from scout_ckpt.errors import ScoutError

_END = object()


def _i64(v: int) -> int:
    """A uint64 seed as an int64 (two's complement), so it fits a tensor DCP writes."""
    return v - (1 << 64) if v >= (1 << 63) else v


def _u64(v: int) -> int:
    return v + (1 << 64) if v < 0 else v


class TrackedDataLoader:
    """The loader `ScoutCheckpointing.prepare` returns in place of the prepared one: iterate it as usual; every
    other attribute (len, batch_size, dataset, set_epoch, ...) is the prepared loader's.

    Args:
        inner: the DataLoader `accelerator.prepare` returned (a StatefulDataLoader is refused: it keeps its own position).
    """

    def __init__(self, inner):
        if getattr(inner, "use_stateful_dataloader", False):
            raise ScoutError(
                "scout-ckpt's Accelerate integration does not track a StatefulDataLoader "
                "(use_stateful_dataloader=True); prepare the DataLoader without it"
            )
        self.inner = inner
        sampler = get_sampler(inner)
        self._seedable = sampler if isinstance(sampler, SeedableRandomSampler) else None
        gens, seen = [], set()
        # The generators that shape the order, fixed here so the saved structure never changes: the sampler's
        # (unless it reseeds itself every pass), the DataLoader's own, the one accelerate synchronizes.
        cands = [
            None if self._seedable is not None else getattr(sampler, "generator", None),
            getattr(inner, "generator", None),
            getattr(inner, "synchronized_generator", None),
        ]
        for g in cands:
            if isinstance(g, torch.Generator) and id(g) not in seen:
                seen.add(id(g))
                gens.append(g)
        self.generators: list[torch.Generator] = gens
        self.passes = 0  # passes started
        self.consumed = 0  # batches handed out in the current (or last) pass
        self.in_progress = False
        self._start_rng = torch.get_rng_state()
        self._start_gens = [g.get_state() for g in gens]
        self._resume: dict | None = None

    # ---- what a user sees ----------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch a loop should be in: the pass in progress, or the next one (0 on a fresh run)."""
        return self.passes - 1 if self.in_progress or self._resume_in_progress() else self.passes

    def _resume_in_progress(self) -> bool:
        return self._resume is not None and self._resume["in_progress"]

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __iter__(self):
        resume, self._resume = self._resume, None
        if resume is not None and resume["in_progress"]:
            yield from self._resumed_pass(resume)
            return
        self._start_rng = torch.get_rng_state()
        self._start_gens = [g.get_state() for g in self.generators]
        self.passes += 1
        self.consumed = 0
        self.in_progress = True
        try:
            for batch in self.inner:
                self.consumed += 1
                yield batch
        finally:
            self.in_progress = False

    def _resumed_pass(self, r: dict):
        """The rest of a pass a checkpoint was taken in: its order drawn from the state the pass started with, the
        batches already handed out skipped, torch's global RNG left as the checkpoint had it."""
        now = torch.get_rng_state()
        self._start_rng, self._start_gens = r["start_rng"], r["start_gens"]
        self.passes, self.consumed, self.in_progress = r["passes"], r["consumed"], True
        try:
            torch.set_rng_state(self._start_rng)
            for g, s in zip(self.generators, self._start_gens):
                g.set_state(s)
            self.inner.iteration = r["iteration"]
            it = iter(skip_first_batches(self.inner, r["consumed"]))
            try:
                first = next(it, _END)  # the pass's draws (sync, base seed, order) happen here
            finally:
                torch.set_rng_state(now)
            if first is not _END:
                self.consumed += 1
                yield first
                for batch in it:
                    self.consumed += 1
                    yield batch
            self.inner.iteration = r["iteration"] + 1  # as DataLoaderShard counts a finished pass
        finally:
            self.in_progress = False

    # ---- saved state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        if self._resume is not None:  # loaded, not yet iterated: what was loaded is still the position
            r = self._resume
            pos = [r["passes"], r["consumed"], int(r["in_progress"]), r["iteration"]]
            start_rng, start_gens, gens = r["start_rng"], r["start_gens"], r["gens"]
        else:
            pos = [self.passes, self.consumed, int(self.in_progress), int(getattr(self.inner, "iteration", 0))]
            start_rng, start_gens = self._start_rng, self._start_gens
            gens = [g.get_state() for g in self.generators]
        sd = {"pos": torch.tensor(pos, dtype=torch.int64), "start_rng": start_rng.clone()}
        for i, (s, c) in enumerate(zip(start_gens, gens)):
            sd[f"start_gen_{i}"] = s.clone()
            sd[f"gen_{i}"] = c.clone()
        if self._seedable is not None:
            sd["initial_seed"] = torch.tensor(_i64(int(self._seedable.initial_seed)), dtype=torch.int64)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Resume at a saved position (the checkpoint's data state for this rank).

        Args:
            sd: what state_dict() returned at the save.
        """
        passes, consumed, in_progress, iteration = (int(v) for v in sd["pos"].tolist())
        n = len(self.generators)
        r = {
            "passes": passes,
            "consumed": consumed,
            "in_progress": bool(in_progress),
            "iteration": iteration,
            "start_rng": sd["start_rng"].clone(),
            "start_gens": [sd[f"start_gen_{i}"].clone() for i in range(n)],
            "gens": [sd[f"gen_{i}"].clone() for i in range(n)],
        }
        if self._seedable is not None:
            self._seedable.initial_seed = _u64(int(sd["initial_seed"]))
        for g, s in zip(self.generators, r["gens"]):
            g.set_state(s)
        self.inner.iteration = iteration
        self.passes, self.consumed, self.in_progress = passes, consumed, False
        self._resume = r


class DataPosition(Stateful):
    """Every tracked loader's position, as {"dl0": ..., "dl1": ...} (fixed-shape tensors; wrap in RankLocal: each
    rank has its own shard and, possibly, its own generators)."""

    def __init__(self, loaders: list[TrackedDataLoader]):
        self.loaders = loaders

    def state_dict(self) -> dict:
        return {f"dl{i}": dl.state_dict() for i, dl in enumerate(self.loaders)}

    def load_state_dict(self, sd: dict) -> None:
        for i, dl in enumerate(self.loaders):
            dl.load_state_dict(sd[f"dl{i}"])
