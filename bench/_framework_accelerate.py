"""bench/framework_save.py's Accelerate job (torchrun, 2 CPU/gloo ranks, `Accelerator(cpu=True)`): a GPT-2 from
`GPT2Config` with AdamW, a linear warmup schedule and a shuffled DataLoader, all prepared through the drop-in
(`ScoutCheckpointing(accelerator, ROOT).prepare(...)`, defaults). Every --steps-per-save optimizer steps the same
state is saved with Accelerate's own `accelerator.save_state(dir)` and with `ckpt.save(step)`, the order
alternating. tiny: tests/scripts/accelerate_job.py's GPT-2 (n_embd 32, 2 layers, vocab 64); large: n_embd --width,
--layers layers, vocab 512.
"""

from __future__ import annotations

import os

import _framework_common as fc
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

from scout_ckpt.integrations.accelerate import ScoutCheckpointing

T = 16


class Tokens(Dataset):
    """Each sample a pure function of its index (as the integration's docs ask)."""

    def __init__(self, n: int, vocab: int):
        self.n, self.vocab = n, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (T,), generator=torch.Generator().manual_seed(1000 + i))
        return {"input_ids": ids, "labels": ids.clone()}


def run_size(args, size: str, root: str) -> dict | None:
    accelerator = Accelerator(cpu=True)  # one per size: save_state saves every model an Accelerator prepared
    torch.manual_seed(0)
    if size == "tiny":
        vocab, cfg = 64, GPT2Config(vocab_size=64, n_positions=T, n_embd=32, n_layer=2, n_head=2)
    else:
        vocab = fc.VOCAB
        cfg = GPT2Config(vocab_size=vocab, n_positions=T, n_embd=args.width, n_layer=args.layers, n_head=4)
    model = GPT2LMHeadModel(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    total = fc.rounds(args, size) * args.steps_per_save
    train_dl = DataLoader(Tokens(2 * 2 * total, vocab), batch_size=2, shuffle=True)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, total)
    ckpt = ScoutCheckpointing(accelerator, os.path.join(root, "scout"))  # scout-ckpt: the drop-in, defaults
    model, optimizer, train_dl, scheduler = ckpt.prepare(model, optimizer, train_dl, scheduler)
    step = 0
    sizes: dict[str, int] = {}

    def framework(i: int) -> None:
        accelerator.save_state(os.path.join(root, "accelerate", f"step-{step}"))  # a folder per save, as ROOT's

    def scout(i: int) -> dict | None:
        return ckpt.save(step)  # scout-ckpt

    def after_framework(i: int) -> None:
        if accelerator.is_main_process:
            sizes["framework"] = fc.du(os.path.join(root, "accelerate", f"step-{step}"))

    contest = fc.Contest(
        framework,
        scout,
        warmup=args.warmup,
        after_framework=after_framework,
        profile=args.profile and os.path.join(args.profile, f"accelerate-{size}"),
    )
    for batch in train_dl:
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
        accelerator.backward(out.loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        step += 1
        ckpt.step(step)  # scout-ckpt
        if step % args.steps_per_save == 0:
            contest.round(step // args.steps_per_save - 1)
        if step == total:
            break
    inner = accelerator.unwrap_model(model)
    held = fc.local_bytes([*inner.parameters(), *(t for st in optimizer.state.values() for t in st.values())])
    if accelerator.is_main_process:
        sizes["scout"] = fc.du(os.path.join(root, "scout", f"step-{step:08d}"))
    result = contest.result(held, sizes, model="GPT2LMHeadModel", parameters=sum(p.numel() for p in inner.parameters()))
    ckpt.close()  # scout-ckpt
    accelerator.free_memory()
    return result


def main() -> None:
    args = fc.options(__doc__.splitlines()[0])
    fc.run_sizes(args, run_size)


if __name__ == "__main__":
    main()
