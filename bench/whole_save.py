"""A whole scout-ckpt save in a user-shaped training script, over plain `dcp.save` of the same state, same run.

Users feel a save as the training time it costs: the Checkpointer with its defaults (the replay sweep, shard
evidence, consensus, the writers' digests and finite checks, load-verification signatures, the manifest and the
ledger commit) against what they would otherwise write, `dcp.save(get_state_dict(model, optimizer))`. Two
scripts, 2 ranks each, shaped as PyTorch's own examples are:

  fsdp  the FSDP2 example's shape: a small transformer (embedding, blocks of attention + MLP, head), `fully_shard`
        per block and at the root, AdamW; a save every 5 steps
  ddp   the same model under DistributedDataParallel, as users wrap it; a save every 5 steps

Each round trains 5 steps and then both contenders save that state, the order alternating round by round, so load
from other processes hits both alike and the scout saves fall on the regular cadence a user's do. Reported per script: the median seconds of a save (the slowest rank), the ratio
(`whole_save_vs_dcp_fsdp`, `whole_save_vs_dcp_ddp`; goal <= 1.3), the median training step and the save in steps,
and where a scout-ckpt save spends its time (the medians of its phases: sweep_thread = the replay sweep, in a thread
beside the write, sweep_wait = what the save waits for it after the write, shard_flush =
the shard evidence's exchange, begin = the `writing` row and temp dir, write = DCP's write with the writers'
digests, evidence = consensus, invariants, at-rest and signatures, commit = gather, manifest, ledger verdict; the
consensus thread's work during the write, DTensor shards' load signatures included, counts in `write`, and in
`evidence` only as far as the evidence waits for it; within evidence, ev_consensus = consensus's exchange and the
hashing it still waits for, ev_shard = the at-rest check and the shard replay's evidence, ev_signatures = the
load-verification signatures, ev_replay = replay's coverage from the ledger). Each phase timed on the saving thread
also has a `<phase>_cpu` (that thread's CPU in it), `main_cpu` is the saving thread's CPU for the whole save and
`sweep_cpu` the sweep thread's. Beside the wall times, `cpu_s`: the CPU seconds a save takes on the busier rank (the
process's, every thread), per contender, and their ratio `cpu_vs_dcp`: on a shared host the CPU a save costs moves
less than its wall time. `gc`: Python's garbage collections during the measured rounds, both ranks summed, by
what was running (`train`, `scout`, `dcp`): count, seconds and objects freed per generation (`gen2` walks every
tracked object of the process).

Two sizes: `small` (`--width`, `--layers`: the FSDP2 example's shape) and `large` (`--large-width`,
`--large-layers`: at least 100 MB of state per rank in the FSDP script, parameters and AdamW's two moments; the
DDP script holds twice that per rank). Keys: `whole_save_vs_dcp_<script>` (small) and
`whole_save_vs_dcp_<script>_large`, and `fixed_overhead_s`: what a save costs beyond the write at the small size,
the median over rounds of (scout save - plain dcp.save of the same state), the larger of the two scripts (a plain
save's own planning and state-dict gathering count on both sides, so this is what scout-ckpt adds).

    python bench/whole_save.py [--json] [--rounds 6] [--width 256] [--layers 4] [--scripts fsdp,ddp]
                               [--sizes small,large] [--large-width 768] [--large-layers 3] [--profile DIR]
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, load_note, log, parse_args, parser  # noqa: E402

STEPS_PER_SAVE = 5
GOAL = 1.3
FIXED_GOAL_S = 0.05
LARGE_MIN_BYTES = 100 * 10**6  # state per rank at the large size


def _model(width: int, layers: int, vocab: int = 512):
    """The FSDP2 example's shape (bench/_framework_common.transformer, shared with the framework bench), seeded."""
    import _framework_common as fc

    return fc.transformer(width, layers, vocab), vocab


def _cpu_s() -> float:
    """CPU seconds of this rank's process so far, every thread (the consensus thread, gloo's) included."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(owner, name: str, label: str, into: dict) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            into[label] = into.get(label, 0.0) + time.perf_counter() - t0
            # the calling thread's CPU in it: on a shared host it moves less than the wall time
            into[f"{label}_cpu"] = into.get(f"{label}_cpu", 0.0) + time.thread_time() - c0

    setattr(owner, name, wrapper)


def sweep_thread_cpu(pending_cls, into: dict, profile_path: str | None) -> None:
    """The sweep thread's own CPU seconds (`sweep_cpu`), and with `profile_path` its cProfile (every round)."""
    import cProfile

    run = pending_cls._run
    prof = cProfile.Profile() if profile_path else None

    @functools.wraps(run)
    def wrapper(self, *a, **k):
        c0 = time.thread_time()
        if prof is not None:
            prof.enable()
        try:
            return run(self, *a, **k)
        finally:
            if prof is not None:
                prof.disable()
                prof.dump_stats(profile_path)
            into["sweep_cpu"] = into.get("sweep_cpu", 0.0) + time.thread_time() - c0

    pending_cls._run = wrapper


