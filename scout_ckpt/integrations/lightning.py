"""Certified checkpoints for PyTorch Lightning, by configuration: `Trainer(strategy=ScoutDDPStrategy(root=ROOT))`
(or `ScoutModelParallelStrategy`, `ScoutFSDPStrategy`) and `trainer.fit(model, ckpt_path="latest_clean")`.

Why a strategy and not a CheckpointIO or a Callback: Lightning calls `CheckpointIO.save_checkpoint` and
`remove_checkpoint` on rank 0 only, while `Strategy.save_checkpoint`, `load_checkpoint` and `remove_checkpoint`
run on every rank (strategies/strategy.py), and a certified save is collective. A callback sees neither the whole
checkpoint dump (`_CheckpointConnector.dump_checkpoint`: loops, callbacks, datamodule, precision plugin, hparams,
`on_save_checkpoint` extras) nor `ckpt_path`. The mixin takes the dump Lightning hands to `save_checkpoint`.

Layout: every checkpoint is a core `ROOT/step-NNNNNNNN/` written by `scout_ckpt.Checkpointer.save` (DCP, temp dir
+ rename, manifest, ledger), so `scout-ckpt ls/explain/certify/resume ROOT` read it with no layout of its own.
What is in it (one DCP checkpoint, every byte hashed into the ledger, replicated values compared by consensus):

  app.model.*      the model's state dict (`get_state_dict`: DDP's wrapper stripped, FSDP2's DTensor shards)
  app.optim.*      every optimizer's state, keyed by parameter name (created before a load, as the DCP recipe does)
  lightning.blob   the rest of Lightning's dump (loops, callbacks, LR schedulers, precision plugin / AMP scaler,
                   hparams, datamodule state, `on_save_checkpoint` extras), `torch.save`d into one bytes value

The path Lightning asks for (ModelCheckpoint's `epoch=0-step=10.ckpt`, `last.ckpt`) becomes a small JSON pointer
to the step (`{"scout_ckpt": {"root", "step", "path"}}`), written by rank 0 after the commit, so ModelCheckpoint's
own bookkeeping (top-k, `save_last`, file-exists checks, `ckpt_path="last"`) keeps working. Two saves at the same
optimizer step (a top-k file and last.ckpt) are one checkpoint with two pointers. `remove_checkpoint(pointer)`
removes the pointer; a step directory goes only when no pointer names it any more and the core retention rule
(`folders.apply_retention`, keep=1) lets it go: never the newest certified checkpoint, never a newer one awaiting
evidence or a save in flight, never a quarantined one. Which pointers name which step is kept by rank 0 in
`ROOT/lightning-pointers.json`.

Loading: `ckpt_path="latest_clean"` (or `latest_clean(ROOT)`, a pointer, or a step directory) goes through
`Checkpointer.load_latest_clean`: the newest certified checkpoint whose bytes and loaded values verify, walking
back past (and rejecting) any that fail, on every rank. A pointer or directory naming an older step than the
newest certified one is refused (one line naming both): the core loads the latest clean state only. A fresh run
with "latest_clean" starts from scratch. Any other path (a plain Lightning `.ckpt`) is loaded by Lightning as
before, uncertified, with a warning.

The per-step hook (`Checkpointer.step`: observer heartbeats, replay schedule) runs in `optimizer_step`, i.e. once
per real optimizer step: with `accumulate_grad_batches=k` once every k batches.

Who calls what (Lightning, on every rank): `setup` (the Checkpointer is opened when fitting: collective),
`save_checkpoint` (collective: Checkpointer.save), `load_checkpoint` (collective: the walk-back),
`remove_checkpoint` (rank 0 acts, every rank returns), `optimizer_step` (Checkpointer.step), `teardown`
(Checkpointer.close). Lightning itself never destroys the default process group: call
`torch.distributed.destroy_process_group()` at the end of the script, as with the core.

Not covered: `save_weights_only` (every certified checkpoint is full: the flag is ignored), loading an older step
than the latest clean one through the strategy, `storage_options`. `FSDPStrategy` (FSDP1) needs a GPU (Lightning
refuses FSDP on CPU): ScoutFSDPStrategy is the same mixin, refused on CPU with one line, and untested here.
"""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from scout_ckpt.errors import ScoutError
from scout_ckpt.format import layout
from scout_ckpt.save import fault_points

log = logging.getLogger("scout_ckpt.lightning")

