"""A user's DDP job saving to S3 under torchrun (tests/test_s3.py): checkpoints in `s3://bucket/prefix`, the
ledger in a local `ledger_dir`, the endpoint of an S3-compatible store in `storage_options`.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/scripts/s3_ddp_job.py \
        s3://bucket/run LEDGER_DIR --endpoint http://127.0.0.1:PORT --kill-rank 1 --kill-step 6

Fault: in the first generation only (TORCHELASTIC_RESTART_COUNT == 0; one agent, so the count is the same on
every worker), the worker with global rank --kill-rank SIGKILLs itself at --kill-step: `--kill-at save` in the
middle of that step's save, at the last write of its file (before it is sent) (through the Checkpointer's fault hook, the one test-only
option used here), `--kill-at train` after that step's optimizer step, before its save.

Rank 0 prints `S3-JOB {json}` lines: at every save the sha256 of the model and optimizer state it just saved, and
after loading the step and the sha256 of what it loaded, so the test judges a resume by the job's own digests
(an oracle independent of scout-ckpt's verification).
"""

import argparse
import datetime
import json
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
from job_common import digest, train_step  # noqa: E402 (beside this script: torchrun puts its folder on sys.path)
from torch.nn.parallel import DistributedDataParallel as DDP

from scout_ckpt import Checkpointer, ModelOptimizerState
from scout_ckpt.testing.faults import fault_points


def say(**kw) -> None:
    print("S3-JOB " + json.dumps(kw) + "\n", end="", flush=True)  # one write: the ranks share stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("uri")
    ap.add_argument("ledger_dir")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--kill-step", type=int, default=0, help="0: no fault")
    ap.add_argument("--kill-at", choices=["save", "train"], default="save")
    ap.add_argument("--pg-timeout", type=float, default=120.0)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    first_generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    armed = first_generation and args.kill_step > 0 and rank == args.kill_rank

    def hook(point, step):
        if armed and args.kill_at == "save" and point == "during_write" and step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with fault_points(hook if armed else None):
        ckpt = Checkpointer(
            args.uri,
            ledger_dir=args.ledger_dir,
            model=model,
            optimizer=opt,
            storage_options={"client_kwargs": {"endpoint_url": args.endpoint}},
            timeout_s=args.pg_timeout,
        )
    state = {"app": ModelOptimizerState(model, opt)}
    start = ckpt.load_latest_clean(state) or 0
    if rank == 0:
        say(
            event="loaded",
            run_id=ckpt.run_id,
            step=start,
            digest=digest(model, opt),
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )

    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(start + 1, args.steps + 1):
        train_step(model, opt, g)
        ckpt.step(step)
        if armed and args.kill_at == "train" and step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step % args.save_every == 0:
            verdict = ckpt.save(step, state)
            if rank == 0:
                say(event="saved", run_id=ckpt.run_id, step=step, digest=digest(model, opt), state=verdict["state"])
    ckpt.close()
    dist.barrier()  # without it destroy_process_group can hang at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
