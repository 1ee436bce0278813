"""The DCP recipe's `Stateful` wrapper around a model and its optimizer.

`get_state_dict`/`set_state_dict` handle DDP/FSDP2 wrappers and sharded parameters, and create the optimizer's
state before loading into it (a fresh optimizer's own state_dict() has no moments for DCP to load into).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


class ModelOptimizerState(Stateful):
    """{"model": ..., "optim": ...} for DCP; put it in the state dict you give Checkpointer.save/load."""

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