__all__ = [
    "ScoutStrategyMixin",
    "ScoutDDPStrategy",
    "ScoutModelParallelStrategy",
    "ScoutFSDPStrategy",
    "latest_clean",
    "LATEST_CLEAN",
    "POINTERS_NAME",
]

LATEST_CLEAN = "latest_clean"
POINTERS_NAME = "lightning-pointers.json"
_MARK = "scout_ckpt"  # key of a pointer file, and of the dict load_checkpoint hands to Lightning
_SPLIT_OUT = ("state_dict", "optimizer_states")  # saved through DCP as app.model / app.optim


def latest_clean(root: str | os.PathLike, *, verify: bool = True) -> str | None:
    """The newest certified `step-NNNNNNNN` directory under ROOT whose bytes verify (walking back past and rejecting
    any that fail), or None on a fresh run; for `trainer.fit(ckpt_path=latest_clean(ROOT) or None)` outside the
    strategy's own "latest_clean". Not collective.

    Args:
        root: the Trainer's output_dir or the Lightning ROOT.
        verify: re-hash the candidate's bytes (False: trust the ledger).
    """
    from scout_ckpt.integrations import folders

    found = folders.latest_clean_row(root, verify=verify)
    return str(Path(root) / found["path"]) if found else None


# ---- the state handed to the Checkpointer ---------------------------------------------------------------------


