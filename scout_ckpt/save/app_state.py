"""`Stateful` pieces for the state a training script saves beside its model and optimizer.

- `ModelOptimizerState`: the DCP recipe's wrapper. `get_state_dict`/`set_state_dict` handle DDP/FSDP2 wrappers and
  sharded parameters, and create the optimizer's state before loading into it (a fresh optimizer's own
  state_dict() has no moments for DCP to load into).
- `RNGState`: torch (and CUDA), NumPy and Python `random` generators, as fixed-shape tensors.
- `Scalars`: the script's own numbers (iteration, best validation loss, data position) kept in a dict.
- `RankLocal`: state that differs by rank on purpose (each rank's RNG when ranks seed differently, its position
  in its own data shard). DCP writes one copy of a plain tensor, taken as replicated, and consensus would compare
  the ranks' copies and reject the checkpoint. `RankLocal` saves each rank's values as its row of a DTensor
  sharded over the world (global shape [world, ...]), so every rank gets its own values back and consensus never
  compares them. A restart on another world size (an elastic restart: 2 ranks saved, 3 load) restores the rows of
  the ranks that still exist; a new rank keeps its own fresh values, with one WARNING naming what it did not get
  back (`RankLocal(..., strict=True)`: a one-line error instead).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


class ModelOptimizerState(Stateful):
    """{"model": ..., "optim": ...} for DCP; put it in the state dict you give Checkpointer.save/load.

    Args:
        model: the model (wrapped or not; DDP, FSDP2 and DTensor parameters are handled by torch's state-dict API).
        optimizer: its optimizer, or None to save the model alone.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        if self.optimizer is None:
            return {"model": self.model.state_dict()}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict) -> None:
        if self.optimizer is None:
            self.model.load_state_dict(sd["model"])
            return
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class RNGState(Stateful):
    """Every generator a script may draw from (torch CPU, CUDA when present, NumPy's global one, Python's
    `random`), as fixed-shape tensors: no pickled objects go into the checkpoint, and a restarted run draws the
    same batches and dropout masks as the uninterrupted one. Wrap in `RankLocal` when ranks seed differently."""

    def state_dict(self) -> dict:
        _, mt, gauss = random.getstate()
        _, keys, pos, has_gauss, cached = np.random.get_state()
        sd = {
            "torch": torch.get_rng_state(),
            "python": torch.tensor(mt, dtype=torch.int64),
            "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
            "numpy": torch.from_numpy(keys.astype(np.int64)),
            "numpy_extra": torch.tensor([pos, has_gauss, cached], dtype=torch.float64),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        torch.set_rng_state(sd["torch"])
        has_next, next_gauss = sd["python_gauss"].tolist()
        random.setstate((3, tuple(int(v) for v in sd["python"].tolist()), next_gauss if has_next else None))
        pos, has_gauss, cached = sd["numpy_extra"].tolist()
        np.random.set_state(("MT19937", sd["numpy"].numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["cuda"])


class Scalars(Stateful):
    """A dict of the script's own numbers (ints, floats, bools), saved as 0-d tensors and written back into the
    same dict on load, so the script keeps reading `scalars["best_val_loss"]` as a Python number.

        extra = {"iter_num": 0, "best_val_loss": 1e9}
        state = {"app": ModelOptimizerState(model, opt), "extra": Scalars(extra)}

    Args:
        values: the script's dict of numbers; updated in place on load.
    """

    def __init__(self, values: dict[str, Any]):
        self.values = values

    def state_dict(self) -> dict:
        out = {}
        for k, v in self.values.items():
            if isinstance(v, bool):
                out[k] = torch.tensor(v, dtype=torch.bool)
            elif isinstance(v, int):
                out[k] = torch.tensor(v, dtype=torch.int64)
            elif isinstance(v, float):
                out[k] = torch.tensor(v, dtype=torch.float64)
            else:
                raise TypeError(f"Scalars[{k!r}]: {type(v).__name__} is not an int, float or bool")
        return out

    def load_state_dict(self, sd: dict) -> None:
        for k, t in sd.items():
            self.values[k] = t.item()


def _world_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, (dist.get_world_size(),))


class RankLocal(Stateful):
    """Wrap a Stateful whose tensors differ by rank on purpose; see the module docstring.

    Every rank must hold the same keys, shapes and dtypes (RNG states and scalars do). Tensors go through as
    rows of a DTensor sharded on dim 0 over a 1-D world mesh; nothing else is exchanged.

    Loading on another world size: the loader (save/loading.py) calls `begin_load(saved_world, name)` on every rank
    before DCP reads and `end_load()` after the loaded values were verified. In between, `state_dict()` offers
    plain tensors of the saved global shape [saved_world, ...] (every rank reads every row: RNG states are a few
    KiB), and `load_state_dict` hands rank r its row r.

    Args:
        inner: the Stateful whose tensors differ by rank (e.g. RNGState()).
        strict: refuse to load rows saved by another world size (ScoutError) instead of resharding them.
    """

    def __init__(self, inner: Stateful, *, strict: bool = False):
        self.inner, self.strict = inner, strict
        self._mesh = None
        self._loading_from: int | None = None  # the saved world size while a resharding load is in progress
        self._loaded: dict | None = None  # what that load read, offered back for its verification
        self.name = "rank-local state"

    def begin_load(self, saved_world: int | None, name: str) -> None:
        """Collective in effect (every rank, the same arguments): prepare to load rows saved by `saved_world`
        ranks (None: unknown, taken as this world). ScoutError on every rank when strict and the world changed.

        Args:
            saved_world: the world size that saved the rows (None: unknown, taken as this one).
            name: the state's key, for messages.
        """
        import torch.distributed as dist

        from scout_ckpt.errors import ScoutError

        self.name, self._loaded = name, None
        world = dist.get_world_size()
        if saved_world is None or saved_world == world:
            self._loading_from = None
            return
        if self.strict:
            raise ScoutError(
                f"{name}: saved by {saved_world} ranks, this job has {world} (RankLocal(strict=False) "
                "restores the ranks that still exist)"
            )
        self._loading_from = saved_world

    def end_load(self) -> None:
        self._loading_from, self._loaded = None, None

    def _rows(self, sd: dict) -> dict:
        from torch.distributed.tensor import DTensor, Shard

        if self._mesh is None:
            self._mesh = _world_mesh()
        out = {}
        for k, v in sd.items():
            if isinstance(v, dict):
                out[k] = self._rows(v)
            elif isinstance(v, torch.Tensor):
                local = v.detach().reshape(1, *v.shape).to(self._mesh.device_type).clone()
                out[k] = DTensor.from_local(local, self._mesh, [Shard(0)], run_check=False)
            else:
                raise TypeError(f"RankLocal: {k!r} is a {type(v).__name__}; only tensors (and dicts of them)")
        return out

    def state_dict(self) -> dict:
        if self._loading_from is None:
            return self._rows(self.inner.state_dict())
        if self._loaded is not None:
            return self._loaded

        def full(d: dict) -> dict:
            return {
                k: full(v) if isinstance(v, dict) else torch.zeros((self._loading_from, *v.shape), dtype=v.dtype)
                for k, v in d.items()
            }

        return full(self.inner.state_dict())

    def load_state_dict(self, sd: dict) -> None:
        if self._loading_from is None:

            def local(d: dict) -> dict:
                return {k: local(v) if isinstance(v, dict) else v.to_local()[0].cpu() for k, v in d.items()}

            self.inner.load_state_dict(local(sd))
            return
        import torch.distributed as dist

        from scout_ckpt.save import log

        self._loaded = sd
        saved, rank, world = self._loading_from, dist.get_rank(), dist.get_world_size()

        def row(d: dict) -> dict:
            return {k: row(v) if isinstance(v, dict) else v[rank].clone() for k, v in d.items()}

        if rank < saved:
            self.inner.load_state_dict(row(sd))
        else:
            log.logger.warning(
                "rank %d: %s not restored: the checkpoint was saved by %d ranks and has no row for "
                "this rank, which keeps its own fresh values",
                rank,
                self.name,
                saved,
            )
        if rank == 0 and saved > world:
            log.logger.warning(
                "%s of ranks %d..%d not restored: the checkpoint was saved by %d ranks, this job has %d",
                self.name,
                world,
                saved - 1,
                saved,
                world,
            )
