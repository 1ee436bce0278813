"""A user's DDP job (or, with --model fsdp, FSDP2 with frozen and trainable parameters) with the fast tier (tests/test_fast_tier.py, bench/fast_tier.py): durable saves every
--save-every steps, local saves every --local-every steps through `ckpt.step(step, state)`.

    torchrun --nnodes 2 --nproc-per-node 2 ... tests/scripts/fast_tier_job.py ROOT --local-every 2 --save-every 6

The durable tier is ROOT, or with --uri s3://BUCKET/PREFIX --endpoint URL an object store (ROOT then holds the
ledger, as `ledger_dir`). The node-local directory is SCOUT_TEST_LOCAL_DIR (each agent is given its own, as each node has its own disk),
else --local-dir. Faults (--fault, at --fault-step on node --fault-node, local rank --fault-local):
`crash` SIGKILLs that worker once per job (marker file ROOT/fault.json); `midsave` SIGKILLs it once per job
in the commit of the fault step's local save (a local-save step), once its own file is written and before the
step can be recorded (the Checkpointer's fault hook, point `local_written`: the folders left are orphans); `node` SIGKILLs that node's agent and
every worker of the node (each of them, at the same step: the node is gone); both first wait for the last local
commit to land (`ckpt.wait()`, unless --no-wait), so that the step a restart must load is known; `sdc` makes that rank's copy of one
weight differ by one ulp just before the local save at the fault step (once per job: the marker file).

Every rank prints `FT-JOB {json}` lines: after each save the digest of the state it just saved (sha256 of the
model and optimizer, computed without scout-ckpt: the oracle), after loading the step, tier and digest of what it
loaded, and `at` lines (time and step) that bench/fast_tier.py reads. A local save commits in the background:
`local_saved` says the save began (its digest is that of the state it copied), not that it was certified.
"""

import argparse
import datetime
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from job_common import digest, train_step  # noqa: E402 (beside this script: torchrun puts its folder on sys.path)
from torch.nn.parallel import DistributedDataParallel as DDP

from scout_ckpt import Checkpointer, LiveStateCorrupt, LocalTierOptions, ModelOptimizerState
from scout_ckpt.testing.faults import fault_points


def say(**kw) -> None:
    # one write per line: the node's workers share the agent's stdout
    sys.stdout.write("FT-JOB " + json.dumps(kw) + "\n")
    sys.stdout.flush()


