"""Cost of the at-rest interval check (between one optimizer step and the next) against the step time, FSDP2 on CPU.

Why: a change to a single-owner FSDP2 shard between two optimizer steps is folded into the next update, so the
at-rest check at save time cannot see it; `AtRestGuard` re-signs before each step what the previous step's
post-hook signed (save/evidence/at_rest.py, "Between saves"). Full coverage is two hash passes per step over
every local parameter shard and optimizer state tensor, the default (INTERVAL_PARTS = 1; the former default
checked one of 4 runs per step, still measured for comparison). This bench measures them against the step time of
the same run; the target is <= 1% of a step at both shapes.

User-shaped: PyTorch's FSDP2 example (pytorch/examples distributed/FSDP2: a Transformer, `fully_shard` per block
and at the root, AdamW, 2 ranks under gloo on CPU), at two widths: `example` (the example's own sizes: 3 blocks,
vocab 1024, sequence 64; width 64) and `wide` (width 256, 4 blocks, sequence 128, batch 8, the size
bench/fsdp_evidence.py uses). Per shape and per setting (interval parts = off, the default, 1), windows of `--window`
steps alternate between the settings (a burst of load hits all alike); the guard's own hook time is timed inside
the hooks (`AtRestGuard.interval_s`: the pre-hook's comparison and the post-hook's signing of the run), so the
ratio below is measured in the same steps it is charged to. The guard runs as the Checkpointer runs it between
saves (`every=None`: no save-cadence signing in these steps).

    ratios.interval_<shape>_parts<K>    hook seconds per step / the step time without the guard (slowest rank)
    ratios.interval_default             the default (INTERVAL_PARTS) at the `wide` shape: the headline, target <= 1%
    ratios.interval_default_example     the default at the `example` shape (target <= 1% too)

On an accelerator the signature is computed on the device (consensus/signatures.py: torch integer ops, no host
copy), so the cost scales with the shard's bytes over the device's memory bandwidth, while the step's compute
scales with tokens per rank times the full model: the ratio falls as the world size grows (each rank hashes
1/world of the model) and rises with a small batch per rank.

    python bench/at_rest_interval.py [--json] [--ranks 2] [--windows 4] [--window 5] [--shapes example,wide]
    [--smoke]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, load_note, log, parse_args, parser

TARGET = 0.01
SHAPES = {
    "example": {"d_model": 64, "blocks": 3, "vocab": 1024, "seq": 64, "batch": 8},
    "wide": {"d_model": 256, "blocks": 4, "vocab": 1024, "seq": 128, "batch": 8},
}


def _worker(rank, world, cfg):
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from scout_ckpt.demo.model import TinyTransformer
    from scout_ckpt.save.evidence.at_rest import AtRestGuard

    mesh = init_device_mesh("cpu", (world,))
    pg = dist.new_group(backend="gloo")
    out = {}
    for shape in cfg["shapes"]:
        sc = SHAPES[shape]
        torch.manual_seed(0)
        model = TinyTransformer(
            vocab=sc["vocab"], d_model=sc["d_model"], n_heads=4, n_blocks=sc["blocks"], seq_len=sc["seq"]
        )
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
        gen = torch.Generator().manual_seed(1000 + rank)

        def step(sc=sc, gen=gen, model=model, opt=opt):  # bound: called within this iteration only
            x = torch.randint(0, sc["vocab"], (sc["batch"], sc["seq"]), generator=gen)
            logits = model(x)
            F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def slowest(v):
            t = torch.tensor([v], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
            return float(t)

        for _ in range(3):  # warm-up: optimizer state, allocator
            step()
        settings = ["off", *dict.fromkeys([cfg["parts"], 1, 4])]
        step_s = {k: [] for k in settings}
        hook_s = {k: [] for k in settings}
        for i in range(cfg["windows"]):
            order = settings if i % 2 == 0 else settings[::-1]
            for k in order:
                guard = None if k == "off" else AtRestGuard(opt, model, group=pg, every=None, interval_parts=k)
                if guard is not None:
                    step()  # its first post-hook signs (frozen: none; the run of this step)
                dist.barrier(group=pg)
                h0 = 0.0 if guard is None else guard.interval_s
                t0 = time.perf_counter()
                for _ in range(cfg["window"]):
                    step()
                wall = (time.perf_counter() - t0) / cfg["window"]
                hook = 0.0 if guard is None else (guard.interval_s - h0) / cfg["window"]
                assert guard is None or not guard.findings, guard.findings  # a healthy run finds nothing
                step_s[k].append(slowest(wall - hook))
                hook_s[k].append(slowest(hook))
                if guard is not None:
                    guard.close()
        local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        local += sum(
            v.to_local().numel() * v.element_size()
            for st in opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        out[shape] = {
            "step_s": {str(k): v for k, v in step_s.items()},
            "hook_s": {str(k): v for k, v in hook_s.items()},
            "local_bytes": local,
            "params": sum(p.numel() for p in model.parameters()),
        }
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--shapes", default="example,wide")
    args = parse_args(p, {"windows": 1, "window": 2, "shapes": "example"})
    from scout_ckpt.save.evidence.at_rest import INTERVAL_PARTS
    from scout_ckpt.testing.launch import run_ranks

    shapes = [s for s in args.shapes.split(",") if s]
    cfg = {"shapes": shapes, "windows": args.windows, "window": args.window, "parts": INTERVAL_PARTS}
    log(f"at_rest_interval: {args.ranks} ranks, {cfg}")
    r = run_ranks(_worker, args.ranks, cfg, timeout=1800, pg_timeout_s=600)[0].result
    ratios, medians, rows = {}, {}, []
    for shape in shapes:
        st = statistics.median(r[shape]["step_s"]["off"])
        medians[f"{shape}.step_off"] = st
        for k in dict.fromkeys([str(INTERVAL_PARTS), "1", "4"]):
            hook = statistics.median(r[shape]["hook_s"][k])
            ratios[f"interval_{shape}_parts{k}"] = hook / st
            medians[f"{shape}.hooks_parts{k}"] = hook
            rows.append([shape, r[shape]["params"], r[shape]["local_bytes"], k, st, hook, hook / st])
    headline = ratios.get(f"interval_wide_parts{INTERVAL_PARTS}")
    if headline is not None:
        ratios["interval_default"] = headline
    example = ratios.get(f"interval_example_parts{INTERVAL_PARTS}")
    if example is not None:
        ratios["interval_default_example"] = example
    defaults = [v for v in (headline, example) if v is not None]
    result = {
        "ratios": ratios,
        "target_fraction": TARGET,
        "target": f"<= {TARGET} of a step at every shape run (default parts {INTERVAL_PARTS})",
        "target_met": bool(defaults) and all(v <= TARGET for v in defaults),
        "default_parts": INTERVAL_PARTS,
        "median_s": medians,
        "raw": r,
        "ranks": args.ranks,
        "config": cfg,
        "shapes": {s: SHAPES[s] for s in shapes},
        "load": load_note(),
    }
    emit(
        result,
        args,
        rows,
        ["shape", "params", "local bytes (rank 0)", "parts", "step s (no guard)", "hooks s/step", "ratio"],
        title=f"at-rest interval check, {args.ranks} ranks, FSDP2 on CPU (default parts {INTERVAL_PARTS})",
    )


if __name__ == "__main__":
    main()
