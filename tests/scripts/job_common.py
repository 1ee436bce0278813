"""What the S3 and multi-node test jobs share: their own oracle (sha256 of the model and optimizer state, computed
without scout-ckpt, printed when the job saves and after it loads; the test compares the two, not scout-ckpt's
verdicts) and their training step. examples/train_ddp.py keeps its own copy: it stays standalone for users."""

from __future__ import annotations

import hashlib

import torch


def digest(model, opt) -> str:
    """sha256 over the model's and the optimizer's tensors (and scalars), in name order."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        v = v.to_local() if hasattr(v, "to_local") else v  # a DTensor (FSDP2): this rank's shard
        h.update(k.encode())
        h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for pid, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{pid}.{k}".encode())
            if torch.is_tensor(v):
                v = v.to_local() if hasattr(v, "to_local") else v
                h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(v).encode())
    return h.hexdigest()


def train_step(model, opt, g: torch.Generator) -> None:
    """One step of the jobs' toy regression: a batch from this rank's generator, forward, backward, update."""
    x = torch.randn(16, 32, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
