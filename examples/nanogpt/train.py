"""A GPT training loop in the shape of nanoGPT's train.py, with scout-ckpt instead of torch.save/torch.load.

The lines marked `# scout-ckpt` are the whole integration (examples/nanogpt/README.md shows them as a diff).
Run on random tokens, 2 CPU ranks, restarted by torchrun after a crash:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 --max-restarts 2 \
        examples/nanogpt/train.py --out_dir=/tmp/gpt --max_iters=40 --eval_interval=10

Overrides are `--name=value` for any global below (nanoGPT's configurator style). Test-only knobs:
`--crash_rank/--crash_iter` SIGKILL one rank in the first attempt; `--log_file` makes each rank append one JSON line
per save and per resume (to LOG_FILE.rankR) with a digest of the model and optimizer state (the independent oracle of the tests).
"""

import hashlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import destroy_process_group, init_process_group
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import GPT, GPTConfig  # noqa: E402

from scout_ckpt import Checkpointer, ModelOptimizerState, RankLocal, RNGState, Scalars  # scout-ckpt

# -----------------------------------------------------------------------------
out_dir = "out"
eval_interval = 10
log_interval = 1
eval_iters = 4
dataset_dir = ""  # holds train.bin / val.bin (uint16 tokens); made from random tokens when empty
gradient_accumulation_steps = 2
batch_size = 4
block_size = 16
n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.0
bias = True
vocab_size = 128
learning_rate = 6e-4
max_iters = 40
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0
warmup_iters = 4
lr_decay_iters = 40
min_lr = 6e-5
backend = "gloo"
pass_unwrapped = False  # give Checkpointer model.module instead of the DDP wrapper (both work the same)
replay = True  # scout-ckpt's SDC replay of every block, the embedding, the head and the optimizer (False: off)
crash_rank = -1
crash_iter = -1
log_file = ""
for arg in sys.argv[1:]:  # nanoGPT's configurator, reduced to --key=value
    key, _, value = arg.lstrip("-").partition("=")
    assert key in globals(), f"unknown config key {key}"
    globals()[key] = type(globals()[key])(value) if not isinstance(globals()[key], bool) else value == "True"
# -----------------------------------------------------------------------------

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")  # scout-ckpt logs
torch.set_num_threads(1)
init_process_group(backend=backend)
ddp_rank, ddp_world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
master_process = ddp_rank == 0
seed_offset = ddp_rank  # each process gets a different seed, as in nanoGPT
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(1337 + seed_offset)
np.random.seed(1337 + seed_offset)

data_dir = Path(dataset_dir or out_dir)
if master_process:
    data_dir.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 20_000), ("val", 2_000)):
        if not (data_dir / f"{split}.bin").exists():
            tokens = np.random.default_rng(0 if split == "train" else 1).integers(0, vocab_size, n, dtype=np.uint16)
            tmp = data_dir / f".{split}.bin.tmp"
            tokens.tofile(tmp)
            os.replace(tmp, data_dir / f"{split}.bin")
dist.barrier()


def get_batch(split):
    data = np.memmap(data_dir / f"{split}.bin", dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
    return x, y


iter_num = 0
best_val_loss = 1e9
model = GPT(
    GPTConfig(
        block_size=block_size,
        vocab_size=vocab_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        dropout=dropout,
        bias=bias,
    )
)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
model = DDP(model)
raw_model = model.module

X, Y = get_batch("train")  # fetch the very first batch (moved up: a resumed run restores it below)


class PrefetchedBatch(Stateful):  # scout-ckpt: the batch drawn before the save, so a resumed run trains on it
    def state_dict(self):
        return {"x": X, "y": Y}

    def load_state_dict(self, sd):
        global X, Y
        X, Y = sd["x"], sd["y"]


ckpt = Checkpointer(
    out_dir,
    model=raw_model if pass_unwrapped else model,
    optimizer=optimizer,  # scout-ckpt
    replay=replay,
)
extra = {"best_val_loss": best_val_loss}  # scout-ckpt: only rank 0 evaluates, so this is rank-local
state = {
    "app": ModelOptimizerState(model, optimizer),  # scout-ckpt
    "rng": RankLocal(RNGState()),
    "batch": RankLocal(PrefetchedBatch()),  # scout-ckpt
    "extra": RankLocal(Scalars(extra)),
}  # scout-ckpt
iter_num = ckpt.load_latest_clean(state) or 0  # scout-ckpt
best_val_loss = extra["best_val_loss"]  # scout-ckpt


def state_digest():
    """sha256 of the model and optimizer state as DCP sees it: what the tests compare across save and resume."""
    h = hashlib.sha256()
    sd = ModelOptimizerState(model, optimizer).state_dict()

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(f"{prefix}.{k}", obj[k])
        elif isinstance(obj, torch.Tensor):
            h.update(prefix.encode())
            h.update(obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix}={obj!r}".encode())

    walk("", sd)
    return h.hexdigest()


def record(event, **kw):
    if log_file:
        with open(f"{log_file}.rank{ddp_rank}", "a") as f:
            f.write(json.dumps({"event": event, "attempt": attempt, "iter": iter_num, **kw}) + "\n")


record("resume", digest=state_digest(), batch=X.sum().item())


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + np.cos(np.pi * ratio)) * (learning_rate - min_lr)


t0 = time.time()
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0 and iter_num > 0:
        if master_process:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            best_val_loss = extra["best_val_loss"] = min(best_val_loss, float(losses["val"]))
        ckpt.save(iter_num, state)  # scout-ckpt: every rank, in place of rank 0's torch.save
        record("save", digest=state_digest(), batch=X.sum().item())
    if iter_num == max_iters:
        break
    for micro_step in range(gradient_accumulation_steps):
        model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        _, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    ckpt.step(iter_num)  # scout-ckpt
    if iter_num % log_interval == 0 and master_process:
        print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}, time {time.time() - t0:.2f}s")
        t0 = time.time()
    if attempt == 0 and ddp_rank == crash_rank and iter_num == crash_iter:
        os.kill(os.getpid(), signal.SIGKILL)

ckpt.close()  # scout-ckpt
dist.barrier()  # scout-ckpt: without it destroy_process_group can hang at exit (docs/pytorch-facts.md)
destroy_process_group()
