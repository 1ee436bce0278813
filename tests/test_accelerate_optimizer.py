"""accelerate's `prepare` returns an AcceleratedOptimizer, an Optimizer subclass that is not the optimizer that
steps: replay (and shard evidence) took it as an unsupported optimizer and silently replayed no optimizer. The
real accelerate (pinned in the Makefile) wraps a real AdamW here; the wrapped one must be what replay sees."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from scout_ckpt.replay.optimizer_replay import supports, unwrap_optimizer


def test_the_optimizer_accelerate_prepared_is_unwrapped_for_replay():
    model = torch.nn.Linear(4, 4)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, prepared = Accelerator(cpu=True).prepare(model, inner)
    assert type(prepared).__name__ == "AcceleratedOptimizer" and not supports(prepared)
    assert unwrap_optimizer(prepared) is inner and supports(unwrap_optimizer(prepared))
    assert unwrap_optimizer(inner) is inner and unwrap_optimizer(None) is None
