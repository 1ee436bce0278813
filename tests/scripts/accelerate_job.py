"""A user-shaped Hugging Face Accelerate job: a tiny GPT-2 from GPT2Config with dropout on, AdamW, a linear warmup
schedule, a shuffled DataLoader and an evaluation pass at every epoch's end, all through `prepare`, under torchrun.

With `--plain` it runs without scout-ckpt (the oracle); otherwise the scout-ckpt lines are the ones the
integration guide gives (marked "scout"). The job is its own witness, independent of scout-ckpt: every rank appends
JSON lines to TRACE.rank<R>: per step {"attempt", "step", "epoch", "idx" (the dataset indices of its batch), "loss"
and "lr" (float.hex)}, per evaluation {"eval", "epoch", "loss"}, per save and after a load {"event", "step",
"digest"} (sha256 of the model, optimizer and scheduler state, computed here), and {"event": "final", "digest"}.

Test-only faults, in torchrun's first attempt only (TORCHELASTIC_RESTART_COUNT 0), on rank --kill-rank (default 1):
--kill-step S (SIGKILL after optimizer step S) and --kill-save S (SIGKILL in the middle of the write of step S's
checkpoint). Observer faults, first attempt only, before a step's forward (the faulty rank writes ROOT/fault.json
{"kind", "rank", "step", "time"} when it strikes): --hang-rank/--hang-step (blocks forever), --crash-rank/
--crash-step (SIGKILL), --desync-rank/--desync-step (an all_reduce only this rank issues), --slow-rank/--slow-s
(sleeps that long before every step's forward); --options: ScoutCheckpointing's options (JSON).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

VOCAB, T = 64, 8


class Tokens(Dataset):
    """Each sample a pure function of its index; the index rides along so the job can log the data order."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(1000 + i))
        return {"input_ids": ids, "labels": ids.clone(), "idx": i}


def digest(model, optimizer, scheduler) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    sd = optimizer.state_dict()
    for pid, st in sorted(sd["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{pid}.{k}".encode())
            h.update(
                v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                if torch.is_tensor(v)
                else repr(v).encode()
            )
    h.update(repr([{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]).encode())
    h.update(repr(sorted((k, repr(v)) for k, v in scheduler.state_dict().items())).encode())
    return h.hexdigest()


def observer_fault(a, rank: int, step: int) -> None:
    """The observer faults, before step `step`'s forward on the faulty rank (first attempt only)."""

    def mark(kind: str) -> None:
        with open(os.path.join(a.root, "fault.json"), "w") as f:
            json.dump({"kind": kind, "rank": rank, "step": step, "time": time.time()}, f)

    if (rank, step) == (a.hang_rank, a.hang_step):
        mark("hang")
        threading.Event().wait()
    if (rank, step) == (a.crash_rank, a.crash_step):
        mark("crash")
        os.kill(os.getpid(), signal.SIGKILL)
    if (rank, step) == (a.desync_rank, a.desync_step):
        mark("desync")
        dist.all_reduce(torch.ones(3))  # a rank-dependent branch: the others never issue it
    if rank == a.slow_rank:
        if not os.path.exists(os.path.join(a.root, "fault.json")):
            mark("slow")
        time.sleep(a.slow_s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--plain", action="store_true", help="no scout-ckpt: the oracle run")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--seedable", action="store_true", help="DataLoaderConfiguration(use_seedable_sampler=True)")
    ap.add_argument("--kill-step", type=int, default=None)
    ap.add_argument("--kill-save", type=int, default=None)
    ap.add_argument("--kill-rank", type=int, default=1)
    for kind in ("hang", "crash", "desync"):
        ap.add_argument(f"--{kind}-rank", type=int)
        ap.add_argument(f"--{kind}-step", type=int)
    ap.add_argument("--slow-rank", type=int)
    ap.add_argument("--slow-s", type=float, default=0.1)
    ap.add_argument("--options", default="{}")
    a = ap.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(), dataloader_config=DataLoaderConfiguration(use_seedable_sampler=a.seedable)
    )
    rank = accelerator.process_index
    log_f = open(f"{a.trace}.rank{rank}", "a")

    def log(**rec):
        log_f.write(json.dumps({"attempt": attempt, **rec}) + "\n")
        log_f.flush()

    set_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=T, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1
    )
    model = GPT2LMHeadModel(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    train_dl = DataLoader(Tokens(a.samples), batch_size=2, shuffle=True)
    eval_dl = DataLoader(Tokens(8), batch_size=4)
    total = a.epochs * (a.samples // (2 * accelerator.num_processes))
    scheduler = get_linear_schedule_with_warmup(
        optimizer, 3 * accelerator.num_processes, total * accelerator.num_processes
    )

    fault_hook = None
    if a.kill_save is not None and attempt == 0 and rank == a.kill_rank:

        def fault_hook(point, step):
            if point == "during_write" and step == a.kill_save:
                os.kill(os.getpid(), signal.SIGKILL)

    if a.plain:
        model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
            model, optimizer, train_dl, eval_dl, scheduler
        )
        step, start_epoch = 0, 0
    else:
        from scout_ckpt.integrations.accelerate import ScoutCheckpointing
        from scout_ckpt.options import from_config  # --options is a JSON table, as a config file gives it
        from scout_ckpt.testing.faults import fault_points

        with fault_points(fault_hook):
            ckpt = ScoutCheckpointing(accelerator, a.root, **from_config(json.loads(a.options)))  # scout 1
        model, optimizer, train_dl, eval_dl, scheduler = ckpt.prepare(  # scout 2
            model, optimizer, train_dl, eval_dl, scheduler
        )
        step = ckpt.load_latest_clean() or 0  # scout 3
        start_epoch = ckpt.epoch  # scout 4
        obs = ckpt.checkpointer.observer
        log(event="observer", attached=obs.attached if obs is not None else None)  # DDP's wrapper: "counted"
        if step:
            log(event="loaded", step=step, digest=digest(accelerator.unwrap_model(model), optimizer, scheduler))

    for epoch in range(start_epoch, a.epochs):
        model.train()
        for batch in train_dl:
            if attempt == 0:
                observer_fault(a, rank, step + 1)
            out = model(input_ids=batch["input_ids"], labels=batch["labels"])
            accelerator.backward(out.loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            log(
                step=step,
                epoch=epoch,
                idx=batch["idx"].tolist(),
                loss=float(out.loss.detach()).hex(),
                lr=float(scheduler.get_last_lr()[0]).hex(),
            )
            if not a.plain:
                ckpt.step(step)  # scout 5
                if step % a.save_every == 0:
                    verdict = ckpt.save(step)  # scout 6
                    log(
                        event="save",
                        step=step,
                        state=verdict["state"],
                        digest=digest(accelerator.unwrap_model(model), optimizer, scheduler),
                    )
            if a.kill_step == step and attempt == 0 and rank == a.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
        model.eval()  # the end-of-epoch evaluation: its DataLoader iterator draws from torch's RNG too
        with torch.no_grad():
            losses = [float(model(input_ids=b["input_ids"], labels=b["labels"]).loss) for b in eval_dl]
        log(eval=True, epoch=epoch, loss=[v.hex() for v in losses])

    log(event="final", step=step, digest=digest(accelerator.unwrap_model(model), optimizer, scheduler))
    if not a.plain:
        ckpt.close()  # scout 7
    elif dist.is_initialized():
        dist.barrier()
    accelerator.end_training()


if __name__ == "__main__":
    main()
