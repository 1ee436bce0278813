"""The DDP wrapper of a model that a framework keeps to itself.

Accelerate keeps the bare model in `Accelerator._models` and hands the caller `DistributedDataParallel(model)`;
the Hugging Face Trainer's callbacks receive the bare model while the Trainer trains `model_wrapped`. The observer
needs the wrapper: it counts DDP's collectives on DDP's process group and stamps the steps on the module that
runs them. Replay finds its targets through the wrapper under the same user paths as on the bare model
(replay/targets.py), so handing the Checkpointer the wrapper changes nothing else.
"""

from __future__ import annotations

import gc

import torch


def ddp_wrapper_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The DistributedDataParallel that wraps `model`, or None. The wrapper holds the model in its `_modules`
    dict, which its instance dict holds (or, where the interpreter keeps instance attributes inline, the wrapper
    itself): a few scans of the referrers, at start-up only (their cost grows with the objects alive; never call
    it per step)."""
    ddp = torch.nn.parallel.DistributedDataParallel
    if isinstance(model, ddp):
        return model
    for modules in gc.get_referrers(model):
        if not isinstance(modules, dict) or modules.get("module") is not model:
            continue
        for holder in gc.get_referrers(modules):
            if isinstance(holder, ddp) and holder.module is model:
                return holder
            if isinstance(holder, dict) and holder.get("_modules") is modules:
                for owner in gc.get_referrers(holder):
                    if isinstance(owner, ddp) and owner.module is model:
                        return owner
    return None


__all__ = ["ddp_wrapper_of"]