def _mid_save_killer(args, rank: int, node: int, local: int, marker: Path, local_dir: str):
    """The Checkpointer's fault hook for --fault midsave: SIGKILL this worker in its local save's commit thread,
    once its own file is written and before anything is recorded (the commit needs every rank), so the step's
    folders on every node are left with no ledger row."""
    if args.fault != "midsave" or node != args.fault_node or local != args.fault_local:
        return None

    def hook(point: str, step: int) -> None:
        if point == "local_written" and step == args.fault_step and not marker.exists():
            written = sorted(str(p) for p in Path(local_dir).glob(f"*/step-{step:08d}/rank-{rank}.pt"))
            marker.write_text(
                json.dumps(
                    {
                        "kind": "midsave",
                        "rank": rank,
                        "node": node,
                        "step": step,
                        "local_dir": local_dir,
                        "written": written,
                        "time": time.time(),
                    }
                )
            )
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--local-dir", default=None)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=6)
    ap.add_argument("--local-every", type=int, default=2)
    ap.add_argument("--keep-local", type=int, default=2)
    ap.add_argument("--no-local", action="store_true", help="the same job without the fast tier (the bench)")
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--no-wait", action="store_true", help="fault without waiting for the last local commit")
    ap.add_argument("--fault", choices=["none", "crash", "midsave", "node", "sdc"], default="none")
    ap.add_argument("--fault-node", type=int, default=1)
    ap.add_argument("--fault-local", type=int, default=0)
    ap.add_argument("--fault-step", type=int, default=7)
    ap.add_argument("--pg-timeout", type=float, default=60.0)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument(
        "--model",
        choices=["ddp", "fsdp"],
        default="ddp",
        help="fsdp: fully_shard per Linear and at the root, the first Linear's bias frozen",
    )
    ap.add_argument(
        "--uri",
        default=None,
        help="durable tier on an object store (s3://...): ROOT is then the "
        "ledger_dir; with --endpoint (the S3 server's URL)",
    )
    ap.add_argument("--endpoint", default=None)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    node, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    root = Path(args.root)
    local_dir = os.environ.get("SCOUT_TEST_LOCAL_DIR") or args.local_dir
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, args.width), nn.ReLU(), nn.Linear(args.width, 8))
    if args.model == "fsdp":  # FSDP2 as users write it, with a frozen parameter beside the trainable ones
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        net[0].bias.requires_grad_(False)
        for m in (net[0], net[2]):
            fully_shard(m, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    else:
        model = DDP(net)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tier = False if args.no_local else LocalTierOptions(dir=local_dir, every=args.local_every, keep=args.keep_local)
    marker = root / "fault.json"
    began = time.time()  # after the imports and the process group: the Checkpointer's start-up begins
    durable = (
        {"ledger_dir": root, "storage_options": {"client_kwargs": {"endpoint_url": args.endpoint}}} if args.uri else {}
    )
    with fault_points(_mid_save_killer(args, rank, node, local, marker, local_dir)):
        ckpt = Checkpointer(
            args.uri or root,
            model=model,
            optimizer=opt,
            timeout_s=args.pg_timeout,
            local=tier,
            async_save=args.async_save,
            **durable,
        )
    state = {"app": ModelOptimizerState(model, opt)}
    ready = time.time()
    start = ckpt.load_latest_clean(state) or 0
    say(
        event="loaded",
        rank=rank,
        node=node,
        run_id=ckpt.run_id,
        step=start,
        tier=ckpt.loaded_tier,
        digest=digest(model, opt),
        world=dist.get_world_size(),
        time=time.time(),
        began=began,
        ready=ready,
        fetched=(getattr(ckpt.local, "last_loaded", None) or {}).get("fetched"),
    )

    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(start + 1, args.steps + 1):
        train_step(model, opt, g)
        time.sleep(args.step_sleep)
        say(event="at", rank=rank, step=step, time=time.time())
        here = node == args.fault_node and step == args.fault_step
        if args.fault == "sdc" and here and local == args.fault_local and not marker.exists():
            marker.write_text(json.dumps({"kind": "sdc", "rank": rank, "step": step}))
            with torch.no_grad():  # one ulp on one replica: consensus must see it
                p = next(model.parameters())
                p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(float("inf")))
        if args.fault in ("crash", "node") and here and not args.no_wait:
            ckpt.wait()  # the last local commit has landed: the oracle knows which step must be resumed
        if args.fault == "crash" and here and local == args.fault_local and not marker.exists():
            marker.write_text(json.dumps({"kind": "crash", "rank": rank, "step": step, "time": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
        if args.fault == "node" and here:
            if local == args.fault_local:
                marker.write_text(
                    json.dumps(
                        {
                            "kind": "node",
                            "rank": rank,
                            "node": node,
                            "step": step,
                            "local_dir": local_dir,
                            "host": socket.gethostname(),
                            "time": time.time(),
                        }
                    )
                )
            try:
                os.kill(os.getppid(), signal.SIGKILL)  # the agent: nothing restarts this node's workers
            except ProcessLookupError:
                pass
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            t0 = time.monotonic()
            ckpt.step(step, state)
            blocked = time.monotonic() - t0  # taken before the oracle's digest, which is not the save's time
            if tier and step % args.local_every == 0:
                say(
                    event="local_saved",
                    rank=rank,
                    run_id=ckpt.run_id,
                    step=step,
                    digest=digest(model, opt),
                    blocking_s=blocked,
                    own_s=ckpt.local.last_blocking_s,
                    phases=ckpt.local.last_phases,
                )
            if step % args.save_every == 0:
                t0 = time.monotonic()
                v = ckpt.save(step, state)
                blocked = time.monotonic() - t0
                say(
                    event="saved",
                    rank=rank,
                    run_id=ckpt.run_id,
                    step=step,
                    state=(v or {}).get("state"),
                    digest=digest(model, opt),
                    blocking_s=blocked,
                )
        except LiveStateCorrupt as e:
            say(event="live_fault", rank=rank, run_id=ckpt.run_id, step=step, fault_step=e.step)
            # test-only: every rank raises together, but the first to exit has torchrun terminate the others, which
            # may not have printed yet (the coordinator records the verdict first); the test reads every rank's line
            try:
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
            except RuntimeError:
                pass  # a rank that never raised: its line is missing, and the test names it
            raise
    ckpt.close()
    dist.barrier()  # without it destroy_process_group can hang at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
