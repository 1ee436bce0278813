"""What the framework jobs of bench/framework_save.py share: the A/B contest of one save, the options every job
takes, the model shapes, and the result each job hands back.

Each job (`bench/_framework_<fw>.py`) is a user-shaped training script of one framework, started by torchrun on 2
CPU/gloo ranks. Per size it builds the framework's model, optimizer and drop-in, then trains and, every
`--steps-per-save` optimizer steps, saves the same state twice: with the framework's own save and with the
scout-ckpt drop-in as its docs give it (defaults), the order alternating round by round, so load from other
processes hits both alike. A job module defines the two saves; `Contest` times them (from a barrier on a gloo group
of its own, on every rank; the slowest rank decides when a collective save is done) and `finish` writes, on rank 0,
one JSON object to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from typing import Callable

# Model shapes per size. "tiny" is each framework's smallest sensible model (the job says which); "large" holds at
# least 100 MB of parameters and optimizer state per rank: a replicated model (DDP, ZeRO-1, Megatron DP) at width 512
# with 4 blocks (13 M parameters: 131-157 MB per rank with AdamW), a sharded one (FSDP2) at width 768 with 3 blocks
# (22 M parameters: 132 MB per rank on 2 ranks).
LARGE_MIN_BYTES = 100 * 10**6
VOCAB = 512


def options(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True, help="rank 0 writes the result here (JSON)")
    ap.add_argument("--sizes", default="tiny,large")
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds at the large size")
    ap.add_argument("--tiny-rounds", type=int, default=8, help="timed rounds at the tiny size")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (imports, page cache, first plans)")
    ap.add_argument("--steps-per-save", type=int, default=2)
    ap.add_argument("--width", type=int, default=512, help="large size, replicated models")
    ap.add_argument("--layers", type=int, default=4, help="large size, replicated models")
    ap.add_argument("--sharded-width", type=int, default=768, help="large size, sharded (FSDP2) models")
    ap.add_argument("--sharded-layers", type=int, default=3, help="large size, sharded (FSDP2) models")
    ap.add_argument("--profile", default=None, help="cProfile the scout saves into DIR/<fw>-<size>-rank<R>.prof")
    return ap.parse_args()


def rounds(args: argparse.Namespace, size: str) -> int:
    """Timed rounds plus the untimed warm-up rounds at `size`."""
    return args.warmup + (args.tiny_rounds if size == "tiny" else args.rounds)


def transformer(width: int, layers: int, vocab: int = VOCAB):
    """A small causal transformer LM (embedding, blocks of attention + MLP, head), the shape of PyTorch's FSDP2
    example and of bench/whole_save.py. Deterministic: seeded here."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.heads = 4

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
            self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

        def forward(self, tokens):
            x = self.embedding(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    return LM()


def lm_loss(model, step: int, rank: int, vocab: int = VOCAB, batch: int = 4, seq: int = 32):
    """The LM's loss on a batch drawn from (step, rank): each rank its own data, as under data parallelism."""
    import torch
    import torch.nn.functional as F

    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1000 * step + rank))
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def local_bytes(tensors) -> int:
    """Bytes of the tensors this rank holds (a DTensor: its local shard); each storage counted once."""
    import torch

    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = t._local_tensor if hasattr(t, "_local_tensor") else t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def du(path: str) -> int:
    """Bytes of the files under `path`."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Contest:
    """The A/B of one size: `round(i)` runs both saves of round i, the order alternating; rounds below `warmup`
    are not counted. `framework(i)` and `scout(i)` are the two saves (collective, every rank); `after_framework(i)`
    runs untimed after the framework's save (the jobs measure what it wrote). Neither contender's folders are
    removed during the run: each save writes into fresh space, as a run's saves do (a write into space just freed
    costs the kernel less, which would favour whichever contender's files were removed)."""

    def __init__(
        self,
        framework: Callable[[int], object],
        scout: Callable[[int], object],
        *,
        warmup: int,
        after_framework: Callable[[int], None] | None = None,
        profile: str | None = None,
    ):
        import torch.distributed as dist

        self.dist = dist
        self.pg = dist.new_group(backend="gloo")  # the barriers and the final gather: never the job's own group
        self.saves = {"framework": framework, "scout": scout}
        self.after_framework = after_framework
        self.warmup = warmup
        self.times: dict[str, list[float]] = {"framework": [], "scout": []}
        self.cpu: dict[str, list[float]] = {"framework": [], "scout": []}
        self.verdicts: list[object] = []
        self.profile = None
        self.profile_path = profile
        if profile:
            import cProfile

            self.profile = cProfile.Profile()

    def _one(self, who: str, i: int) -> None:
        self.dist.barrier(group=self.pg)
        c0, t0 = _cpu_s(), time.perf_counter()
        if self.profile is not None and who == "scout" and i >= self.warmup:
            self.profile.enable()
        out = self.saves[who](i)
        if self.profile is not None:
            self.profile.disable()
        dt, dc = time.perf_counter() - t0, _cpu_s() - c0
        self.dist.barrier(group=self.pg)  # untimed: the next contender starts when this save is done everywhere
        if who == "framework" and self.after_framework is not None:
            self.after_framework(i)
            self.dist.barrier(group=self.pg)
        if who == "scout":
            self.verdicts.append(out)
        if i >= self.warmup:
            self.times[who].append(dt)
            self.cpu[who].append(dc)

    def round(self, i: int) -> None:
        for who in ("scout", "framework") if i % 2 == 0 else ("framework", "scout"):
            self._one(who, i)

    def result(self, state_bytes: int, checkpoint_bytes: dict[str, int], **extra) -> dict | None:
        """Collective: every rank's samples gathered; rank 0 gets the merged result (None elsewhere)."""
        if self.profile is not None and self.profile_path:
            self.profile.dump_stats(f"{self.profile_path}-rank{self.dist.get_rank()}.prof")
        mine = {"times": self.times, "cpu": self.cpu, "state_bytes": state_bytes}
        every: list = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(every, mine, group=self.pg)
        if self.dist.get_rank() != 0:
            return None
        n = len(self.times["scout"])
        merged = {k: [max(g["times"][k][j] for g in every) for j in range(n)] for k in self.times}
        cpu = {k: statistics.median(max(g["cpu"][k][j] for g in every) for j in range(n)) for k in self.cpu}
        return {
            "samples_s": merged,
            "cpu_s": cpu,
            "state_bytes_per_rank": min(g["state_bytes"] for g in every),
            "checkpoint_bytes": checkpoint_bytes,
            "verdicts": [v.get("state") if isinstance(v, dict) else v for v in self.verdicts],
            **extra,
        }


def run_sizes(args, run_size, *extra) -> None:
    """Every rank: `run_size(args, size, size_dir, *extra)` for each size asked for, the results written by
    `finish`, then the default group torn down (the frameworks leave it alive)."""
    import torch.distributed as dist

    results = {}
    for size in args.sizes.split(","):
        results[size] = run_size(args, size, os.path.join(os.path.dirname(os.path.abspath(args.out)), size), *extra)
    finish(args, results)
    dist.barrier()
    dist.destroy_process_group()


def finish(args: argparse.Namespace, results: dict) -> None:
    """Rank 0: the job's result (per size) into --out, written whole or not at all."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, args.out)
