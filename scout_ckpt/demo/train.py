"""One rank of the demo job: `python -m scout_ckpt.demo.train --args-json '{...}'`, started by torchrun.

torchrun's elastic agent (scout_ckpt/demo/launch.py starts it) gives the rank its place in the job through the
environment, as it does for any training script: RANK, WORLD_SIZE, MASTER_ADDR/PORT, and
TORCHELASTIC_RESTART_COUNT, which is the demo's generation number (0 for the first incarnation, n after torchrun's
n-th restart). Before anything else the rank writes a start record (ROOT/demo/gen{n}-rank{r}.json: when the
process started, its pid, torchrun's run id): that is how the demo sees torchrun's generation boundaries. The rank
then builds the model for its mode, resumes with `load_latest_clean`, trains, saves every `save_every` steps, and
on rank 0 writes the loss log and the final result. DDP mode averages gradients with an explicit all-reduce over
one flat buffer of fixed layout instead of DistributedDataParallel: DDP's reducer rebuilds its buckets after the
first iteration, which changes the summation order and makes a resumed run differ in the last bits
(docs/pytorch-facts.md, "Bitwise resume").
"""

from __future__ import annotations

import time

_T_START = time.time()  # before the torch import: the start-up timings in the log begin here

import argparse
import datetime
import json
import math
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import xxhash
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from scout_ckpt.demo.data import DataStream, MarkovDomains, OnlineMixer
from scout_ckpt.demo.faults import MARKER_DIR, Injector, parse_all
from scout_ckpt.demo.model import TinyTransformer, retract_to_sphere, sphere_deviation
from scout_ckpt.errors import LiveStateCorrupt
from scout_ckpt.format.layout import atomic_write_json
from scout_ckpt.options import ObserverOptions, ReplayOptions, ShardEvidenceOptions
from scout_ckpt.save.app_state import RNGState
from scout_ckpt.testing.faults import fault_points

MODES = ("ddp", "fsdp", "hsdp")


@dataclass
class WorkerArgs:
    """The job's options (the same for every rank, written by launch.py). rank, world and generation are not
    options: main() fills them from torchrun's environment."""

    root: str
    rank: int = 0
    world: int = 1
    generation: int = 0
    steps: int = 40
    save_every: int = 10
    mode: str = "ddp"
    async_save: bool = False
    inject: list[str] = field(default_factory=list)
    constraint: str | None = None  # None | "sphere"
    mixing: str | None = None  # None | "online"
    n_domains: int = 4  # used with mixing="online"
    stall_s: float = 3.0
    replay: bool = False
    seed: int = 0
    global_batch: int = 16
    lr: float = 1e-2
    pg_timeout_s: float = 60.0
    mesh_shape: tuple[int, int] | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "WorkerArgs":
        d = json.loads(text)
        if d.get("mesh_shape") is not None:
            d["mesh_shape"] = tuple(d["mesh_shape"])
        return cls(**d)


def default_mesh_shape(world: int) -> tuple[int, int]:
    """(replicate, shard) for HSDP: shard over pairs of ranks when the world divides into pairs."""
    shard = 2 if world % 2 == 0 and world >= 4 else 1
    return world // shard, shard


# ---- state -----------------------------------------------------------------------------------------------------


