"""Rank workers for the FSDP2 evidence tests (shard update replay, at-rest check): a tiny transformer under
`fully_shard` on a CPU mesh, with the faults a failing chip would produce on a single-owner shard."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scout_ckpt.replay.shard_optimizer import ShardUpdateReplay, digest
from scout_ckpt.save.evidence.at_rest import AtRestGuard

VOCAB, SEQ, BATCH = 64, 16, 4


class Block(nn.Module):
    def __init__(self, d: int, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, d: int = 32, n_blocks: int = 2, vocab: int = VOCAB):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(world: int, *, d: int = 32, n_blocks: int = 2, vocab: int = VOCAB, opt: str = "adamw"):
    """The FSDP2 model (fully_shard per block and at the root) and its optimizer, identical on every call."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLM(d, n_blocks, vocab)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if opt == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    elif opt == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True, weight_decay=0.01)
    elif opt == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    else:
        raise ValueError(opt)
    return model, optimizer


def batch(step: int, rank: int, vocab: int = VOCAB, seq: int = SEQ, bsz: int = BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 131 + rank)
    return torch.randint(0, vocab, (bsz, seq + 1), generator=g)


def train_step(model, optimizer, tokens, vocab: int = VOCAB) -> None:
    loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def state_digests(model, optimizer) -> dict[str, str]:
    """Digest of every local shard (parameters and optimizer state): what training produced on this rank."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = digest([p.to_local()])
        for k, v in sorted(optimizer.state.get(p, {}).items()):
            out[f"{name}:{k}"] = digest([v.to_local() if hasattr(v, "to_local") else v])
    return out


def _local(model, name: str) -> torch.Tensor:
    return dict(model.named_parameters())[name].to_local()


def w_train(
    rank,
    world,
    steps,
    *,
    evidence=True,
    opt="adamw",
    update_fault=None,
    flip=None,
    save_every=3,
    chunk=256,
    per_step=16,
    compare_off=False,
):
    """Train `steps` steps with the evidence on; save points every `save_every` steps run the at-rest check.

    update_fault = (rank, from_step, param, index): from that step on, that rank's live update of one element of
    its local shard lands one ulp off (a faulty ALU: persistent), inside optimizer.step, before the capture.
    flip = (rank, step, param, index): flip the lowest mantissa bit of one element of that rank's shard between
    the step and the save point. compare_off: also train without the evidence and compare every shard's bits."""
    model, optimizer = build(world, opt=opt)
    current = {"step": 0}
    if update_fault and update_fault[0] == rank:
        _, since, pname, idx = update_fault

        def faulty(opt_, args, kwargs):  # registered first: runs before the evidence's post-hooks
            if current["step"] >= since:
                with torch.no_grad():
                    t = _local(model, pname).view(-1)
                    t[idx] = torch.nextafter(t[idx], torch.tensor(float("inf")))

        optimizer.register_step_post_hook(faulty)
    replay = guard = None
    if evidence:
        replay = ShardUpdateReplay(optimizer, model, chunk=chunk, per_step=per_step, timeout_s=120)
        guard = AtRestGuard(optimizer, model, timeout_s=120)
    rows, at_rest = [], []
    for step in range(1, steps + 1):
        current["step"] = step
        train_step(model, optimizer, batch(step, rank))
        if replay is not None:
            rows += replay.on_step(step)
        if flip and flip[0] == rank and flip[1] == step:
            with torch.no_grad():
                t = _local(model, flip[2]).view(-1).view(torch.int32)
                t[flip[3]] ^= 1
        if guard is not None and step % save_every == 0:
            at_rest.append(guard.check(step))
    if replay is not None:
        rows += replay.close()
    out = {
        "rows": rows,
        "at_rest": at_rest,
        "digests": state_digests(model, optimizer),
        "cycle": replay.cycle if replay else None,
        "units": replay.unit_counts if replay else None,
    }
    if compare_off:
        m2, o2 = build(world, opt=opt)
        for step in range(1, steps + 1):
            train_step(m2, o2, batch(step, rank))
        out["digests_off"] = state_digests(m2, o2)
    return out


def w_scenarios(rank, world, scenarios: dict):
    """Several `w_train` runs in the same processes (one start-up instead of several): name -> result."""
    return {name: w_train(rank, world, **kw) for name, kw in scenarios.items()}


def w_checkpointer_on_off(rank, world, root, steps=6, save_every=3):
    """The same FSDP2 training through the Checkpointer at its defaults (shard evidence on) and with
    `shard_evidence=False`: every local shard's bits after `steps` steps, and the verdicts of the saves."""
    from scout_ckpt import Checkpointer, ModelOptimizerState

    out = {}
    for arm, kw in (("on", {}), ("off", {"shard_evidence": False})):
        model, optimizer = build(world)
        ckpt = Checkpointer(f"{root}/{arm}", model=model, optimizer=optimizer, timeout_s=300, **kw)
        state = {"app": ModelOptimizerState(model, optimizer)}
        verdicts = []
        for step in range(1, steps + 1):
            train_step(model, optimizer, batch(step, rank))
            ckpt.step(step)
            if step % save_every == 0:
                verdicts.append(ckpt.save(step, state)["state"])
        ckpt.close()
        out[arm] = {"digests": state_digests(model, optimizer), "verdicts": verdicts, "shard": ckpt.shard is not None}
    return out
