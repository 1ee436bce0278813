"""Cost of the FSDP2 single-owner-shard evidence: shard update replay per step, at-rest check per save.

A demo TinyTransformer under `fully_shard` (per block and at the root) with AdamW on N gloo ranks. Two identical
models train side by side in each rank, one with the evidence at its defaults (`ShardUpdateReplay`: chunk 4096,
4 units per step, 2 peers; `AtRestGuard`: signs only after the steps saves follow, as ShardEvidence does once it
has seen the save cadence) and one without; windows of `--window` steps
alternate between them, so a burst of load from other processes hits both alike. The figure per window is the
slowest rank's mean step time (a collective step is done when its last rank is); medians over windows.

  ratios.per_step_components_cpu   the headline: CPU seconds per step of the evidence's own code (capture hooks,
                         the background exchange, the post-step signing; measured with thread CPU clocks) over the
                         CPU seconds of a step without the evidence. Robust to a machine with more busy processes
                         than cores, where wall-clock windows swing by +-30%.
  ratios.per_step        (step time with the evidence - without) / without, wall clock, slowest rank
  ratios.per_step_cpu    the same in CPU seconds of the rank's whole process (all threads, gloo's included)
  ratios.per_save        at-rest `check` time / training time between saves (`--save-every` steps)
  ratios.check_vs_dcp    at-rest `check` time / a `dcp.save` of the same FSDP state into a temp dir
  (context) on_step_main_vs_step: on_step's time on the training thread; exchange_vs_step: the background
  exchange (two gathers + recomputation, overlapped with the next step); sign_vs_step: the post-step signing.

    python bench/fsdp_evidence.py [--json] [--ranks 2] [--d-model 256] [--blocks 4] [--seq 128] [--batch 8]
                                  [--windows 6] [--window 5] [--save-every 50] [--per-step 4] [--chunk 4096]
                                  [--at-rest-every K]

At-rest signing, by default, happens only after the steps a save follows (the Checkpointer's default once it has
seen a save: shard_evidence.py, "Save cadence"); its cost is one hash pass per save, charged to the per-step figure
as (signing time / --save-every). `--at-rest-every K` signs after every K-th step instead (K = 1: every step, the
previous default, or `shard_evidence=ShardEvidenceOptions(at_rest_every=1)`).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, load_note, log, parse_args, parser

TARGET = 0.02


def _worker(rank, world, root, cfg):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from scout_ckpt.demo.model import TinyTransformer
    from scout_ckpt.replay.shard_optimizer import ShardUpdateReplay
    from scout_ckpt.save.evidence.at_rest import AtRestGuard

    mesh = init_device_mesh("cpu", (world,))
    pg = dist.new_group(backend="gloo")

    def build():
        torch.manual_seed(0)
        model = TinyTransformer(
            vocab=cfg["vocab"], d_model=cfg["d_model"], n_heads=4, n_blocks=cfg["blocks"], seq_len=cfg["seq"]
        )
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)

    arms = {"off": build(), "on": build()}
    m_on, o_on = arms["on"]
    replay = ShardUpdateReplay(o_on, m_on, per_step=cfg["per_step"], chunk=cfg["chunk"])
    guard = AtRestGuard(o_on, m_on, every=cfg["at_rest_every"] or None)
    gen = torch.Generator().manual_seed(1000 + rank)
    steps = {"off": 0, "on": 0}

    main_thread = []

    def train_step(arm):
        model, opt = arms[arm]
        x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
        logits = model(x)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps[arm] += 1
        if arm == "on":
            t0 = time.perf_counter()
            for row in replay.on_step(steps[arm]):
                assert row["status"] == "pass", row
            main_thread.append(time.perf_counter() - t0)

    def slowest(dt):
        t = torch.tensor([dt], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
        return float(t)

    for arm in ("off", "on", "off", "on"):  # warm-up: optimizer state, allocator, imports
        train_step(arm)
    windows = {"off": [], "on": []}
    cpu = {"off": [], "on": []}  # this process's CPU seconds per step (all threads): robust to a busy machine
    exchange_s, phases = [], []
    main_thread.clear()
    replay.flush()
    replay.cpu_s.update(hooks=0.0, exchange=0.0)
    guard.cpu_s = 0.0
    on_steps0 = steps["on"]
    for i in range(cfg["windows"]):
        for arm in ("off", "on") if i % 2 == 0 else ("on", "off"):
            dist.barrier(group=pg)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(cfg["window"]):
                train_step(arm)
                if arm == "on" and replay.timings:
                    exchange_s.append(sum(replay.timings.values()))
                    phases.append(dict(replay.timings))
            if arm == "on":  # the last exchange of the window is charged to it
                for row in replay.flush():
                    assert row["status"] == "pass", row
            cpu[arm].append(slowest((time.process_time() - c0) / cfg["window"]))
            windows[arm].append(slowest((time.perf_counter() - t0) / cfg["window"]))
    n_on = steps["on"] - on_steps0
    component_cpu = {
        "hooks": replay.cpu_s["hooks"] / n_on,
        "exchange": replay.cpu_s["exchange"] / n_on,
        "at_rest_sign": guard.cpu_s / n_on,
    }
    checks, saves, signs, sign_cpu = [], [], [], []
    model, opt = m_on, o_on
    for i in range(cfg["saves"]):
        guard.arm_next()  # a save follows this step (what a checkpointer knowing its save steps would do)
        train_step("on")
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        ev = guard.check(steps["on"])
        checks.append(slowest(time.perf_counter() - t0))
        assert ev["status"] == "pass", ev
        t0, c0 = time.perf_counter(), time.thread_time()
        guard.resign()  # the post-step signing the guard does inside every optimizer.step
        sign_cpu.append(slowest(time.thread_time() - c0))
        signs.append(slowest(time.perf_counter() - t0))
        msd, osd = get_state_dict(model, opt)
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/save-{i}", process_group=pg)
        saves.append(slowest(time.perf_counter() - t0))
    if not cfg["at_rest_every"]:  # save-cadence signing: one pass per save, spread over the save interval
        component_cpu["at_rest_sign"] = statistics.median(sign_cpu) / cfg["save_every"]
    shard = sum(p.to_local().numel() for p in model.parameters())
    return {
        "windows": windows,
        "cpu": cpu,
        "component_cpu": component_cpu,
        "exchange_s": exchange_s,
        "on_step_main_s": main_thread,
        "phases": phases,
        "check_s": checks,
        "dcp_save_s": saves,
        "sign_s": signs,
        "cycle": replay.cycle,
        "units": replay.unit_counts,
        "per_step_units": replay.per_step,
        "shard_elems": shard,
        "params_total": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--per-step", type=int, default=4, help="ShardUpdateReplay units per step (default 4)")
    p.add_argument("--chunk", type=int, default=4096, help="ShardUpdateReplay elements per unit (default 4096)")
    p.add_argument(
        "--at-rest-every",
        type=int,
        default=0,
        help="AtRestGuard signs after every k-th step (0, the default: only after the steps saves follow)",
    )
    args = parse_args(
        p,
        {
            "d_model": 32,
            "blocks": 1,
            "vocab": 64,
            "seq": 16,
            "batch": 2,
            "windows": 2,
            "window": 2,
            "saves": 1,
            "save_every": 4,
        },
    )
    from scout_ckpt.testing.launch import run_ranks

    cfg = {
        "d_model": args.d_model,
        "blocks": args.blocks,
        "vocab": args.vocab,
        "seq": args.seq,
        "batch": args.batch,
        "windows": args.windows,
        "window": args.window,
        "saves": args.saves,
        "per_step": args.per_step,
        "chunk": args.chunk,
        "at_rest_every": args.at_rest_every,
        "save_every": args.save_every,
    }
    log(f"fsdp_evidence: {args.ranks} ranks, {cfg}")
    with tempfile.TemporaryDirectory() as root:
        out = run_ranks(_worker, args.ranks, root, cfg, timeout=1800, pg_timeout_s=600)
    r = out[0].result
    off, on = statistics.median(r["windows"]["off"]), statistics.median(r["windows"]["on"])
    check, dcp_s = statistics.median(r["check_s"]), statistics.median(r["dcp_save_s"])
    sign = statistics.median(r["sign_s"])
    exchange = statistics.median(r["exchange_s"])
    on_step = statistics.median(r["on_step_main_s"])
    cpu_off, cpu_on = statistics.median(r["cpu"]["off"]), statistics.median(r["cpu"]["on"])
    comp = r["component_cpu"]
    ratios = {
        "per_step_components_cpu": sum(comp.values()) / cpu_off,
        **{f"per_step_cpu.{k}": v / cpu_off for k, v in comp.items()},
        "per_step": (on - off) / off,
        "per_step_cpu": (cpu_on - cpu_off) / cpu_off,
        "per_save": check / (args.save_every * off),
        "check_vs_dcp": check / dcp_s,
        "on_step_main_vs_step": on_step / off,
        "exchange_vs_step": exchange / off,
        "sign_vs_step": sign / off,
    }
    phases = {k: statistics.median(ph[k] for ph in r["phases"]) for k in r["phases"][0]}
    result = {
        "ratios": ratios,
        "target": TARGET,
        "target_met": ratios["per_step_components_cpu"] < TARGET and ratios["per_save"] < TARGET,
        "cpu_s_per_step_components": comp,
        "cpu_s_per_step_off": cpu_off,
        "median_s": {
            "step_off": off,
            "step_on": on,
            "on_step_main_thread": on_step,
            "exchange_background": exchange,
            "at_rest_check": check,
            "at_rest_sign": sign,
            "dcp_save": dcp_s,
            **{f"exchange.{k}": v for k, v in phases.items()},
        },
        "windows_s": r["windows"],
        "cpu_s_per_step": r["cpu"],
        "cycle_steps": r["cycle"],
        "units_per_rank": r["units"],
        "units_per_step": r["per_step_units"],
        "shard_elems_rank0": r["shard_elems"],
        "params_total": r["params_total"],
        "ranks": args.ranks,
        "config": cfg,
        "save_every": args.save_every,
        "load": load_note(),
    }
    rows = [[k, v] for k, v in result["median_s"].items()]
    emit(
        result,
        args,
        rows,
        ["what", "median s"],
        title=f"FSDP2 evidence cost, {args.ranks} ranks, {r['params_total']} params, cycle {r['cycle']} steps",
    )


if __name__ == "__main__":
    main()