class AppState(Stateful):
    """The DCP state of the job: model + optimizer through get/set_state_dict (sharding-aware), and the small
    replicated pieces a bitwise resume needs: LR schedule, RNG, data position, mixing weights, step."""

    def __init__(self, model, optimizer, scheduler, data: DataStream, mixer: OnlineMixer | None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.data, self.mixer, self.rng = data, mixer, RNGState()
        self.step = 0

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sd = {
            "model": model_sd,
            "optim": optim_sd,
            "lr_schedule": {"last_epoch": torch.tensor(self.scheduler.last_epoch, dtype=torch.int64)},
            "rng": self.rng.state_dict(),
            "data": self.data.state_dict(),
            "step": torch.tensor(self.step, dtype=torch.int64),
        }
        if self.mixer is not None:
            sd["mixing"] = self.mixer.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        last = int(sd["lr_schedule"]["last_epoch"])
        self.scheduler.last_epoch, self.scheduler._step_count = last, last + 1
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        self.rng.load_state_dict(sd["rng"])
        self.data.load_state_dict(sd["data"])
        if self.mixer is not None:
            self.mixer.load_state_dict(sd["mixing"])
        self.step = int(sd["step"])


def warmup_cosine(total_steps: int, warmup: int | None = None, floor: float = 0.1):
    warmup = warmup if warmup is not None else max(1, total_steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# ---- building blocks -------------------------------------------------------------------------------------------


def build_model(mode: str, world: int, seed: int, mesh_shape: tuple[int, int] | None = None):
    """(model, mesh). Same seed on every rank: replicas start identical before any sharding."""
    torch.manual_seed(seed)
    model = TinyTransformer()
    if mode == "ddp":
        return model, None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mode == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
    elif mode == "hsdp":
        mesh = init_device_mesh(
            "cpu", tuple(mesh_shape or default_mesh_shape(world)), mesh_dim_names=("replicate", "shard")
        )
    else:
        raise ValueError(f"unknown mode {mode!r}")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh


def allreduce_grads(model: torch.nn.Module, world: int) -> None:
    """Average gradients over all ranks through one flat buffer whose layout never changes."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def state_digest(model, optimizer) -> str:
    """xxh3-128 over the full (unsharded) model and optimizer state, keys sorted: the same bits give the same
    digest however the state was sharded. Collective; the digest is valid on rank 0 only."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    h = xxhash.xxh3_128()
    flat = {f"model/{k}": v for k, v in msd.items()}
    for fqn, st in osd.get("state", {}).items():
        for k, v in st.items():
            flat[f"optim/{fqn}/{k}"] = v
    for i, group in enumerate(osd.get("param_groups", [])):
        for k, v in group.items():
            if k != "params":
                flat[f"optim/group{i}/{k}"] = v
    for key in sorted(flat):
        v = flat[key]
        h.update(key.encode())
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(v).encode())
    return f"xxh3_128:{h.hexdigest()}"


def invariants_for(args: WorkerArgs, model) -> list | None:
    """Model-intrinsic checks for the Checkpointer (which adds `finite` itself): one Frobenius sphere per
    constrained matrix (each keeps the radius it had at init) and the mixture simplex. Pure FSDP without the
    sphere gets a generous spectral bound per block matrix instead: single-owner shards have no replica to be
    compared with, so some model-intrinsic check must vouch for them (a flipped exponent bit breaks it)."""
    specs: list = []
    if args.constraint == "sphere":
        specs += [
            {"check": "frobenius_sphere", "params": name, "radius": radius, "rtol": 1e-3}
            for name, radius in model.sphere_radii.items()
        ]
    elif args.mode == "fsdp":
        specs += [{"check": "spectral_bound", "params": name, "hi": 100.0} for name in model.sphere_radii]
    if args.mixing == "online":
        specs.append({"check": "simplex", "path": "mixing.weights", "atol": 1e-6})
    return specs or None


# ---- the job ---------------------------------------------------------------------------------------------------


def train(args: WorkerArgs, timings: dict | None = None) -> dict | None:
    from scout_ckpt.checkpointer import Checkpointer

    timings = dict(timings or {})
    rank, world = args.rank, args.world
    root = Path(args.root)
    injector = Injector(parse_all(args.inject), rank, args.generation, root, args.save_every, args.steps)
    model, mesh = build_model(args.mode, world, args.seed, args.mesh_shape)
    random.seed(args.seed)
    np.random.seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.steps))
    mixer = OnlineMixer(args.n_domains) if args.mixing == "online" else None
    domains = MarkovDomains(n_domains=args.n_domains if mixer else 1, seed=args.seed)
    data = DataStream(domains, model.seq_len, args.global_batch, rank, world, seed=args.seed, mixer=mixer)
    app = AppState(model, opt, sched, data, mixer)
    state = {"app": app}

    with fault_points(injector.fault_hook):
        ckpt = Checkpointer(
            root,
            model=model,
            optimizer=opt,
            mesh=mesh,  # FSDP2 / HSDP: the mesh the blocks are sharded on (DDP: None, the world)
            async_save=args.async_save,
            # --no-replay (the demo's default when a save comes every 7 steps or fewer): replay off for ddp and hsdp;
            # pure FSDP keeps the library's default (on), which its shard evidence was measured with
            replay=(
                ReplayOptions(interval=1, save_every=args.save_every)
                if args.replay
                else True
                if args.mode == "fsdp"
                else False
            ),
            # every shard's update replayed within one save interval, so each save is certified at its commit
            shard_evidence=ShardEvidenceOptions(cycle=args.save_every) if args.mode != "ddp" else True,
            observer=ObserverOptions(stall_s=args.stall_s, action="abort"),
            invariants=invariants_for(args, model),
        )
    timings["checkpointer"] = time.time()
    start = ckpt.load_latest_clean(state) or 0
    timings["loaded"] = time.time()
    log_path = root / MARKER_DIR / f"log-gen{args.generation}.jsonl"
    log = open(log_path, "a") if rank == 0 else None
    if log:
        born = timings.get("process", _T_START)
        log.write(
            json.dumps(
                {
                    "event": "start",
                    "step": start,
                    "generation": args.generation,
                    "time": time.time(),
                    "run_id": ckpt.run_id,
                    "startup_s": {k: round(v - born, 3) for k, v in timings.items()},
                }
            )
            + "\n"
        )
        log.flush()

    losses: dict[int, float] = {}
    for step in range(start + 1, args.steps + 1):
        injector.before_step(step, model)
        t0 = time.perf_counter()
        with ckpt.phase("data"):
            x, y, dom = data.next_batch()
        with ckpt.phase("forward"):
            logits = model(x)
            per_sample = (
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
                .view(y.shape)
                .mean(1)
            )
            loss = per_sample.mean()
        with ckpt.phase("backward"):
            loss.backward()
        if args.mode == "ddp":
            with ckpt.phase("backward"):  # the gradient all-reduce ends the backward pass
                allreduce_grads(model, world)
        with ckpt.phase("optimizer"):
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if args.constraint == "sphere":
                retract_to_sphere(model)
                ckpt.parameters_written()  # the retraction is a legitimate write after the optimizer step
        injector.after_optimizer_step(step, model)
        injector.slow_down(step, time.perf_counter() - t0)
        with ckpt.phase("step"):
            metrics = torch.cat(
                [
                    loss.detach().double().view(1),
                    (mixer.domain_stats(per_sample, dom) if mixer else torch.zeros(0)).view(-1),
                ]
            )
            dist.all_reduce(metrics)
        global_loss = float(metrics[0]) / world
        if mixer is not None:
            mixer.update(metrics[1:].view(2, -1))
            injector.after_mixing_update(step, mixer)
        app.step = step
        losses[step] = global_loss
        ckpt.step(step)
        if log:
            rec = {"step": step, "loss": global_loss, "time": time.time(), "generation": args.generation}
            if mixer is not None:
                rec["mixing"] = mixer.weights.tolist()
            log.write(json.dumps(rec) + "\n")
            log.flush()
        if step % args.save_every == 0 or step == args.steps:
            try:
                ckpt.save(step, state)
            except LiveStateCorrupt:  # every rank: the generation ends, torchrun restarts from a clean step
                injector.drain()
                raise

    ckpt.close()
    digest = state_digest(model, opt)  # collective
    deviation = sphere_deviation(model) if args.constraint == "sphere" else None  # collective under FSDP
    if rank != 0:
        return None
    result = {
        "final_digest": digest,
        "generation": args.generation,
        "start_step": start,
        "steps": args.steps,
        "mode": args.mode,
        "world": world,
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "time": time.time(),
    }
    if mixer is not None:
        result["mixing"] = mixer.weights.tolist()
    if deviation is not None:
        result["sphere_deviation"] = deviation
    atomic_write_json(root / MARKER_DIR / "result.json", result)
    log.close()
    return result


