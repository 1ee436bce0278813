"""Certified checkpoints for a training loop around Hugging Face Accelerate, with an exact resume: model, optimizer,
LR schedulers, RNG (dropout), Accelerate's step counter, the GradScaler, objects registered with
`accelerator.register_for_checkpointing`, and the data position of every prepared DataLoader.

    ckpt = ScoutCheckpointing(accelerator, ROOT)                              # options: Checkpointer's
    model, optimizer, dl, sched = ckpt.prepare(model, optimizer, dl, sched)   # instead of accelerator.prepare
    step = ckpt.load_latest_clean() or 0                                      # collective
    for epoch in range(ckpt.epoch, num_epochs):                               # the epoch the checkpoint was in
        for batch in dl:
            ...                                                               # forward, backward, optimizer step
            step += 1
            ckpt.step(step)
            if step % save_every == 0:
                ckpt.save(step)                                               # collective
    ckpt.close()

`prepare` is `accelerator.prepare`, with each DataLoader returned wrapped (accelerate_data.TrackedDataLoader) so
its position is saved; everything else is returned as Accelerate prepared it. The saves are the core Checkpointer's
(a DCP `step-N` folder under ROOT, the ledger, consensus across the data-parallel replicas, load verification,
walk-back): this class only builds the state dict from what the Accelerator holds, unwrapping AcceleratedOptimizer
(so replay and shard evidence see the optimizer that steps) and AcceleratedScheduler.

The Checkpointer is created at the first load_latest_clean, save or step (collective: every rank calls them, in
the same order), from the first prepared model and its optimizer. A DataLoader prepared by `accelerator.prepare`
directly would resume at its start: load and save refuse it on every rank (ScoutError naming `ckpt.track`).

Launchers: torchrun (CPU, gloo; `accelerate launch --num_processes 2 --cpu` starts one process on a machine without
an MPI hostfile, docs/pytorch-facts.md) and `accelerate launch` where it starts the processes (GPUs): the Accelerator
initializes the default process group, the Checkpointer adds its own gloo groups.
"""

from __future__ import annotations

import logging
import os

import torch
from torch.utils.data import DataLoader

from scout_ckpt.checkpointer import Checkpointer
from scout_ckpt.errors import ScoutError
from scout_ckpt.integrations.accelerate_data import DataPosition, TrackedDataLoader
from scout_ckpt.integrations.wrappers import ddp_wrapper_of
from scout_ckpt.replay.optimizer_replay import unwrap_optimizer
from scout_ckpt.save import fault_points
from scout_ckpt.save.app_state import ModelOptimizerState, RankLocal, RNGState

__all__ = ["ScoutCheckpointing", "TrackedDataLoader"]

log = logging.getLogger("scout_ckpt.accelerate")


def _process_group(accelerator) -> None:
    """The Checkpointer runs on a default process group. Accelerate creates one for a distributed job; one process
    alone has none, and gets a 1-rank gloo group here. Processes started by torchrun that Accelerate did not make a
    distributed job (on a machine without GPUs, Accelerator(cpu=True) is needed) would each train alone: refused."""
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 or accelerator.num_processes > 1:
        raise ScoutError(
            f"this process is one of {world} (WORLD_SIZE) but Accelerate did not start a distributed "
            "job: each process would train alone. Without GPUs, use Accelerator(cpu=True) under "
            "torchrun"
        )
    fd, path = tempfile.mkstemp(prefix="scout-ckpt-pg-")
    os.close(fd)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