class _ModelOptimizers(Stateful):
    """The DCP recipe's model + optimizers, for several optimizers: `get_state_dict` creates the optimizers' state
    before a load (a fresh optimizer has no moments for DCP to load into) and strips DDP's wrapper."""

    def __init__(self, model: torch.nn.Module, optimizers: list):
        self.model, self.optimizers = model, list(optimizers)

    def state_dict(self) -> dict:
        if not self.optimizers:
            return {"model": self.model.state_dict()}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict) -> None:
        if not self.optimizers:
            self.model.load_state_dict(sd["model"])
            return
        set_state_dict(self.model, self.optimizers, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class _Remainder(Stateful):
    """What Lightning's dump holds besides the model and optimizers, as one bytes value (hashed into the ledger
    with the files, compared across replicas by consensus like any non-tensor leaf)."""

    def __init__(self, checkpoint: dict | None = None):
        self.blob = b""
        if checkpoint is not None:
            buf = io.BytesIO()
            torch.save({k: v for k, v in checkpoint.items() if k not in _SPLIT_OUT}, buf)
            self.blob = buf.getvalue()

    def state_dict(self) -> dict:
        return {"blob": self.blob}

    def load_state_dict(self, sd: dict) -> None:
        self.blob = sd["blob"]

    def checkpoint(self) -> dict:
        # weights_only=False: hparams and callback state are arbitrary objects; these bytes are the certified
        # ones (their digest verified before the load)
        return torch.load(io.BytesIO(self.blob), map_location="cpu", weights_only=False)


class _Fresh(dict):
    """What load_checkpoint returns when "latest_clean" finds nothing: Lightning's version migration reads the
    version key, and every `restore_*` of the checkpoint connector returns early on a falsy checkpoint."""

    def __bool__(self) -> bool:
        return False


def _warn_single_checkpoint(trainer) -> None:
    """Rank 0, at fit start: ModelCheckpoint keeping fewer than 2 checkpoints (Lightning's default save_top_k=1)
    leaves the walk-back nothing certified to fall back to when the one kept fails re-verification."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    cbs = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    if cbs and all(0 <= cb.save_top_k < 2 for cb in cbs):
        log.warning(
            "scout-ckpt: ModelCheckpoint(save_top_k=%s) keeps one checkpoint: if it fails re-verification "
            "there is no certified one to walk back to and the run starts from step 0; use save_top_k >= 2 "
            "(-1 keeps all)",
            ", ".join(str(cb.save_top_k) for cb in cbs),
        )


# ---- pointers (rank 0) ----------------------------------------------------------------------------------------


def read_pointer(path: str | os.PathLike) -> dict | None:
    """{"root", "step", "path"} of a pointer file written by the strategy, or None for anything else."""
    p = Path(path)
    try:
        if not p.is_file() or p.stat().st_size > 65536:
            return None
        doc = json.loads(p.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return doc.get(_MARK) if isinstance(doc, dict) and isinstance(doc.get(_MARK), dict) else None


def _load_pointers(root: Path) -> dict:
    try:
        doc = json.loads((root / POINTERS_NAME).read_text())
    except (OSError, ValueError):
        doc = {}
    return {"pointers": dict(doc.get("pointers") or {}), "managed": sorted(set(doc.get("managed") or []))}


def _save_pointers(root: Path, doc: dict) -> None:
    layout.atomic_write_json(root / POINTERS_NAME, doc)


# ---- the mixin ------------------------------------------------------------------------------------------------


class ScoutStrategyMixin:
    """Certified checkpoints for a Lightning strategy (see the module docstring). Put it first:
    `class S(ScoutStrategyMixin, DDPStrategy)`.

    Args:
        root: the checkpoint root (ledger, step directories); default `<default_root_dir>/scout-ckpt`
        checkpointer: keyword options of `scout_ckpt.Checkpointer` (async_save, observer, invariants, replay, ...),
            as Python values or as LightningCLI's YAML gives them: a group's table (`replay: {interval: 5}`)
            becomes its dataclass here (`options.from_config`), an unknown key fails in one line
    """

    def __init__(self, *args, root: str | os.PathLike | None = None, checkpointer: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.scout_root = Path(root) if root is not None else None
        from scout_ckpt import options

        self.scout_options = options.from_config(checkpointer or {})
        self.scout = None  # the Checkpointer, open while fitting
        self._scout_fault_hook = fault_points.current()  # tests only (scout_ckpt.testing.fault_points)
        self._scout_saved: tuple[int, dict | None] | None = None  # (step, verdict) of this process's last save
        self.scout_steps: list[int] = []  # the steps given to Checkpointer.step in this process (diagnostics)
        if "keep" in self.scout_options:
            raise ScoutError(
                "scout-ckpt's Lightning strategy takes retention from ModelCheckpoint (save_top_k, "
                "save_last): leave out the Checkpointer option `keep`"
            )

    # ---- lifecycle ----------------------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # the optimizers must exist (their state is loaded in place) and the Checkpointer be open
        return True

    def setup(self, trainer) -> None:
        super().setup(trainer)
        from lightning.pytorch.trainer.states import TrainerFn

        if trainer.state.fn == TrainerFn.FITTING:
            self._scout_open()
            if self.scout.is_coordinator:
                _warn_single_checkpoint(trainer)

    def _scout_open(self):
        """Collective: the Checkpointer on the strategy's model and optimizers (once per fit)."""
        if self.scout is None:
            from scout_ckpt.checkpointer import Checkpointer

            if self.scout_root is None:
                self.scout_root = Path(self.lightning_module.trainer.default_root_dir) / "scout-ckpt"
            root = self.broadcast(str(Path(self.scout_root).absolute()))
            self.scout_root = Path(root)
            opts = self._scout_optimizers()
            # the strategy's model: DDP's wrapper where there is one (the observer counts its collectives and stamps
            # its steps; replay's targets are found through it, by the same user paths as on the bare module)
            with fault_points.using(self._scout_fault_hook):  # the hook of the strategy's construction
                self.scout = Checkpointer(
                    root,
                    model=self.model if self.model is not None else self.lightning_module,
                    optimizer=opts[0] if len(opts) == 1 else None,
                    **self.scout_options,
                )
        return self.scout

    def _scout_optimizers(self) -> list:
        return [getattr(o, "_optimizer", o) for o in self.optimizers]

    def teardown(self) -> None:
        if self.scout is not None:
            scout = self.scout
            try:
                scout.wait()  # an async save's verdict is recorded: retention can now judge the step before it
                if scout.is_coordinator and self.scout_root is not None:
                    self._retention(_load_pointers(self.scout_root))
            finally:
                self.scout = None
                scout.close()
        self._scout_saved = None
        super().teardown()

    # ---- the per-step hook --------------------------------------------------------------------------------

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """Every rank, once per real optimizer step. Lightning's 32-bit/bf16 precision runs its closure (forward,
        backward, `on_before_optimizer_step`, gradient clipping) inside `optimizer.step`, after the optimizer's step
        pre-hooks, where the replays of scout-ckpt capture the gradients the update will use: here the wrapped
        closure runs first and `optimizer.step` gets its result (the same operations in the same order; this is
        `Strategy.optimizer_step` + `Precision.optimizer_step` of lightning 2.6.6). A precision plugin with its
        own optimizer_step (AMP's MixedPrecision, which evaluates the closure first itself) or DDP's model
        averager keep Lightning's path."""
        if self.scout is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        from lightning.pytorch.plugins.precision import Precision

        plugin = self.precision_plugin
        model = model or self.lightning_module
        if (
            type(plugin).optimizer_step is Precision.optimizer_step
            and hasattr(plugin, "_wrap_closure")
            and getattr(self, "_model_averager", None) is None
        ):
            result = plugin._wrap_closure(model, optimizer, closure)
            out = optimizer.step(closure=lambda: result, **kwargs)
        else:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        # Lightning counts the step as completed after this returns (LightningOptimizer.step): this is the number
        # of the optimizer step just taken
        step = self.lightning_module.trainer.global_step + 1
        self.scout.step(step)
        self.scout_steps.append(step)
        return out

    # ---- save ---------------------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Collective (Lightning calls it on every rank): the certified save of the state after `global_step`
        optimizer steps, then rank 0 writes the pointer at `filepath` (ModelCheckpoint's name)."""
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported: "
                "scout-ckpt writes the checkpoint itself"
            )
        scout = self._scout_open()
        # rank 0's path is the one that counts: only rank 0 writes the pointer (no broadcast needed)
        filepath = str(Path(filepath).absolute())
        step = int(checkpoint["global_step"])
        if self._scout_saved is None or self._scout_saved[0] != step:
            state = {"app": _ModelOptimizers(self.model, self._scout_optimizers()), "lightning": _Remainder(checkpoint)}
            verdict = scout.save(step, state)
            self._scout_saved = (step, verdict)
        self._scout_on_coordinator(lambda: self._write_pointer(filepath, step))

    def _scout_on_coordinator(self, fn) -> None:
        """Collective: fn on rank 0; its error raised on every rank (every rank must reach the collectives below).
        One all_reduce of a flag per call; the message follows only when fn failed."""
        error = None
        if self.scout.is_coordinator:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - every rank must still reach the collectives below
                error = f"{type(e).__name__}: {e}"
        if self.reduce_boolean_decision(error is not None, all=False):
            error = self.broadcast(error)
            raise ScoutError(f"scout-ckpt: {error}")

    def _write_pointer(self, filepath: str, step: int) -> None:
        root = self.scout_root
        rel = layout.step_dirname(step)
        p = Path(filepath)
        if p.is_dir():
            raise IsADirectoryError(f"{p} is a directory; scout-ckpt writes a pointer file there")
        p.parent.mkdir(parents=True, exist_ok=True)
        layout.atomic_write_json(p, {_MARK: {"root": str(root), "step": step, "path": rel}})
        doc = _load_pointers(root)
        doc["pointers"][filepath] = step
        doc["managed"] = sorted(set(doc["managed"]) | {step})
        _save_pointers(root, doc)
        self._retention(doc)

    # ---- retention ----------------------------------------------------------------------------------------

    def remove_checkpoint(self, filepath) -> None:
        """Every rank (Lightning calls it so): rank 0 drops the pointer, then the step directories no pointer names
        and the core rule lets go; a path that is not one of ours goes to Lightning's own removal."""
        scout = self.scout
        filepath = str(Path(filepath).absolute())
        if scout is None or not scout.is_coordinator:
            if scout is None:
                super().remove_checkpoint(filepath)
            return
        doc = _load_pointers(self.scout_root)
        if filepath not in doc["pointers"]:
            super().remove_checkpoint(filepath)
            return
        doc["pointers"].pop(filepath)
        try:
            os.unlink(filepath)
        except FileNotFoundError:
            pass
        _save_pointers(self.scout_root, doc)
        self._retention(doc)

    def _retention(self, doc: dict) -> None:
        """Rank 0: core retention (keep=1) over the steps the pointers ever named, keeping every step a pointer
        still names. Errors are ledger events, never raised: the save they follow has succeeded."""
        from scout_ckpt.integrations import folders

        scout = self.scout
        try:
            dirs = {
                s: layout.step_path(self.scout_root, s)
                for s in doc["managed"]
                if layout.step_path(self.scout_root, s).is_dir()
            }
            folders.apply_retention(
                scout.ledger, self.scout_root, 1, dirs=dirs, also_keep=set(doc["pointers"].values())
            )
        except Exception as e:  # noqa: BLE001 -- see the docstring
            scout.ledger.add_event("retention_error", run_id=scout.run_id, detail={"error": repr(e)})

    # ---- load ---------------------------------------------------------------------------------------------

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: "latest_clean", a pointer or a step directory under ROOT loads the latest clean checkpoint
        (walk-back included) into the model and optimizers in place and returns the rest of Lightning's dump;
        anything else is Lightning's own load (uncertified)."""
        path = self.broadcast(str(checkpoint_path))
        scout = self._scout_open()
        want = self._scout_target(path) if scout.is_coordinator else None
        want = self.broadcast(want)
        if want is None:
            log.warning("scout-ckpt: %s is not a scout-ckpt checkpoint; Lightning loads it uncertified", path)
            return super().load_checkpoint(path, weights_only=weights_only)
        newest = self.broadcast(self._scout_newest() if scout.is_coordinator else None)
        if want != LATEST_CLEAN and newest is not None and want < newest:
            from scout_ckpt.errors import StartRefused

            raise StartRefused(
                f"scout-ckpt: {path} is step {want}, older than the latest clean checkpoint (step "
                f"{newest}); the strategy loads the latest clean state only: pass "
                'ckpt_path="latest_clean"'
            )
        app = _ModelOptimizers(self.model, self._scout_optimizers())
        rest = _Remainder()
        step = scout.load_latest_clean({"app": app, "lightning": rest})
        if step is None:
            if want != LATEST_CLEAN:
                raise ScoutError(
                    f"scout-ckpt: {path} names step {want}, but no certified checkpoint verifies "
                    f"under {self.scout_root}"
                )
            import lightning.pytorch as pl

            return _Fresh({"pytorch-lightning_version": pl.__version__})
        if want != LATEST_CLEAN and step != want:
            log.warning(
                "scout-ckpt: step %s (from %s) was not loadable now (failed or could not be checked: `scout-ckpt "
                "explain` says which); resumed from step %d, the latest clean one",
                want,
                path,
                step,
            )
        self._scout_saved = (step, None)  # the state of `step` is on disk: a save at the same step is a pointer
        checkpoint = rest.checkpoint()
        checkpoint[_MARK] = {"step": step, "root": str(self.scout_root)}
        checkpoint["state_dict"] = self.lightning_module.state_dict()
        checkpoint["optimizer_states"] = [o.state_dict() for o in self._scout_optimizers()]
        return checkpoint

    def _scout_target(self, path: str):
        """Rank 0: LATEST_CLEAN, the step a pointer or step directory names, or None (not ours)."""
        if path == LATEST_CLEAN:
            return LATEST_CLEAN
        p = Path(path)
        ptr = read_pointer(p)
        if ptr is not None:
            if Path(ptr.get("root", "")).absolute() != Path(self.scout_root).absolute():
                raise ScoutError(
                    f"scout-ckpt: {path} points into {ptr.get('root')}, not this strategy's root {self.scout_root}"
                )
            return int(ptr["step"])
        step = layout.parse_step_dir(p.name)
        if step is not None and p.absolute().parent == Path(self.scout_root).absolute():
            return step
        return None

    def _scout_newest(self) -> int | None:
        row = self.scout.ledger.latest("certified")
        return row["step"] if row else None

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if _MARK in checkpoint:
            return  # loaded in place by load_checkpoint
        super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if _MARK in checkpoint:
            return  # loaded in place by load_checkpoint
        super().load_optimizer_state_dict(checkpoint)


class ScoutDDPStrategy(ScoutStrategyMixin, DDPStrategy):
    """`DDPStrategy` with certified checkpoints: `Trainer(strategy=ScoutDDPStrategy(root=ROOT), ...)`."""


class ScoutModelParallelStrategy(ScoutStrategyMixin, ModelParallelStrategy):
    """`ModelParallelStrategy` (FSDP2 / tensor parallel via `configure_model`) with certified checkpoints. Lightning's
    own sharded save (DCP + a rank-0 `meta.pt` outside it) is replaced by one DCP checkpoint holding both."""


class ScoutFSDPStrategy(ScoutStrategyMixin, FSDPStrategy):
    """`FSDPStrategy` (FSDP1) with certified checkpoints. FSDP1 needs a GPU: refused on CPU with one line."""

    def setup_environment(self) -> None:
        if self.root_device.type == "cpu":
            raise ScoutError(
                "ScoutFSDPStrategy (FSDP1) needs a GPU; on CPU use ScoutModelParallelStrategy with "
                "fully_shard in configure_model (FSDP2)"
            )
        super().setup_environment()
