"""Rank workers for the replay tests: a tiny transformer trained data-parallel with explicit gradient all-reduce
(bitwise-reproducible, unlike DDP's bucket rebuild), with faults a failing chip would produce."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, SEQ, BATCH = 64, 32, 4, 16, 4


class Block(nn.Module):
    """Attention + MLP, pre-norm residual. `fault_scale != 1` multiplies one output element, persistently: it is
    an attribute, so a deep copy of the block (the replay) computes the same wrong value, as bad hardware would."""

    fault_scale: float = 1.0
    slow_s: float = 0.0  # a slow chip: every forward (live and replayed) takes this much longer

    def __init__(self, d: int = D, heads: int = HEADS, dropout: float = 0.1):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow_s:
            time.sleep(self.slow_s)
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        out = x + self.drop(self.fc2(F.gelu(self.fc1(self.norm2(x)))))
        if self.fault_scale != 1.0:
            scale = torch.ones_like(out)
            scale.view(-1)[0] = self.fault_scale
            out = out * scale
        return out


class TinyLM(nn.Module):
    def __init__(self, n_blocks: int = 2):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class FaultyHead(nn.Linear):
    """The head with one interior output element off by `fault_scale` (an attribute, as Block's: the replay's copy
    computes the same wrong value)."""

    fault_elem: int = 0
    fault_scale: float = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.fault_scale != 1.0:
            scale = torch.ones_like(out)
            scale.view(-1)[self.fault_elem] = self.fault_scale
            out = out * scale
        return out


def fault_head(model: TinyLM, elem: int, scale: float) -> None:
    """From now on this rank's head computes output element `elem` wrongly (same parameters, same module)."""
    model.head.__class__ = FaultyHead
    model.head.fault_elem, model.head.fault_scale = elem, scale


class FaultyAdamW(torch.optim.AdamW):
    """From `corrupt` on, the live update of the first parameter's element 0 is off by a factor (a bad optimizer
    kernel). Instance state, not a hyperparameter: a fresh optimizer of this class computes correctly."""

    corrupt = False

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        if self.corrupt:
            p = self.param_groups[0]["params"][0]
            p.view(-1)[0] *= 1.5
        return loss


def setup(rank: int, seed: int = 0, n_blocks: int = 2):
    torch.manual_seed(seed)
    model = TinyLM(n_blocks)
    opt = FaultyAdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(seed + 1000 + rank)  # per-rank dropout stream, as in real data-parallel training
    return model, opt


def train_step(model, opt, rank: int, world: int, step: int, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed * 100003 + step * 131 + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    for p in model.parameters():  # explicit per-parameter all-reduce: bitwise reproducible
        dist.all_reduce(p.grad)
        p.grad.div_(world)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def make_groups(world: int):
    from scout_ckpt.consensus.groups import ConsensusGroups

    return ConsensusGroups.create("ddp", world)


def make_runner(model, opt, groups, **kw):
    from scout_ckpt.replay.runner import ReplayRunner

    return ReplayRunner(model, opt, groups=groups, **kw)


def run(rank, world, steps, *, runner=None, faults=None, opt_fault=None, seed=0, timings=None, head_fault=None):
    """Train `steps` steps; faults: {rank: (block index, from step, scale)}, opt_fault: (rank, from step),
    head_fault: (rank, from step, output element, scale)."""
    model, opt = setup(rank, seed)
    if runner is not None:
        runner = runner(model, opt)
    rows = []
    for step in range(1, steps + 1):
        if faults and rank in faults and step == faults[rank][1]:
            model.blocks[faults[rank][0]].fault_scale = faults[rank][2]
        if opt_fault and rank == opt_fault[0] and step == opt_fault[1]:
            opt.corrupt = True
        if head_fault and rank == head_fault[0] and step == head_fault[1]:
            fault_head(model, head_fault[2], head_fault[3])
        t0 = time.perf_counter()
        train_step(model, opt, rank, world, step, seed)
        t1 = time.perf_counter()
        if runner is not None:
            rows += runner.on_step(step)
        if timings is not None:
            timings.append((t1 - t0, time.perf_counter() - t1))
    return model, opt, runner, rows


def _state(model, opt) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    for p in model.parameters():
        out += [v for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    return out


# ---- workers (module level: run_ranks forks them) -------------------------------------------------------------


def w_healthy_bitwise(rank, world, steps):
    """The same seeded run with and without the runner: rows of the first, bitwise equality of the two."""
    from scout_ckpt.replay.schedule import coverage

    groups = make_groups(world)
    model_a, opt_a, runner, rows = run(rank, world, steps, runner=lambda m, o: make_runner(m, o, groups))
    rng_a = torch.get_rng_state()
    model_b, opt_b, _, _ = run(rank, world, steps)
    rng_b = torch.get_rng_state()
    a, b = _state(model_a, opt_a), _state(model_b, opt_b)
    return {
        "rows": rows,
        "targets": runner.targets(),
        "coverage": coverage(rows, runner.targets()),
        "n_state": len(a),
        "bitwise": len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)),
        "grads_none": all(p.grad is None for p in model_a.parameters()),
        "rng_equal": torch.equal(rng_a, rng_b),
        "events": runner.events(),
    }


def w_sdc(rank, world, steps, faults=None, opt_fault=None, slow=None, targets=None):
    """faults/opt_fault as in `run`; slow: (rank, seconds) added to every block forward of that rank."""
    groups = make_groups(world)

    def build(model, opt):
        if slow and rank == slow[0]:
            for block in model.blocks:
                block.slow_s = slow[1]
        return make_runner(model, opt, groups, targets=targets)

    _, _, runner, rows = run(rank, world, steps, runner=build, faults=faults, opt_fault=opt_fault)
    return {"rows": rows, "targets": runner.targets(), "events": runner.events()}


def w_cost(rank, world, steps):
    """Per-step timings (train step, on_step) to report the replay overhead."""
    groups = make_groups(world)
    timings: list = []
    _, _, runner, rows = run(rank, world, steps, runner=lambda m, o: make_runner(m, o, groups), timings=timings)
    return {"timings": timings, "rows": rows}


def w_fsdp(rank, world, steps, faults=None):
    """FSDP2 (fully_shard per block and at the root): no replicas, so the world is the peer set."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from scout_ckpt.consensus.groups import ConsensusGroups

    mesh = init_device_mesh("cpu", (world,))
    model, _ = setup(rank)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    runner = make_runner(model, opt, ConsensusGroups.create("fsdp", world))
    rows = []
    for step in range(1, steps + 1):
        if faults and rank in faults and step == faults[rank][1]:
            model.blocks[faults[rank][0]].fault_scale = faults[rank][2]
        g = torch.Generator().manual_seed(step * 131 + rank)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        rows += runner.on_step(step)
    return {
        "rows": rows,
        "targets": runner.targets(),
        "peers": runner.peers,
        "gather_exact": _gather_exact(model, mesh),
    }


def _gather_exact(model, mesh) -> bool:
    """The sweep's batched gather (capture.gather_full) against DTensor's own full_tensor(), on the model's
    parameters (dims not divisible by 3 ranks) and on tensors with fewer rows than ranks (empty shards)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from scout_ckpt.replay.capture import gather_full

    extra = [
        distribute_tensor(torch.arange(n * 3, dtype=torch.float32).view(n, 3), mesh, [Shard(0)]) for n in (1, 2, 5)
    ] + [distribute_tensor(torch.arange(7.0), mesh, [Shard(0)]), torch.ones(2)]
    ts = list(model.parameters()) + extra
    want = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in ts]
    return all(torch.equal(a, b) for a, b in zip(gather_full(ts), want))