class _AcceleratorStep:
    """Accelerate's own step counter (`accelerator.step`, gradient accumulation's micro-step count), which
    `accelerator.save_state` saves too."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def state_dict(self) -> dict:
        return {"step": torch.tensor(int(self.accelerator.step), dtype=torch.int64)}

    def load_state_dict(self, sd: dict) -> None:
        self.accelerator.step = int(sd["step"])


class ScoutCheckpointing:
    """Certified, exactly resumable checkpoints of everything an Accelerator prepared; see the module docstring.

    Args:
        accelerator: the job's Accelerator
        root: the checkpoint root (step-NNNNNNNN folders, scout-ledger.db)
        extra: more state for the checkpoint: {name: Stateful or tensor} (accelerator.register_for_checkpointing
            objects are included without it)
        options: passed to Checkpointer (async_save, keep, replay, observer, invariants, timeout_s, ...)
    """

    def __init__(self, accelerator, root: str | os.PathLike, *, extra: dict | None = None, **options):
        for key in ("model", "optimizer"):
            if key in options:
                raise ScoutError(f"ScoutCheckpointing takes the {key} from the Accelerator; drop {key}=")
        self.accelerator, self.root, self.options = accelerator, root, options
        self.extra = dict(extra or {})
        self.loaders: list[TrackedDataLoader] = []
        self.checkpointer: Checkpointer | None = None
        self._fault_hook = fault_points.current()  # tests only (scout_ckpt.testing.fault_points)
        self._closed = False
        # One instance each for the whole run (RankLocal keeps its world mesh); DataPosition reads self.loaders.
        self._data = RankLocal(DataPosition(self.loaders))
        self._rng = RankLocal(RNGState())
        self._guard_skip_first_batches()

    def _guard_skip_first_batches(self) -> None:
        """Accelerate's own resume recipe (`accelerator.skip_first_batches(dl, n)` after `load_state`) kept beside
        the drop-in would skip the batches twice (the tracked loader already resumes at its saved position): on a
        tracked loader it is ignored, with a warning; any other loader goes to Accelerate as before."""
        acc = self.accelerator
        original = getattr(acc, "skip_first_batches", None)
        if original is None or getattr(original, "__scout__", False):
            return
        loaders = self.loaders

        def skip_first_batches(dataloader, num_batches: int = 0):
            tracked = next((t for t in loaders if dataloader is t or dataloader is t.inner), None)
            if tracked is None or not num_batches:
                return original(dataloader, num_batches)
            log.warning(
                "scout-ckpt: accelerator.skip_first_batches(..., %d) ignored: ScoutCheckpointing resumes "
                "this DataLoader at its saved position itself (keeping both would skip the batches twice); "
                "remove the skip_first_batches line",
                num_batches,
            )
            return tracked

        skip_first_batches.__scout__ = True
        skip_first_batches.__doc__ = original.__doc__
        acc.skip_first_batches = skip_first_batches

    # ---- preparing -----------------------------------------------------------------------------------------

    def prepare(self, *args, device_placement=None):
        """`accelerator.prepare(*args)`, the DataLoaders among the results wrapped so their position is saved.
        Collective where Accelerate's prepare is.

        Args:
            args: what the job gives `accelerator.prepare` (model, optimizer, DataLoaders, schedulers).
            device_placement: as for `accelerator.prepare`.
        """
        out = self.accelerator.prepare(*args, device_placement=device_placement)
        if len(args) == 1:
            return self._wrap(out)
        return tuple(self._wrap(o) for o in out)

    def track(self, dataloader) -> TrackedDataLoader:
        """Wrap a DataLoader already returned by `accelerator.prepare`; iterate the result instead.

        Args:
            dataloader: a DataLoader `accelerator.prepare` returned.
        """
        if isinstance(dataloader, TrackedDataLoader):
            return dataloader
        if not any(dataloader is d for d in self.accelerator._dataloaders):
            raise ScoutError("ckpt.track takes a DataLoader returned by accelerator.prepare (or use ckpt.prepare)")
        for t in self.loaders:
            if t.inner is dataloader:
                return t
        t = TrackedDataLoader(dataloader)
        self.loaders.append(t)
        return t

    def _wrap(self, obj):
        if isinstance(obj, DataLoader) and any(obj is d for d in self.accelerator._dataloaders):
            return self.track(obj)
        return obj

    @property
    def epoch(self) -> int:
        """The epoch the first tracked DataLoader is in (a checkpoint taken inside a pass resumes inside it), or
        the next one; 0 on a fresh run."""
        return self.loaders[0].epoch if self.loaders else 0

    # ---- the state -----------------------------------------------------------------------------------------

    def _pairs(self) -> list[tuple]:
        """(model, unwrapped optimizer or None) for every prepared model; each optimizer goes with the model that
        holds its parameters (DCP's get_state_dict needs both)."""
        acc = self.accelerator
        models = list(acc._models)
        owner: dict[int, int] = {}
        for i, m in enumerate(models):
            for p in m.parameters():
                owner[id(p)] = i
        pairs = [[m, None] for m in models]
        for o in acc._optimizers:
            opt = unwrap_optimizer(o)
            first = next((p for g in opt.param_groups for p in g["params"]), None)
            i = owner.get(id(first)) if first is not None else None
            if i is None or pairs[i][1] is not None:
                raise ScoutError(
                    "ScoutCheckpointing: an optimizer whose parameters are not those of one prepared "
                    "model (prepare the model with it), or two optimizers of one model: not supported"
                )
            pairs[i][1] = opt
        return [tuple(p) for p in pairs]

    @property
    def state(self) -> dict:
        """The DCP state dict a save writes and a load fills, built at each call from what the Accelerator holds
        now (objects only: cheap)."""
        acc = self.accelerator
        st: dict = {}
        for i, (model, opt) in enumerate(self._pairs()):
            st["app" if i == 0 else f"app_{i}"] = ModelOptimizerState(model, opt)
        for i, s in enumerate(acc._schedulers):
            st["scheduler" if i == 0 else f"scheduler_{i}"] = getattr(s, "scheduler", s)
        if self.loaders:
            st["data"] = self._data
        st["rng"] = self._rng
        st["accelerator"] = _AcceleratorStep(acc)
        if getattr(acc, "scaler", None) is not None:
            st["scaler"] = acc.scaler
        for i, obj in enumerate(getattr(acc, "_custom_objects", [])):
            st[f"custom_{i}"] = obj
        for k, v in self.extra.items():
            if k in st:
                raise ScoutError(f"ScoutCheckpointing: extra state {k!r} clashes with a name it saves itself")
            st[k] = v
        return st

    def _check_loaders(self) -> None:
        untracked = [d for d in self.accelerator._dataloaders if not any(t.inner is d for t in self.loaders)]
        if untracked:
            raise ScoutError(
                f"{len(untracked)} DataLoader(s) prepared by accelerator.prepare directly: their "
                "position would not be saved and a resumed run would restart them from their first "
                "batch; prepare them with ckpt.prepare(...) or wrap them with dl = ckpt.track(dl)"
            )

    def _ensure(self) -> Checkpointer:
        if self.checkpointer is None:
            self._check_loaders()
            _process_group(self.accelerator)
            pairs = self._pairs()
            model, opt = pairs[0] if pairs else (None, None)
            # Accelerate keeps the bare model: the Checkpointer (and so the observer, which counts DDP's
            # collectives and stamps its steps) gets the DDP wrapper that trains
            if model is not None:
                model = ddp_wrapper_of(model) or model
            import torch.distributed as dist

            options = dict(self.options)
            # One process has no replica to compare with: as the Trainer callback, certify on the rest of the
            # evidence there instead of never (the core's consensus default would leave every save `committed`).
            options.setdefault("consensus", dist.get_world_size() > 1)
            with fault_points.using(self._fault_hook):  # made at the first call: the hook of our construction
                self.checkpointer = Checkpointer(self.root, model=model, optimizer=opt, **options)
        return self.checkpointer

    # ---- the Checkpointer's calls --------------------------------------------------------------------------

    def load_latest_clean(self) -> int | None:
        """Collective: load the newest certified checkpoint (walking back past any whose bytes or values do not
        verify) into everything prepared and tracked; return its step, None on a fresh run (Checkpointer's)."""
        ckpt = self._ensure()
        self._check_loaders()
        return ckpt.load_latest_clean(self.state)

    def step(self, step: int, loss: float | None = None) -> None:
        """After the optimizer step (Checkpointer.step: heartbeat, replay schedule, timings; `loss` on every rank
        or none: the loss triage).

        Args:
            step: the number of optimizer steps taken (the same on every rank).
            loss: this rank's loss of the step, on every rank or none (a non-finite loss or a spike triggers triage).
        """
        self._ensure().step(step, loss=loss)

    def save(self, step: int) -> dict | None:
        """Collective, after the optimizer step numbered `step` (Checkpointer.save: the verdict, or None when
        async). Refused between optimizer steps under gradient accumulation (`accelerator.sync_gradients` False):
        the gradients accumulated so far are not saved, and a resume would drop them.

        Args:
            step: the number of optimizer steps taken (the same on every rank).
        """
        if not self.accelerator.sync_gradients:
            raise ScoutError(
                f"save({step}) between optimizer steps (gradient accumulation): save when "
                "accelerator.sync_gradients is True, after optimizer.step()"
            )
        ckpt = self._ensure()
        self._check_loaders()
        return ckpt.save(step, self.state)

    def wait(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def phase(self, name: str):
        """Annotate a phase of the training step for the hang observer (Checkpointer.phase).

        Args:
            name: the phase ("forward", "backward", "optimizer", "data", ...).
        """
        return self._ensure().phase(name)

    @property
    def last_verdict(self) -> dict | None:
        return self.checkpointer.last_verdict if self.checkpointer is not None else None

    def close(self) -> None:
        """Collective: wait for a pending async save, release the Checkpointer, then a barrier on the default
        group, so that `accelerator.end_training()` (destroy_process_group) can follow: a rank can hang in
        destroy_process_group without one (docs/pytorch-facts.md). Idempotent."""
        import torch.distributed as dist

        if self.checkpointer is None or self._closed:
            return
        self._closed = True
        self.checkpointer.close()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def __enter__(self) -> "ScoutCheckpointing":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
