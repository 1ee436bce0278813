"""Rank bodies for tests/test_replay_tp.py: a user's tensor-parallel model (repeated blocks whose `up` projection is
column-parallel and `down` row-parallel, the head replicated), on a TP-only mesh (2 ranks) or FSDP2 x TP (2 x 2),
with the Checkpointer's defaults.

The oracle is the job's own sha256 of every full tensor (gathered with `full_tensor`, independent of scout-ckpt),
taken at each save; a second generation loads the latest clean checkpoint and digests what it loaded.

Fault kinds, on one rank from one step on, persistent (as failing hardware computes wrongly every time):
  forward    the rank's shard of one block's column-parallel output is off by 1e-3 in one channel
  backward   the gradient that block's `up` sends back to its input is off by 1e-3 on the rank
  optimizer  after each optimizer step, one element of the rank's shard of that block's `up` weight moves by 1e-3
"""

from __future__ import annotations

import hashlib

D, H, BLOCKS = 16, 32, 3


def _digest(model) -> str:
    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(name.encode())
        h.update(full.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _build(world: int):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(D, H)
            self.down = nn.Linear(H, D)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block() for _ in range(BLOCKS)])
            self.head = nn.Linear(D, 4)

        def forward(self, x):
            for b in self.layers:
                x = b(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Model()
    dp = world // 2
    mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
    for b in model.layers:
        parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if dp > 1:
        for b in model.layers:
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh


def _arm(model, kind: str, armed) -> None:
    """The fault, active while armed() is true (from its step on)."""
    import torch

    up = model.layers[1].up
    if kind == "forward":

        def fwd(m, args, out):
            if not armed():
                return None
            out = out.clone()
            out[..., 0] += 1e-3
            return out

        up.register_forward_hook(fwd)
    elif kind == "backward":

        def bwd(m, grad_input, grad_output):
            if not armed() or grad_input[0] is None:
                return None
            g = grad_input[0].clone()
            g[..., 0] += 1e-3
            return (g, *grad_input[1:])

        up.register_full_backward_hook(bwd)
    elif kind != "optimizer":
        raise ValueError(kind)

    def optimizer_fault() -> None:
        if kind == "optimizer" and armed():
            with torch.no_grad():
                w = up.weight.to_local() if hasattr(up.weight, "to_local") else up.weight
                w.view(-1)[3] += 1e-3

    model._scout_test_optimizer_fault = optimizer_fault


def w_tp_job(rank, world, root, steps, save_every, fault=None):
    """One generation with the defaults, then a restart that loads the latest clean checkpoint. fault: (rank, kind,
    from step) or None. Returns {"saved": {step: digest}, "verdicts": {step: state}, "ended": step or None,
    "loaded_step", "loaded"}."""
    import torch

    from scout_ckpt import Checkpointer, LiveStateCorrupt, ModelOptimizerState

    step_now = [0]
    model, opt, mesh = _build(world)
    if fault is not None and fault[0] == rank:
        _arm(model, fault[1], lambda: step_now[0] >= fault[2])
    ckpt = Checkpointer(root, model=model, optimizer=opt)
    saved, verdicts, ended = {}, {}, None
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(1, steps + 1):
        step_now[0] = step
        torch.manual_seed(100 * step + dp_rank)  # the same batch on a TP group, another per data-parallel rank
        model(torch.randn(4, D)).sum().backward()
        opt.step()
        opt.zero_grad()
        getattr(model, "_scout_test_optimizer_fault", lambda: None)()
        ckpt.step(step)
        if step % save_every == 0:
            saved[step] = _digest(model)
            try:
                verdicts[step] = ckpt.save(step, {"app": ModelOptimizerState(model, opt)})["state"]
            except LiveStateCorrupt:  # the generation ends on every rank (torchrun would restart it)
                ended = step
                break
    ckpt.close()

    model2, opt2, _ = _build(world)
    ckpt2 = Checkpointer(root, model=model2, optimizer=opt2)
    loaded = ckpt2.load_latest_clean({"app": ModelOptimizerState(model2, opt2)})
    out = {"saved": saved, "verdicts": verdicts, "ended": ended, "loaded_step": loaded, "loaded": _digest(model2)}
    ckpt2.close()
    return out
