"""Run a function on N real gloo ranks in child processes: used by the tests, the benches and the campaign.

The parent hosts the TCPStore (port 0, so no port races) and each child joins with `is_master=False`
(docs/pytorch-facts.md, "Processes in tests"). Children come from a forkserver that has imported torch once:
forking the parent itself is unsafe, because the TCPStore server's threads (and any OpenMP pool) can hold a
libc lock at the instant of fork and deadlock the child; spawn is safe but costs 3-4.5 s per 4 ranks.
`SCOUT_START_METHOD=spawn|fork` overrides. Worker functions must be importable (module level).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable


class RankFailure(RuntimeError):
    pass


@dataclass
class RankOutcome:
    rank: int
    exitcode: int | None
    result: Any = None
    error: str | None = None


def _child(fn, rank, world_size, port, args, kwargs, q, env, pg_timeout_s):
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=pg_timeout_s)
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s)
        )
        result = fn(rank, world_size, *args, **kwargs)
        # Plain pickle to bytes: torch's queue reducers would share tensors by fd, which breaks when the child
        # exits before the parent reads.
        q.put((rank, "ok", pickle.dumps(result)))
        dist.barrier()  # without it destroy_process_group can hang at exit
        dist.destroy_process_group()
    except BaseException:  # report, then exit non-zero
        q.put((rank, "err", traceback.format_exc()))
        q.close()
        q.join_thread()  # os._exit skips the queue's feeder thread: flush first
        os._exit(1)
    q.close()
    q.join_thread()
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    allow_failures: bool = False,
    start_method: str | None = None,
    **kwargs: Any,
) -> list[RankOutcome]:
    """Run fn(rank, world_size, *args, **kwargs) on world_size gloo ranks; return one outcome per rank.

    Raises RankFailure if a rank fails or the run exceeds `timeout`, unless allow_failures (crash tests,
    where ranks are SIGKILLed on purpose). Surviving ranks are SIGKILLed at the deadline either way.
    """
    import multiprocessing as mp

    import torch.distributed as dist

    method = start_method or os.environ.get("SCOUT_START_METHOD", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.checkpoint"])
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size + 1,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    q = ctx.Queue()
    env = dict(env or {})
    procs = [
        ctx.Process(
            target=_child, args=(fn, r, world_size, store.port, args, kwargs, q, env, pg_timeout_s), daemon=False
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes = {r: RankOutcome(r, None) for r in range(world_size)}
    deadline = time.monotonic() + timeout
    timed_out = False
    pending = set(range(world_size))

    def take(item) -> None:
        rank, status, payload = item
        if status == "ok":
            outcomes[rank].result = pickle.loads(payload)
        else:
            outcomes[rank].error = payload

    while pending:
        try:
            take(q.get(timeout=0.05))
        except queue_mod.Empty:
            pass
        for r in list(pending):
            if not procs[r].is_alive():
                pending.discard(r)
        if time.monotonic() > deadline:
            timed_out = True
            break
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(5)
    while True:  # drain results that arrived just before exit
        try:
            take(q.get(timeout=0.05))
        except queue_mod.Empty:
            break
    for r, p in enumerate(procs):
        outcomes[r].exitcode = p.exitcode
    del store
    result = [outcomes[r] for r in range(world_size)]
    if not allow_failures:
        bad = [o for o in result if o.exitcode != 0 or o.error]
        if timed_out or bad:
            detail = "\n".join(f"rank {o.rank} exit={o.exitcode}\n{o.error or ''}" for o in bad)
            raise RankFailure(("timed out after %.0fs\n" % timeout if timed_out else "") + detail)
    return result
