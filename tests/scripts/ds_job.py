"""A small DeepSpeed job (2 CPU/gloo ranks under torchrun) with scout-ckpt's DeepSpeed integration, for
tests/test_integration_deepspeed.py. Its own oracle: sha256 of every rank's model and optimizer state (the ranks'
digests joined in rank order), computed here without scout-ckpt and written to --events when it saves, when it has
loaded a checkpoint, and at the end; the test compares those, not scout-ckpt's verdicts.

The user's lines are the two marked "scout-ckpt"; the rest is a plain DeepSpeed loop: initialize, load_checkpoint
(tag=None: `latest`), train, save_checkpoint every --save-every steps (default tag global_stepN).

Test-only: --sdc-rank R --sdc-from S makes rank R's first layer compute one output channel off by 1e-3 in every
forward from step S on (failing arithmetic: every replica then averages it in and still agrees); --diverge-at S makes rank 1's copy of one weight differ by one ulp before the save of step S (its
replicas then disagree); --nan-at S puts a NaN into rank 1's partition of the Adam moments (ZeRO 1-2). --crash-at S makes rank 1 SIGKILL itself in the middle of the save of step S (after writing its first
file) on the first attempt (TORCHELASTIC_RESTART_COUNT 0). DeepSpeed's shm comm op is switched off: on CPU it is
JIT-compiled with g++ at start-up (about 70 s the first time), and gloo does the same work.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # test-only: see the module docstring

from scout_ckpt.errors import LiveStateCorrupt  # noqa: E402
from scout_ckpt.integrations.deepspeed import install  # noqa: E402  scout-ckpt


def state_digest(engine) -> str:
    """sha256 over this rank's module state and optimizer state (tensors and scalars, in key order), joined over
    the ranks in rank order: the same on every rank."""
    h = hashlib.sha256()

    def walk(prefix, obj):
        if isinstance(obj, torch.Tensor):
            h.update(prefix.encode())
            h.update(obj.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(f"{prefix}.{k}", obj[k])
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)
        elif isinstance(obj, (int, float, bool, str)) or obj is None:
            h.update(f"{prefix}={obj!r}".encode())

    walk("module", engine.module.state_dict())
    sd = engine.optimizer.state_dict()
    opt = sd.get("base_optimizer_state") or sd.get("optimizer_state_dict") or sd
    walk("optimizer", opt.get("state", opt) if isinstance(opt, dict) else opt)
    for key in ("single_partition_of_fp32_groups", "fp32_flat_groups"):
        if key in sd:
            walk(key, sd[key])
    walk("steps", engine.global_steps)
    mine = h.hexdigest()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return ":".join(x[:16] for x in every)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("save_dir")
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--accept-single-owner", action="store_true")
    ap.add_argument("--crash-at", type=int, default=None)
    ap.add_argument("--diverge-at", type=int, default=None)
    ap.add_argument("--nan-at", type=int, default=None)
    ap.add_argument("--sdc-rank", type=int, default=None, help="this rank computes the first layer wrongly...")
    ap.add_argument("--sdc-from", type=int, default=None, help="...from this step on (one channel off by 1e-3)")
    ap.add_argument("--no-replay", action="store_true")
    ap.add_argument("--export", default=None, help="save_16bit_model into this directory at the end")
    ap.add_argument("--no-close", action="store_true", help="end without scout.close() (it is optional)")
    ap.add_argument("--events", required=True)
    args = ap.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "zero_optimization": {"stage": args.stage},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    scout = install(
        engine,
        args.save_dir,
        accept_single_owner=args.accept_single_owner,  # scout-ckpt
        **({"replay": False} if args.no_replay else {}),
    )
    faulty = [False]  # test-only: set by the loop from the forward of step --sdc-from on, on --sdc-rank
    if args.sdc_rank == rank:  # failing arithmetic in one rank's forward (any replay of it on this rank too)

        def sdc(module, inputs, output):
            if faulty[0]:
                output = output.clone()
                output[..., 0] += 1e-3
            return output

        engine.module[0].register_forward_hook(sdc)

    def record(**row):
        if rank == 0:
            with open(args.events, "a") as f:
                f.write(json.dumps({"attempt": attempt, **row}) + "\n")

    path, _ = engine.load_checkpoint(args.save_dir)
    start = engine.global_steps
    if path is not None:
        record(event="resumed", step=start, digest=state_digest(engine))

    if args.crash_at is not None and attempt == 0 and rank == 1:
        # the checkpoint engine DeepSpeed calls for each file (scout-ckpt's, which writes the file itself with
        # DeepSpeed's torch.save settings): the kill falls after this rank's first file of the step is on disk
        file_save = scout.save

        def save_then_die(*a, **kw):  # DeepSpeed passes `state_dict=, path=` by keyword at ZeRO-3
            file_save(*a, **kw)
            if engine.global_steps == args.crash_at:
                os.kill(os.getpid(), signal.SIGKILL)

        scout.save = save_then_die

    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(4, 16, generator=g)
        faulty[0] = args.sdc_from is not None and step >= args.sdc_from
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        record(event="step", step=step, loss=float(loss))
        if step == args.diverge_at and rank == 1:
            with torch.no_grad():
                w = engine.module[0].weight
                w.view(-1)[0] = torch.nextafter(w.view(-1)[0], torch.tensor(float("inf")))
        if step == args.nan_at and rank == 1:  # one NaN in rank 1's own (single-owner) Adam moment partition
            moments = next(iter(engine.optimizer.optimizer.state.values()))
            moments["exp_avg"].view(-1)[0] = float("nan")
        if step % args.save_every == 0:
            try:
                engine.save_checkpoint(args.save_dir)
            except LiveStateCorrupt as e:
                record(
                    event="live_fault",
                    step=step,
                    verdict=e.verdict["state"],
                    codes=sorted({r["code"] for r in e.verdict["reasons"]}),
                )
                raise
            record(
                event="saved",
                step=step,
                digest=state_digest(engine),
                verdict=scout.last_verdict["state"],
                latest=open(os.path.join(args.save_dir, "latest")).read()
                if os.path.exists(os.path.join(args.save_dir, "latest"))
                else None,
            )
    record(event="final", step=engine.global_steps, digest=state_digest(engine))
    if args.export:
        engine.save_16bit_model(args.export)  # an export, not a checkpoint: passes through unrecorded
    if not args.no_close:
        scout.close()


if __name__ == "__main__":
    main()
