"""A user's FSDP2 script (PyTorch's FSDP2 example shape: a small transformer-style Net, `fully_shard` on every
Linear and at the root, AdamW, 2 ranks) with a frozen base weight (requires_grad=False, LoRA-style) beside the
trainable ones, and the Checkpointer's defaults, for `torchrun --max-restarts 1`.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/scripts/fsdp_interval_job.py ROOT \
        --steps 15 --save-every 5 [--flip RANK:STEP:PARAM:INDEX]

--flip: on the first attempt only, after the optimizer step of STEP (before `ckpt.step`), flip the lowest mantissa
bit of element INDEX of RANK's local shard of PARAM: a bit flipped in memory between two optimizer steps.

The oracle is the job's own (examples/train_fsdp.py's `full_state_digest`: sha256 of the full, unsharded model
and optimizer state, printed by rank 0 at every save and after loading), and a run without the flip. Each record
is one line `SCOUT-FSDP {json}`. `--show-runs STEP` prints which trainable tensors of each rank the at-rest interval
check covers between STEP and STEP + 1 (the documented schedule, for placing a flip)."""

import argparse
import datetime
import importlib.util
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from scout_ckpt import Checkpointer, LiveStateCorrupt, ModelOptimizerState

_spec = importlib.util.spec_from_file_location(
    "train_fsdp", Path(__file__).resolve().parents[2] / "examples" / "train_fsdp.py"
)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)
FROZEN = "blocks.0.fc1.weight"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--flip", default=None)
    ap.add_argument("--show-runs", type=int, default=None)
    ap.add_argument(
        "--pause-after",
        default=None,
        help="STEP:DIR: after saving STEP, write DIR/paused-RANK and "
        "wait until DIR/go exists (a job kept alive while another one starts on its ROOT)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = example.Net(32, 2, 64)
    dict(model.named_parameters())[FROZEN].requires_grad_(False)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    flip = args.flip.split(":") if args.flip and attempt == 0 else None

    ckpt = Checkpointer(args.root, model=model, optimizer=opt)
    state = {"app": ModelOptimizerState(model, opt)}
    start = ckpt.load_latest_clean(state) or 0
    digest = example.full_state_digest(model, opt)
    if rank == 0:
        example.say("loaded", attempt=attempt, step=start, digest=digest if start else None)
    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step * 131 + rank)
        tokens = torch.randint(0, 64, (4, 17), generator=g)
        F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 64), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        if args.show_runs == step and ckpt.shard is not None:
            guard = ckpt.shard.guard
            names, tensors = guard._tensors()
            example.say(
                "runs",
                rank=rank,
                step=step,
                parts=guard.interval_parts,
                covered=[names[i] for i in guard.part_of(names, tensors, step)],
            )
        if flip and int(flip[0]) == rank and int(flip[1]) == step:
            with torch.no_grad():
                local = dict(model.named_parameters())[flip[2]].to_local().detach().view(-1)
                local.view(torch.int32)[int(flip[3])] ^= 1
            example.say("fault", kind="flip", rank=rank, step=step, param=flip[2], attempt=attempt)
        ckpt.step(step)
        if step % args.save_every == 0:
            try:
                verdict = ckpt.save(step, state)
            except LiveStateCorrupt as e:  # every rank: the generation ends, torchrun restarts from a clean step
                example.say(
                    "saved",
                    attempt=attempt,
                    step=step,
                    rank=rank,
                    digest=None,
                    state=e.verdict["state"],
                    reasons=e.verdict["reasons"],
                    raised=True,
                )
                dist.barrier()  # every rank got here (else this hangs): no rank's record is lost to the teardown
                raise
            digest = example.full_state_digest(model, opt)
            if rank == 0:
                example.say(
                    "saved",
                    attempt=attempt,
                    step=step,
                    rank=rank,
                    digest=digest,
                    state=verdict["state"],
                    reasons=verdict["reasons"],
                    raised=False,
                )
        if args.pause_after and int(args.pause_after.split(":", 1)[0]) == step:
            signals = Path(args.pause_after.split(":", 1)[1])
            (signals / f"paused-{rank}").touch()
            while not (signals / "go").exists():
                time.sleep(0.1)
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