def torchrun_place() -> dict:
    """This process's place in the job, as torchrun's agent sets it in the environment."""
    env = os.environ
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT") if k not in env
    ]
    if missing:
        raise SystemExit(
            f"scout_ckpt.demo.train: not started by torchrun ({', '.join(missing)} unset); run `scout-ckpt demo`"
        )
    return {
        "rank": int(env["RANK"]),
        "world": int(env["WORLD_SIZE"]),
        "local_rank": int(env.get("LOCAL_RANK", 0)),
        "generation": int(env["TORCHELASTIC_RESTART_COUNT"]),
        "max_restarts": int(env.get("TORCHELASTIC_MAX_RESTARTS", -1)),
        "torchelastic_run_id": env.get("TORCHELASTIC_RUN_ID"),
        "master_port": int(env["MASTER_PORT"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--args-json", required=True, help="WorkerArgs as JSON (written by scout_ckpt.demo.launch)")
    args = WorkerArgs.from_json(parser.parse_args(argv).args_json)
    place = torchrun_place()
    args.rank, args.world, args.generation = place["rank"], place["world"], place["generation"]
    atomic_write_json(
        Path(args.root) / MARKER_DIR / f"gen{args.generation}-rank{args.rank}.json",
        {**place, "pid": os.getpid(), "started": _T_START},
    )
    torch.set_num_threads(1)
    timings = {"process": _T_START, "imported": time.time()}
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    timings["process_group"] = time.time()
    train(args, timings)
    dist.barrier()  # without it destroy_process_group can hang at exit
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