def _evidence_parts(into: dict) -> None:
    """Time the parts of the live evidence: consensus's finish (its exchange, and the hashing it waits for), the
    shard evidence (at-rest check, shard replay log), the load-verification signatures, replay's coverage."""
    from scout_ckpt.consensus import save_time
    from scout_ckpt.save.evidence import boundary, replay, shard

    _timed(save_time.PendingConsensus, "finish", "ev_consensus", into)
    _timed(shard.ShardEvidence, "live", "ev_shard", into)
    _timed(boundary, "full_signatures", "ev_signatures", into)
    _timed(replay.ReplayEvidence, "evidence", "ev_replay", into)


class _GcLog:
    """Python's garbage collections on this rank, by what was running (`where`: train, scout, dcp), rounds after
    the first: how many of each generation and their wall seconds. A full (generation 2) collection walks every
    tracked object of the process, so one inside a save moves that save's time by more than the rest of it."""

    def __init__(self) -> None:
        import gc

        self.where = "warmup"
        self.log: dict[str, dict[str, float]] = {}
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        if self.where == "warmup":
            return
        row = self.log.setdefault(self.where, {})
        gen = f"gen{info['generation']}"
        row[gen] = row.get(gen, 0) + 1
        row[f"{gen}_s"] = row.get(f"{gen}_s", 0.0) + time.perf_counter() - self._t0
        row[f"{gen}_collected"] = row.get(f"{gen}_collected", 0) + info["collected"]  # unreachable objects freed


