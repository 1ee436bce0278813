"""Rank functions for the observer tests and bench (run by scout_ckpt.testing.launch.run_ranks on real gloo ranks).

Every scenario trains a toy loop (sleep as compute, one all_reduce per step) with the observer running, then
injects one fault on one rank. Blocking functions have telling names, so the tests can find them in the stacks.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from scout_ckpt.observer import Observer
from scout_ckpt.observer.heartbeat import HeartbeatReader
from scout_ckpt.observer.stacks import cpu_seconds


def injected_hang_before_all_reduce(root: str, rank: int) -> None:
    Path(root, f"hang-start-{rank}").write_text(repr(time.time()))
    threading.Event().wait()


def train(rank: int, world_size: int, root: str, run_id: str, scenario: str, opts: dict):
    """scenario: healthy | hang | desync | crash | sigstop | slow. opts: steps, fault_rank, fault_step (the tests
    draw them from their seed, tests/placement.py; rank 2, step 4 for the bench), compute_s, slow_factor, stall_s,
    action, poll_s, straggler, cpu_window (measure the observer's CPU while healthy)."""
    steps, fault_rank, fault_step = opts.get("steps", 10), opts.get("fault_rank", 2), opts.get("fault_step", 4)
    compute_s = opts.get("compute_s", 0.02)
    side = dist.new_group(backend="gloo")  # a checkpointer-like side group: its collectives must not count
    obs = Observer.start(
        root,
        rank=rank,
        world_size=world_size,
        run_id=run_id,
        stall_s=opts.get("stall_s", 1.5),
        action=opts.get("action", "report"),
        poll_s=opts.get("poll_s", 0.1),
        ignore_groups=(side,),
        linger_s=2.5,
        straggler=opts.get("straggler"),
    )
    t = torch.ones(4)
    cpu0 = wall0 = None
    for step in range(1, steps + 1):
        slow = scenario == "slow" and rank == fault_rank
        with obs.phase("forward"):
            time.sleep(compute_s * (opts.get("slow_factor", 3.0) if slow else 1.0))
        dist.barrier(group=side)
        if step == fault_step and rank == fault_rank:
            if scenario == "hang":
                injected_hang_before_all_reduce(root, rank)
            elif scenario == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            elif scenario == "sigstop":
                Path(root, f"hang-start-{rank}").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
        if scenario == "desync" and step == fault_step and rank == fault_rank:
            dist.all_reduce(torch.ones(8))  # a different shape than every other rank's
        else:
            dist.all_reduce(t)
        obs.step(step)
        if step == opts.get("cpu_from_step", 2) and opts.get("cpu_window"):
            cpu0, wall0 = cpu_seconds(obs.pid), time.monotonic()
    result = {"rank": rank, "observer_pid": obs.pid, "seq": obs.tracer.seq}
    if cpu0 is not None:
        result["observer_cpu_s"] = cpu_seconds(obs.pid) - cpu0
        result["wall_s"] = time.monotonic() - wall0
    obs.stop()
    return result


def tracer_roundtrip(rank: int, world_size: int):
    """Installs the tracer, issues collectives, uninstalls; returns what the test checks."""
    from scout_ckpt.observer.fingerprints import SPECS, CollectiveTracer
    from scout_ckpt.observer.heartbeat import Heartbeat, HeartbeatReader

    side = dist.new_group(backend="gloo")
    before = {name: getattr(dist, name) for name in SPECS if hasattr(dist, name)}
    hb_path = f"/dev/shm/scout-test-tracer-{os.getpid()}"
    hb = Heartbeat.create(hb_path)
    tracer = CollectiveTracer.install(hb, ignore=(side,))
    replaced = sorted(n for n, f in before.items() if getattr(dist, n) is not f)
    dist.all_reduce(torch.ones(3))
    dist.all_gather([torch.zeros(2) for _ in range(world_size)], torch.ones(2))
    dist.broadcast(torch.ones(5), src=0)
    dist.barrier()
    out = [None] * world_size
    dist.all_gather_object(out, {"rank": rank})
    dist.barrier(group=side)  # ignored: not counted
    dist.all_reduce(torch.ones(2), group=side)  # ignored
    snap = HeartbeatReader(hb_path).snapshot()
    fps = {
        "ar3": tracer.fingerprint("all_reduce", (torch.ones(3),), {}),
        "ar3_sum": tracer.fingerprint("all_reduce", (torch.ones(3), dist.ReduceOp.SUM), {}),  # the default, spelled
        "ar3_max": tracer.fingerprint("all_reduce", (torch.ones(3),), {"op": dist.ReduceOp.MAX}),
        "ar4": tracer.fingerprint("all_reduce", (torch.ones(4),), {}),
        "ar3_f64": tracer.fingerprint("all_reduce", (torch.ones(3, dtype=torch.float64),), {}),
        "bcast0": tracer.fingerprint("broadcast", (torch.ones(5),), {"src": 0}),
        "bcast1": tracer.fingerprint("broadcast", (torch.ones(5),), {"src": 1}),
        # the src-only scatter list is rank-dependent and must not count
        "scatter": tracer.fingerprint(
            "scatter", (torch.ones(2), [torch.ones(2)] * world_size if rank == 0 else None), {"src": 0}
        ),
    }
    seq = tracer.seq
    tracer.uninstall()
    restored = all(getattr(dist, n) is f for n, f in before.items())
    hb.close()
    return {
        "replaced": replaced,
        "seq": seq,
        "hb_seq": snap.seq_enter,
        "hb_left": snap.seq_leave,
        "hb_fp": snap.fp_enter,
        "fps": fps,
        "restored": restored,
        "in_coll": snap.in_coll,
    }


def ddp_attach_rules(rank: int, world_size: int, root: str):
    """The comm-hook rules on real DDP modules: by default no hook, the reducer's all-reduces counted natively
    (and published by the sampler); the opt-in traced hook registered and its all-reduces traced, a user's
    Python hook kept (and seen), a hook given to the observer registered, a built-in hook reported."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    obs_hook_calls = []

    def users_hook(state, bucket):
        obs_hook_calls.append(bucket.index())
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(state, bucket)

    def step(model):
        model(torch.ones(2, 4)).sum().backward()

    out = {"rank": rank}
    obs = Observer.start(
        root, rank=rank, world_size=world_size, run_id="attach", stall_s=600.0, poll_s=0.1, ddp_comm_hook=users_hook
    )
    try:
        plain = DDP(nn.Linear(4, 4))
        seq0 = obs.tracer.seq
        step(plain)
        out["before_attach"] = obs.tracer.seq - seq0  # C++ reducer: unseen
        given = DDP(nn.Linear(4, 4))
        out["given"] = obs.attach(given)
        seq0 = obs.tracer.seq
        step(given)
        out["given_seen"] = obs.tracer.seq - seq0
        out["given_called"] = len(obs_hook_calls)
        obs._ddp_hook = (None, None)  # the default: no hook, counted natively
        counted = DDP(nn.Linear(4, 4))
        out["default"] = obs.attach(counted)
        seq0, c0 = obs.tracer.seq, obs.counter.count()
        step(counted)
        out["default_traced"] = obs.tracer.seq - seq0
        out["default_counted"] = obs.counter.count() - c0
        out["default_hooks"] = len(getattr(counted, "_comm_hooks", []) or [])
        obs.counter.sample()
        out["published"] = HeartbeatReader(obs.heartbeat.path).snapshot().cseq == obs.counter.count()
        obs._ddp_hook = ("traced", None)  # the opt-in from here on
        ours = DDP(nn.Linear(4, 4))
        out["ours"] = obs.attach(ours)
        seq0 = obs.tracer.seq
        step(ours)
        out["ours_seen"] = obs.tracer.seq - seq0
        kept = DDP(nn.Linear(4, 4))
        kept.register_comm_hook(None, users_hook)
        out["kept"] = obs.attach(kept)
        seq0 = obs.tracer.seq
        step(kept)
        out["kept_seen"] = obs.tracer.seq - seq0
        builtin = DDP(nn.Linear(4, 4))
        builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        out["builtin"] = obs.attach(builtin)
        out["plain_module"] = obs.attach(nn.Linear(2, 2))
        # the averaged gradient is the same as the built-in reducer's
        torch.manual_seed(0)
        a, b = DDP(nn.Linear(4, 4)), DDP(nn.Linear(4, 4))
        b.load_state_dict(a.state_dict())
        obs.attach(b)
        x = torch.full((2, 4), float(rank + 1))
        for m in (a, b):
            m(x).sum().backward()
        out["grads_close"] = all(torch.allclose(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
        # the hook ends the heartbeat's wait for each bucket in its one completion callback
        out["open_waits"] = sum(1 for w in obs.heartbeat._waits if w[1] is None)
        out["backward_stamps"] = _backward_stamps(obs, rank)
        out["stamps"] = _step_stamps(obs, rank)
    finally:
        obs.stop()
    model, opt = out["stamps"].pop("model"), out["stamps"].pop("opt")
    out["hooks_left"] = (len(model._forward_hooks) + len(model._forward_pre_hooks), len(opt._optimizer_step_pre_hooks))
    # after stop the tracer is gone but the hook stays registered: it averages untraced, still correctly
    for m in (a, b):
        m.zero_grad()
        m(x).sum().backward()
    out["grads_close_after_stop"] = all(torch.allclose(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    return out


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps `s` seconds (a slow layer's backward)."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.s)
        return g, None


def _backward_stamps(obs, rank: int) -> dict:
    """The step stamps of a DDP module without buffers (nothing issued in forward: the all-reduces come in
    backward): the arrival is the end of the rank's own backward (its last gradient accumulated), so rank 1's
    0.2 s longer backward is in its compute, and rank 0's wait for it in the all-reduce is not."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    obs.stamps.remove()
    obs.stamps = None
    from scout_ckpt.observer.stamps import StepStamps

    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    model = DDP(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    obs.stamps = StepStamps(obs.heartbeat, obs.counter, model, opt)  # attach's stamps, without this observer's
    # comm hook (a traced hook's first bucket would be the arrival)
    marks = {}
    for n in range(1, 6):
        x = torch.ones(2, 4, requires_grad=False)
        y = model(x)
        marks[("forward_done", n)] = time.time()
        _SlowBackward.apply(y, 0.2 if (rank == 1 and n > 1) else 0.0).sum().backward()
        marks[("backward_done", n)] = time.time()
        opt.step()
        marks[("opt_done", n)] = time.time()
        obs.step(n)
    stamps = HeartbeatReader(obs.heartbeat.path).snapshot().stamps
    out = {
        "steps": [s for s, *_ in stamps],
        "compute": {s: a - lt for s, lt, a, _w in stamps},
        "arrival": {s: a for s, _l, a, _w in stamps},
        "cpu_wait": {s: w for s, _l, _a, w in stamps},
        "backward_window": {s: (marks[("forward_done", s)], marks[("backward_done", s)]) for s, *_ in stamps},
        "grad_hooks_kept": len(obs.stamps._grad_handles),
        "params": len(list(model.parameters())),
    }
    obs.stamps.remove()
    out["grad_hooks_left"] = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
    return out


def _step_stamps(obs, rank: int) -> dict:
    """The step stamps on a real DDP module and optimizer (observer/stamps.py): rank 1 computes 0.2 s longer
    between the optimizer step and the next forward; at step 4 every rank first issues a Python all_reduce right
    after the previous step (a logged loss), and rank 1 sleeps after it: the compute goes on after a synchronous
    collective (every rank leaves it together), so the sleep is in the step's compute and the wait inside the
    all_reduce is not; a DDP module with a buffer broadcasts it at the forward's start (the arrival is then the
    forward's start)."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    obs.stamps.remove()
    obs.stamps = None
    earlier = len(HeartbeatReader(obs.heartbeat.path).snapshot().stamps)  # the heartbeat's ring holds 16
    model = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))  # a buffer: broadcast in every forward
    model.module[1].eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    obs.attach(model, opt)
    marks = {}  # wall-clock marks (the stamps' clock) around each call, to place each stamp between two of them
    for n in range(1, 6):
        if n == 4:
            marks["before_all_reduce"] = time.time()
            dist.all_reduce(torch.ones(1))
            marks["after_all_reduce"] = time.time()
        if n > 1 and rank == 1:
            time.sleep(0.2)
        marks[n] = time.time()  # before the forward
        y = model(torch.ones(2, 4))
        marks[("forward_done", n)] = time.time()
        y.sum().backward()
        marks[("opt_start", n)] = time.time()
        opt.step()
        marks[("opt_done", n)] = time.time()
        obs.step(n)
    stamps = HeartbeatReader(obs.heartbeat.path).snapshot().stamps[earlier:]
    in_all_reduce = {s: marks["after_all_reduce"] - marks["before_all_reduce"] if s == 4 else 0.0 for s, *_ in stamps}
    return {
        "steps": [s for s, *_ in stamps],
        "compute": {s: a - lt for s, lt, a, _w in stamps},
        "arrival": {s: a for s, _l, a, _w in stamps},
        # compute = arrival(s) - the optimizer step of s-1, less the wait inside a synchronous collective
        # between: at least the gap from the end of that step to the earliest possible arrival less that
        # collective, at most from its start to the end of step s's forward
        "compute_window": {
            s: (
                marks[s] - marks[("opt_done", s - 1)] - in_all_reduce[s],
                marks[("forward_done", s)] - marks[("opt_start", s - 1)],
            )
            for s, *_ in stamps
        },
        "forward_window": {s: (marks[s], marks[("forward_done", s)]) for s, *_ in stamps},
        "model": model,
        "opt": opt,
    }
