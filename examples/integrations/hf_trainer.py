"""A Hugging Face Trainer job with certified checkpoints: the two lines of the integration are marked.

    torchrun --standalone --nproc-per-node 2 examples/integrations/hf_trainer.py OUTPUT_DIR --steps 10

A tiny GPT-2 built from a config (no download) learns random tokens on CPU (gloo). On a restart it resumes from
the newest *certified* checkpoint-N, never merely the newest folder. Test-only options: --kill-rank/--kill-step
SIGKILL a rank in the middle of a save (after the Trainer wrote the folder, before scout-ckpt certified it), only
in torchrun's first attempt; --sdc-rank/--sdc-step make one rank's transformer.h.1 compute wrongly from a step on
(every call, as failing hardware); --hang-rank/--hang-step block one rank forever before a step's forward in
the first attempt (writing OUTPUT_DIR/fault.json), and likewise --crash-rank/--crash-step SIGKILL one rank there,
--desync-rank/--desync-step make one rank issue an all_reduce the others never do (a rank-dependent branch), and
--slow-rank/--slow-s make one rank sleep that long before every step's forward (a slow data loader; fault.json
at its first slow step); --observer passes the callback's observer options (JSON); --trainer-resume resumes with
the Trainer's own `resume_from_checkpoint=True` (its newest checkpoint-N) instead of (2); --losses appends {"step", "loss",
"attempt"} lines (rank 0). Rank 0 ends with
one JSON line: where it resumed from, the last step, and what the observer watched ("counted": DDP's wrapper).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from scout_ckpt.integrations.transformers import ScoutTrainerCallback, latest_clean
from scout_ckpt.options import ObserverOptions


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


class Record(TrainerCallback):
    """Test support: loss lines, and a SIGKILL in the middle of a save (placed before ScoutTrainerCallback, so it
    runs after the Trainer wrote checkpoint-N and before scout-ckpt hashed and certified it)."""

    def __init__(
        self,
        losses: str | None,
        kill_rank: int | None,
        kill_step: int | None,
        sdc_rank: int | None = None,
        sdc_step: int | None = None,
        hang_rank: int | None = None,
        hang_step: int | None = None,
        output_dir: str = ".",
        faults: dict | None = None,
    ):
        self.losses, self.kill_rank, self.kill_step = losses, kill_rank, kill_step
        self.faults = faults or {}  # {"crash"|"desync": (rank, step), "slow": (rank, seconds)}
        self.sdc_rank, self.sdc_step = sdc_rank, sdc_step
        self.hang_rank, self.hang_step, self.output_dir = hang_rank, hang_step, output_dir
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.step = 0  # the optimizer step being taken (global_step + 1 during its forward)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """--sdc-rank/--sdc-step: from that step on, this rank's transformer.h.1 computes one output channel
        1e-3 off at every call (its replays too), as failing hardware would."""
        if self.rank == self.sdc_rank and model is not None:

            def fault(mod, inputs, out):
                if self.step < self.sdc_step:
                    return None
                hidden = out[0].clone() if isinstance(out, tuple) else out.clone()
                hidden[..., 3] += 1e-3
                return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

            model.transformer.h[1].register_forward_hook(fault)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1
        if self.attempt != 0:
            return
        if self.rank == self.hang_rank and self.step == self.hang_step:
            # --hang-rank/--hang-step: this rank blocks forever before the step's forward, in the first attempt
            self._mark("hang")
            threading.Event().wait()
        if (self.rank, self.step) == self.faults.get("crash"):
            self._mark("crash")  # --crash-rank/--crash-step: SIGKILLed before the step's forward
            os.kill(os.getpid(), signal.SIGKILL)
        if (self.rank, self.step) == self.faults.get("desync"):
            self._mark("desync")  # --desync-rank/--desync-step: an all_reduce only this rank issues
            torch.distributed.all_reduce(torch.ones(3))
        if self.rank == self.faults.get("slow", (None,))[0]:
            if not os.path.exists(os.path.join(self.output_dir, "fault.json")):
                self._mark("slow")
            time.sleep(self.faults["slow"][1])  # --slow-rank/--slow-s: every step, before its forward

    def _mark(self, kind: str) -> None:
        with open(os.path.join(self.output_dir, "fault.json"), "w") as f:
            json.dump({"kind": kind, "rank": self.rank, "step": self.step, "time": time.time()}, f)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.losses and self.rank == 0 and logs and "loss" in logs:
            with open(self.losses, "a") as f:
                f.write(json.dumps({"step": state.global_step, "loss": logs["loss"], "attempt": self.attempt}) + "\n")

    def on_save(self, args, state, control, **kwargs):
        if self.attempt == 0 and self.rank == self.kill_rank and state.global_step == self.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("output_dir")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None, help="save_total_limit (taken over by the callback)")
    ap.add_argument("--no-resume", action="store_true")
    ap.add_argument("--trainer-resume", action="store_true", help="resume_from_checkpoint=True instead of (2)")
    ap.add_argument("--losses", default=None)
    ap.add_argument("--kill-rank", type=int, default=None)
    ap.add_argument("--kill-step", type=int, default=None)
    ap.add_argument("--sdc-rank", type=int, default=None)
    ap.add_argument("--sdc-step", type=int, default=None)
    ap.add_argument("--hang-rank", type=int, default=None)
    ap.add_argument("--hang-step", type=int, default=None)
    ap.add_argument("--crash-rank", type=int, default=None)
    ap.add_argument("--crash-step", type=int, default=None)
    ap.add_argument("--desync-rank", type=int, default=None)
    ap.add_argument("--desync-step", type=int, default=None)
    ap.add_argument("--slow-rank", type=int, default=None)
    ap.add_argument("--slow-s", type=float, default=0.1)
    ap.add_argument("--observer", default=None, help="JSON: the callback's observer options (default: its own)")
    a = ap.parse_args()
    torch.set_num_threads(1)

    cfg = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.steps,
        save_strategy="steps",
        save_steps=a.save_every,
        save_total_limit=a.limit,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_timeout=300,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
    )
    observer = ObserverOptions.from_dict(json.loads(a.observer)) if a.observer else True  # a JSON flag's table
    scout = ScoutTrainerCallback(observer=observer)  # (1)
    record = Record(
        a.losses,
        a.kill_rank,
        a.kill_step,
        a.sdc_rank,
        a.sdc_step,
        a.hang_rank,
        a.hang_step,
        a.output_dir,
        faults={
            "crash": (a.crash_rank, a.crash_step),
            "desync": (a.desync_rank, a.desync_step),
            "slow": (a.slow_rank, a.slow_s),
        },
    )
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(512, 16, 64), callbacks=[record, scout])
    resume = None if a.no_resume else latest_clean(a.output_dir)  # (2)
    if a.trainer_resume:  # the Trainer's own choice (get_last_checkpoint), which scout-ckpt's verdicts steer
        resume = True
    resumed_from = get_last_checkpoint(a.output_dir) if resume is True else resume  # what the Trainer will load
    trainer.train(resume_from_checkpoint=resume)
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            json.dumps(
                {
                    "resumed_from": resumed_from,
                    "global_step": trainer.state.global_step,
                    "observer_attached": scout.observer_attached,
                }
            )
        )


if __name__ == "__main__":
    main()