def _worker(rank, world, root, kind, rounds, width, layers, profile=None):
    import cProfile

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from scout_ckpt import Checkpointer, ModelOptimizerState
    from scout_ckpt import checkpointer as ck_mod
    from scout_ckpt.save import commit as commit_mod

    torch.set_num_threads(1)
    model, vocab = _model(width, layers)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    phases: dict[str, float] = {}
    real_dcp_save = dcp.save
    for owner, name, label in (
        (ck_mod.Checkpointer, "_live_evidence", "evidence"),
        (ck_mod.Checkpointer, "_commit", "commit"),
        (commit_mod.Committer, "begin", "begin"),
    ):
        _timed(owner, name, label, phases)
    _evidence_parts(phases)

    def write_timed(*a, **k):  # DCP's write as the Checkpointer calls it (the plain contender calls the original)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return real_dcp_save(*a, **k)
        finally:
            phases["write"] = phases.get("write", 0.0) + time.perf_counter() - t0
            phases["write_cpu"] = phases.get("write_cpu", 0.0) + time.thread_time() - c0

    ck_mod.dcp = type(sys)("dcp_timed")
    ck_mod.dcp.__dict__.update({k: getattr(dcp, k) for k in dir(dcp) if not k.startswith("__")})
    ck_mod.dcp.save = write_timed

    ckpt = Checkpointer(os.path.join(root, "scout"), model=net, optimizer=opt, timeout_s=600)
    if ckpt.replay is not None:
        from scout_ckpt.save.evidence import replay as replay_ev

        _timed(ckpt.replay, "sweep", "sweep", phases)  # a sweep on the saving thread (async saves)
        # a sync save's sweep runs beside the write: its own time, and what the save still waits for after the write
        pending = getattr(replay_ev, "PendingSweep", None)  # absent in code that sweeps on the saving thread
        if pending is not None and not hasattr(pending, "_bench_timed"):
            _timed(pending, "_run", "sweep_thread", phases)
            _timed(pending, "finish", "sweep_wait", phases)
            pending._bench_timed = True
            sweep_thread_cpu(pending, phases, profile and os.path.join(profile, f"{kind}-sweep-rank{rank}.prof"))
    if ckpt.shard is not None:
        _timed(ckpt.shard, "flush", "shard_flush", phases)
    state = {"app": ModelOptimizerState(net, opt)}
    pg = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(rank)
    step, step_times = 0, []

    def train():
        nonlocal step
        for _ in range(STEPS_PER_SAVE):
            step += 1
            t0 = time.perf_counter()
            tokens = torch.randint(0, vocab, (4, 33), generator=g)
            loss = F.cross_entropy(net(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            ckpt.step(step)
            step_times.append(time.perf_counter() - t0)

    profiles = {"scout": cProfile.Profile(), "dcp": cProfile.Profile()} if profile else None
    gcs = _GcLog()

    def scout_save():
        phases.clear()
        dist.barrier(group=pg)
        c0, t0, m0 = _cpu_s(), time.perf_counter(), time.thread_time()
        if profiles:
            profiles["scout"].enable()
        verdict = ckpt.save(step, state)
        if profiles:
            profiles["scout"].disable()
        dt = time.perf_counter() - t0
        phases["main_cpu"] = time.thread_time() - m0
        cpu["scout"].append(_cpu_s() - c0)
        states.append((verdict or {}).get("state"))
        return dt, dict(phases)

    def plain_save():
        d = os.path.join(root, f"plain-{step}")
        dist.barrier(group=pg)
        c0, t0 = _cpu_s(), time.perf_counter()
        if profiles:
            profiles["dcp"].enable()
        msd, osd = get_state_dict(net, opt)
        real_dcp_save({"model": msd, "optim": osd}, checkpoint_id=d, process_group=pg)
        if profiles:
            profiles["dcp"].disable()
        dt = time.perf_counter() - t0
        cpu["dcp"].append(_cpu_s() - c0)
        dist.barrier(group=pg)
        if rank == 0:
            shutil.rmtree(d)
        return dt

    times = {"scout": [], "dcp": []}
    cpu = {"scout": [], "dcp": []}  # every round's, round 0 included (dropped below)
    breakdown: list[dict] = []
    states: list[str | None] = []
    for i in range(rounds + 1):  # round 0 warms up (imports, the first replay capture, page cache)
        # both contenders save the same state at the same step, first one then the other (the order alternates):
        # the scout saves fall on a regular cadence, as a user's do (shard evidence learns it)
        gcs.where = "train" if i else "warmup"
        train()
        order = ("scout", "dcp") if i % 2 == 0 else ("dcp", "scout")
        for who in order:
            if i:
                gcs.where = who
            if who == "scout":
                dt, ph = scout_save()
                if i:
                    times["scout"].append(dt)
                    breakdown.append(ph)
            else:
                dt = plain_save()
                if i:
                    times["dcp"].append(dt)
    gcs.where = "warmup"  # the close and what follows are not measured
    ckpt.close()
    for who, prof in (profiles or {}).items():  # the calling thread's profile of every round (round 0 included)
        prof.dump_stats(os.path.join(profile, f"{kind}-{who}-rank{rank}.prof"))
    local_bytes = sum(
        (t._local_tensor if hasattr(t, "_local_tensor") else t).numel() * t.element_size()
        for t in [*model.parameters(), *(v for st in opt.state.values() for v in st.values())]
        if isinstance(t, torch.Tensor)
    )
    out = {
        "state_bytes": local_bytes,
        "times": times,
        "phases": breakdown,
        "step_s": statistics.median(step_times[STEPS_PER_SAVE:]),
        "states": states,
        "cpu": {k: v[1:] for k, v in cpu.items()},
        "gc": gcs.log,
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, out, group=pg)
    if rank != 0:
        return None
    # the slowest rank decides when a collective save is done
    merged = {k: [max(g["times"][k][j] for g in gathered) for j in range(rounds)] for k in times}
    # CPU: the busier rank's, per round (on a shared host the CPU a save takes moves less than its wall time)
    cpu_med = {k: statistics.median(max(g["cpu"][k][j] for g in gathered) for j in range(rounds)) for k in cpu}
    phase_names = sorted({p for g in gathered for ph in g["phases"] for p in ph})
    phase_med = {
        p: statistics.median(max(g["phases"][j].get(p, 0.0) for g in gathered) for j in range(rounds))
        for p in phase_names
    }
    return {
        "state_bytes_per_rank": min(g["state_bytes"] for g in gathered),
        "times": merged,
        "phases": phase_med,
        "step_s": max(g["step_s"] for g in gathered),
        "cpu_s": cpu_med,
        "verdicts": out["states"],
        # collections over every measured round, both ranks summed
        "gc": {
            where: {k: sum(g["gc"].get(where, {}).get(k, 0) for g in gathered) for k in sorted(keys)}
            for where in ("train", "scout", "dcp")
            for keys in [{k for g in gathered for k in g["gc"].get(where, {})}]
        },
        "nbytes": sum(
            os.path.getsize(os.path.join(dp, f))
            for dp, _, fs in os.walk(os.path.join(root, "scout"))
            for f in fs
            if f.endswith(".distcp")
        ),
    }


def _run(kind: str, size: str, width: int, layers: int, args) -> dict:
    from scout_ckpt.testing.launch import run_ranks

    root = tempfile.mkdtemp(prefix=f"scout-bench-whole-{kind}-")
    profile = None
    if args.profile:
        profile = os.path.join(os.path.abspath(args.profile), size)
        os.makedirs(profile, exist_ok=True)
    try:
        log(
            f"{kind} ({size}, width {width}, {layers} layers): {args.rounds} rounds of {STEPS_PER_SAVE} steps + a save, 2 ranks ..."
        )
        return run_ranks(
            _worker,
            2,
            root,
            kind,
            args.rounds,
            width,
            layers,
            profile,
            timeout=1800,
            pg_timeout_s=600,
        )[0].result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--large-width", type=int, default=768)
    ap.add_argument("--large-layers", type=int, default=3)
    ap.add_argument("--sizes", default="small,large", help="the sizes to run, comma-separated (small, large)")
    ap.add_argument("--kinds", default="fsdp,ddp", help="the scripts to run, comma-separated (fsdp, ddp)")
    ap.add_argument("--scripts", dest="kinds", help="the same as --kinds")
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="write cProfile stats of each contender's saves (the calling "
        "thread, every round) per rank to DIR/SIZE/KIND-CONTENDER-rankR.prof",
    )
    args = parse_args(ap, {"rounds": 1, "width": 32, "layers": 1, "large_width": 64, "large_layers": 1})

    results, ratios, rows, fixed = {}, {}, [], {}
    sizes = {"small": (args.width, args.layers), "large": (args.large_width, args.large_layers)}
    for size in args.sizes.split(","):
        width, layers = sizes[size]
        for kind in args.kinds.split(","):
            out = _run(kind, size, width, layers, args)
            name = kind if size == "small" else f"{kind}_large"
            scout, plain = statistics.median(out["times"]["scout"]), statistics.median(out["times"]["dcp"])
            beyond = statistics.median(a - b for a, b in zip(out["times"]["scout"], out["times"]["dcp"]))
            if size == "small":
                fixed[kind] = beyond
            ratios[f"whole_save_vs_dcp_{name}"] = scout / plain
            results[name] = {
                "width": width,
                "layers": layers,
                "state_bytes_per_rank": out["state_bytes_per_rank"],
                "scout_s": scout,
                "dcp_s": plain,
                "beyond_dcp_s": beyond,
                "step_s": out["step_s"],
                "save_in_steps": scout / out["step_s"],
                "phases_s": out["phases"],
                "samples_s": out["times"],
                "distcp_bytes": out["nbytes"],
                "verdicts": out["verdicts"],
                "cpu_s": out["cpu_s"],
                "cpu_vs_dcp": out["cpu_s"]["scout"] / out["cpu_s"]["dcp"],
                "gc": out["gc"],
            }
            rows.append(
                (
                    name,
                    f"{out['state_bytes_per_rank'] / 1e6:.0f}",
                    f"{plain:.3f}",
                    f"{scout:.3f}",
                    f"{scout / plain:.2f}",
                    f"{beyond:.3f}",
                    f"{out['cpu_s']['dcp']:.3f} / {out['cpu_s']['scout']:.3f}",
                    f"{out['step_s']:.3f}",
                    f"{scout / out['step_s']:.1f}",
                    " ".join(f"{p} {v:.3f}" for p, v in sorted(out["phases"].items(), key=lambda x: -x[1])),
                )
            )
    large_ok = all(r["state_bytes_per_rank"] >= LARGE_MIN_BYTES for k, r in results.items() if k.endswith("_large"))
    fixed_s = max(fixed.values()) if fixed else None
    result = {
        "ratio": max(ratios.values()),
        "ratios": ratios,
        "fixed_overhead_s": fixed_s,
        "fixed_overhead_s_by_script": fixed,
        "results": results,
        "rounds": args.rounds,
        "width": args.width,
        "layers": args.layers,
        "large_width": args.large_width,
        "large_layers": args.large_layers,
        "large_state_at_least_100mb": large_ok,
        "steps_per_save": STEPS_PER_SAVE,
        "ranks": 2,
        "target": f"ratios <= {GOAL}, fixed_overhead_s <= {FIXED_GOAL_S}",
        "target_met": all(v <= GOAL for v in ratios.values()) and fixed_s is not None and fixed_s <= FIXED_GOAL_S,
        **load_note(),
    }
    emit(
        result,
        args,
        rows,
        [
            "script",
            "state MB/rank",
            "dcp.save s",
            "scout save s",
            "ratio",
            "beyond s",
            "CPU s dcp / scout",
            "step s",
            "save in steps",
            "scout phases (median s)",
        ],
        title="a whole save in user-shaped scripts (2 ranks), scout-ckpt's defaults over plain dcp.save",
    )
    if not args.json and fixed_s is not None:
        print(f"fixed_overhead_s: {fixed_s:.3f} (goal <= {FIXED_GOAL_S})")


if __name__ == "__main__":
    main()
