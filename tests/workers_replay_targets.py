"""Models in the shapes of real code bases (written here: no downloads, no transformers dependency) and the rank
workers that train them under DDP / FSDP2 with the replay runner: target discovery through wrappers, the
save-boundary sweep, optimizer windows over every parameter.

Shapes: Hugging Face (`model.embed_tokens`, `model.layers`, `model.norm`, `lm_head`), GPT-2 / nanoGPT
(`transformer.wte`, `transformer.wpe`, `transformer.h`, `transformer.ln_f`, `lm_head` tied to wte), TorchTitan
(`tok_embeddings`, `layers` as a ModuleDict keyed "0", "1", ..., `norm`, `output`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, D, SEQ, BATCH, LAYERS = 48, 16, 8, 2, 2


class Attn(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class DecoderLayer(nn.Module):
    """A pre-norm block; `fault_scale != 1` corrupts one output element persistently (bad hardware: an attribute,
    so the replay's copy computes the same wrong value)."""

    fault_scale: float = 1.0

    def __init__(self, d: int = D):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attn = Attn(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        out = x + self.mlp(self.post_attention_layernorm(x))
        if self.fault_scale != 1.0:
            scale = torch.ones_like(out)
            scale.view(-1)[0] = self.fault_scale
            out = out * scale
        return out


class HFInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class HFCausalLM(nn.Module):
    """LlamaForCausalLM's attribute layout."""

    def __init__(self):
        super().__init__()
        self.model = HFInner()
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        return self.lm_head(self.model(tokens))


class GPT2(nn.Module):
    """nanoGPT's layout, with the weight tying it does (`transformer.wte.weight = lm_head.weight`)."""

    def __init__(self, vocab: int = VOCAB, d: int = D, seq: int = SEQ, layers: int = LAYERS):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(  # noqa: C408 -- nanoGPT's own spelling
                wte=nn.Embedding(vocab, d),
                wpe=nn.Embedding(seq, d),
                drop=nn.Dropout(0.0),
                h=nn.ModuleList(DecoderLayer(d) for _ in range(layers)),
                ln_f=nn.LayerNorm(d),
            )
        )
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.transformer.drop(self.transformer.wte(tokens) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class Titan(nn.Module):
    """TorchTitan's Transformer layout: blocks in a ModuleDict keyed by layer id."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleDict({str(i): DecoderLayer() for i in range(LAYERS)})
        self.norm = nn.LayerNorm(D)
        self.output = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.norm(x))


class NoBlocks(nn.Module):
    """Nothing repeated: discovery must refuse it rather than cover nothing."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, VOCAB)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


SHAPES = {"hf": HFCausalLM, "gpt2": GPT2, "titan": Titan}
EXPECTED = {
    "hf": [("embedding", "model.embed_tokens")]
    + [("block", f"model.layers.{i}") for i in range(LAYERS)]
    + [("head", "lm_head")],
    "gpt2": [("embedding", "transformer.wte"), ("embedding", "transformer.wpe")]
    + [("block", f"transformer.h.{i}") for i in range(LAYERS)]
    + [("head", "lm_head")],
    "titan": [("embedding", "tok_embeddings")]
    + [("block", f"layers.{i}") for i in range(LAYERS)]
    + [("head", "output")],
}


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The unwrapped blocks of a built (unwrapped) model, for fault injection."""
    if isinstance(model, HFCausalLM):
        return list(model.model.layers)
    if isinstance(model, GPT2):
        return list(model.transformer.h)
    return list(model.layers.values())


def wrap_blocks_with_checkpointing(model: nn.Module) -> None:
    """Activation checkpointing as TorchTitan and HF apply it: each block replaced by a CheckpointWrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    holder = (
        model.model.layers
        if isinstance(model, HFCausalLM)
        else (model.transformer.h if isinstance(model, GPT2) else model.layers)
    )
    for name, block in list(holder.named_children()):
        holder.register_module(name, checkpoint_wrapper(block))


def build(shape: str, seed: int = 0, checkpointing: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = SHAPES[shape]()
    if checkpointing:
        wrap_blocks_with_checkpointing(model)
    return model


def tokens_for(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 131 + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def loss_of(model, tokens) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train_step(model, opt, step: int, rank: int) -> None:
    """One optimizer step on this rank's tokens for `step` (the data every replay worker trains on)."""
    loss_of(model, tokens_for(step, rank)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _train(model, opt, runner, rank, steps, save_at=(), faults=None, inner=None, no_show=()):
    """Train `steps` steps; sweep at the steps in save_at (announced with expect_save before their forward).
    faults: {rank: (block index, from step, scale)}. no_show: steps announced as saves whose sweep never comes."""
    rows = []
    for step in range(1, steps + 1):
        if step in save_at or step in no_show:
            runner.expect_save(step)
        if faults and rank in faults and step == faults[rank][1]:
            blocks_of(inner)[faults[rank][0]].fault_scale = faults[rank][2]
        train_step(model, opt, step, rank)
        rows += runner.on_step(step)
        if step in save_at:
            rows += runner.sweep(step)
    return rows


def _runner(model, opt, groups, **kw):
    from scout_ckpt.replay.runner import ReplayRunner

    return ReplayRunner(model, opt, groups=groups, **kw)


# ---- workers (module level: run_ranks starts them) -----------------------------------------------------------


def w_discover_wrapped(rank, world, kind):
    """For each shape: targets found on the wrapped model (DDP or FSDP2, blocks checkpoint-wrapped for Titan as
    TorchTitan does), equal to those of the unwrapped model; then 2 steps with a sweep at step 2: every target
    replays, and agrees."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from scout_ckpt.consensus.groups import ConsensusGroups
    from scout_ckpt.replay.targets import discover

    groups = ConsensusGroups.create("ddp" if kind == "ddp" else "fsdp", world)
    out = {}
    for shape in SHAPES:
        model = build(shape, checkpointing=shape == "titan")
        plain = discover(model)
        if kind == "ddp":
            wrapped = DDP(model)
            inner_names = discover(wrapped.module)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            holder = {"hf": lambda m: m.model.layers, "gpt2": lambda m: m.transformer.h, "titan": lambda m: m.layers}[
                shape
            ](model)
            for block in holder.children():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            wrapped = model
            inner_names = plain
        found = discover(wrapped)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        runner = _runner(wrapped, opt, groups, interval=1)
        # DDP, HF shape: 2 more steps, a save announced at 3 that never comes (its rotation replay, left to
        # that sweep, is run by on_step(4))
        more = kind == "ddp" and shape == "hf"
        rows = _train(
            wrapped, opt, runner, rank, 4 if more else 2, save_at=(2,), inner=model, no_show=(3,) if more else ()
        )
        runner.close()
        out[shape] = {
            "plain": plain,
            "found": found,
            "inner": inner_names,
            "rows": rows,
            "classes": sorted({type(b).__name__ for b in blocks_of(model)}),
        }
    return out


def w_sweep(rank, world, steps, save_at, expect=(), faults=None, bitwise=False, unarmed=(), poke=(), head_fault=None):
    """The demo-like TinyLM of workers_replay, rotation far apart (interval 1000: only sweeps run). Saves at
    `save_at`: announced with expect_save for the steps in `expect`, the rest must be predicted by the runner
    from the period of the earlier saves (before the first announcement, every step is captured). `unarmed`: steps where sweep is called without any announcement.
    bitwise: also train without the runner and compare the final state bit for bit. poke: steps after whose
    optimizer step (before the sweep) user code writes in place into the activation blocks.0 received (kept by a
    forward hook of its own), as an in-place post-processing of a kept tensor would. head_fault: (rank, from step,
    output element, scale): the LAST module target computes one interior element wrongly (workers_replay.FaultyHead)."""
    from tests import workers_replay as wr

    groups = wr.make_groups(world)
    model, opt = wr.setup(rank)
    kept = []
    model.blocks[0].register_forward_pre_hook(lambda m, args: kept.append(args[0]))
    runner = _runner(model, opt, groups, interval=1000)
    rows, armed_at = [], {}
    for step in range(1, steps + 1):
        if step in expect:
            runner.expect_save(step)
        live = runner._live
        armed_at[step] = live is not None and live[0] == step
        if faults and rank in faults and step == faults[rank][1]:
            model.blocks[faults[rank][0]].fault_scale = faults[rank][2]
        if head_fault and rank == head_fault[0] and step == head_fault[1]:
            wr.fault_head(model, head_fault[2], head_fault[3])
        kept.clear()
        wr.train_step(model, opt, rank, world, step)
        rows += runner.on_step(step)
        if step in poke:
            with torch.no_grad():
                kept[0].add_(1.0)
        if step in save_at or step in unarmed:
            rows += runner.sweep(step)
    out = {"rows": rows, "targets": runner.targets(), "armed_at": armed_at}
    if bitwise:
        runner.close()
        state_a = wr._state(model, opt)
        model_b, opt_b, _, _ = wr.run(rank, world, steps, faults=faults, head_fault=head_fault)
        state_b = wr._state(model_b, opt_b)
        out["bitwise"] = len(state_a) == len(state_b) and all(torch.equal(a, b) for a, b in zip(state_a, state_b))
    return out


class LastElementFaultyAdamW(torch.optim.AdamW):
    """From `corrupt` on, the live update of the LAST parameter's LAST element is off (a bad kernel that only
    hits the tail of the flat parameter list)."""

    corrupt = False

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        if self.corrupt:
            self.param_groups[-1]["params"][-1].view(-1)[-1] *= 1.5
        return loss


def w_optimizer_last_element(rank, world, steps, bad_rank, from_step, opt_elems):
    """Titan shape (its last parameter is the large `output.weight`), only the optimizer replayed, every step."""
    from scout_ckpt.consensus.groups import ConsensusGroups

    groups = ConsensusGroups.create("ddp", world)
    model = build("titan")
    opt = LastElementFaultyAdamW(model.parameters(), lr=1e-2)
    runner = _runner(model, opt, groups, targets=["optimizer"], interval=1, opt_elems=opt_elems)
    rows = []
    for step in range(1, steps + 1):
        if rank == bad_rank and step == from_step:
            opt.corrupt = True
        loss_of(model, tokens_for(step, 0)).backward()  # same batch everywhere: replicas stay equal
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rows += runner.on_step(step)
    last = list(model.parameters())[-1]
    return {"rows": rows, "last_numel": last.numel(), "n_params": len(list(model.parameters()))}


def w_sweep_cost(rank, world, which, steps, saves):
    """Seconds per train step, per train step with every target's sweep capture armed, and per sweep, for the
    demo model or a GPT-2-shaped one (explicit gradient all-reduce, as the demo trains). Median over `saves`
    sweeps after one warm-up sweep."""
    import statistics
    import time

    from scout_ckpt.consensus.groups import ConsensusGroups

    torch.manual_seed(0)
    if which == "demo":
        from scout_ckpt.demo.model import TinyTransformer

        model, vocab, seq, batch = TinyTransformer(), 256, 32, max(1, 16 // world)
    else:  # GPT-2 layout at a size this CPU trains in about a second a step
        vocab, seq, batch = 8192, 128, 4
        model = GPT2(vocab=vocab, d=256, seq=seq, layers=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runner = _runner(model, opt, ConsensusGroups.create("ddp", world), interval=10**9)
    plain, armed, sweep = [], [], []
    for i in range(steps + saves + 1):
        step = i + 1
        save = i >= steps
        if save:
            runner.expect_save(step)
        dist.barrier()
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(step * 131 + rank)
        tok = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        logits = model(tok[:, :-1])
        F.cross_entropy(logits.reshape(-1, vocab), tok[:, 1:].reshape(-1)).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        runner.on_step(step)
        dist.barrier()
        t1 = time.perf_counter()
        rows = runner.sweep(step) if save else []
        dist.barrier()
        t2 = time.perf_counter()
        if save:
            assert rows and all(r["status"] == "AGREE" for r in rows), rows
            if i > steps:  # the first sweep warms up
                armed.append(t1 - t0)
                sweep.append(t2 - t1)
        elif i:
            plain.append(t1 - t0)
    med = statistics.median
    return {
        "which": which,
        "params": sum(p.numel() for p in model.parameters()),
        "targets": len(runner.targets()),
        "step_s": med(plain),
        "armed_step_s": med(armed),
        "sweep_s": med(sweep),
        "sweep_per_step": med(sweep) / med(plain),
        "amortized_100": (med(sweep) + med(armed) - med(plain)) / (100 * med(plain)),
    }


def w_nanogpt_compiled(rank, world, steps, save_at):
    """nanoGPT's order: model = torch.compile(model); model = DDP(model). The "eager" backend keeps it cheap on
    CPU; dynamo skips hooks added after compiling all the same, which is what the runner must handle."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from scout_ckpt.consensus.groups import ConsensusGroups
    from scout_ckpt.replay.targets import discover

    inner = build("gpt2")
    model = DDP(torch.compile(inner, backend="eager"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    runner = _runner(model, opt, ConsensusGroups.create("ddp", world), interval=1)
    rows = _train(model, opt, runner, rank, steps, save_at=save_at, inner=inner)
    runner.close()
    return {"found": discover(model), "rows": rows, "stance_restored": not runner._eager}


def w_sweep_and_optimizer(rank, world, sweep_kw, opt_kw):
    """Both 3-rank scenarios in one start-up (each on its own groups)."""
    return {"sweep": w_sweep(rank, world, **sweep_kw), "optimizer": w_optimizer_last_element(rank, world, **opt_kw)}
