"""The observer's hierarchy for jobs on several nodes: who reads what each round.

Why: on one ROOT shared by every host, the single judge of the flat observer reads every rank's status file each
round; at 100,000 ranks that is 100,000 reads every half second against a shared filesystem's metadata server.
Here each node's aggregator (the observer of local rank 0) reads its own node's statuses from node-local files
(/dev/shm), groups them (observer/node_summary.py) and writes one summary to the root's store
(observer/store_transport.py). With more nodes than `fan_in`, the nodes form groups of `fan_in` and the first
node of each group (its leader) merges its group's summaries into one; the root reads the groups' summaries
(or, with few nodes, the nodes' own) and judges the job. Nobody reads more than max(fan_in, groups) keys, plus
its own node's statuses, per round.

Silence: a summary whose beat stops changing for `live_timeout_s` is silent. Its node's groups stay, no longer
live (node_summary.mark_silent): unknown unless their last word was final. A group whose leader falls silent is
read node by node by the root instead (`fan_in` more keys for that round), so a dead leader never makes its
healthy nodes silent.
"""

from __future__ import annotations

import math
from typing import Callable

from scout_ckpt.observer import node_summary as ns

DEFAULT_FAN_IN = 64


def groups_of(nodes: int, fan_in: int = DEFAULT_FAN_IN) -> list[list[int]]:
    """The nodes' groups: one group when nodes <= fan_in, else groups of about sqrt(nodes) (at least fan_in) so
    that the root and each leader read about as many keys."""
    if nodes <= fan_in:
        return [list(range(nodes))]
    size = max(fan_in, math.ceil(math.sqrt(nodes)))
    return [list(range(lo, min(nodes, lo + size))) for lo in range(0, nodes, size)]


def node_key(node: int) -> str:
    return f"node/{node}"


def group_key(g: int) -> str:
    return f"group/{g}"


Reader = Callable[[list[str]], dict]


class Beats:
    """When each summary's beat last changed, as this reader saw it (no other host's clock enters)."""

    def __init__(self, live_timeout_s: float):
        self.live_timeout_s = live_timeout_s
        self.seen: dict[str, tuple[int, float]] = {}

    def silent_for(self, key: str, beat: int, now: float) -> float:
        """Seconds the summary under `key` has been silent (0 while its beat moves or its silence is short)."""
        seen = self.seen.get(key)
        if seen is None or seen[0] != beat:
            self.seen[key] = seen = (beat, now)
        age = now - seen[1]
        return age if age >= self.live_timeout_s else 0.0


def collect_nodes(nodes: list[int], read: Reader, beats: Beats, now: float) -> list[dict]:
    """The nodes' summaries (silent ones marked); a node that never wrote one is left out (unknown)."""
    got = read([node_key(n) for n in nodes])
    out = []
    for n in nodes:
        s = got.get(node_key(n))
        if s is None:
            continue
        quiet = beats.silent_for(node_key(n), s["beat"], now)
        out.append(ns.mark_silent(s, n, quiet) if quiet else s)
    return out


def leader_round(group: list[int], read: Reader, beats: Beats, now: float, beat: int) -> dict:
    """A group leader's summary of its group's nodes."""
    return {**ns.merge(collect_nodes(group, read, beats, now)), "beat": beat}


def root_round(groups: list[list[int]], read: Reader, beats: Beats, now: float) -> dict:
    """The job's summary as the root sees it: the nodes' own summaries when there is one group, else the
    leaders', and the nodes of a silent leader's group one by one."""
    if len(groups) == 1:
        return ns.merge(collect_nodes(groups[0], read, beats, now))
    got = read([group_key(g) for g in range(len(groups))])
    parts = []
    for g, nodes in enumerate(groups):
        s = got.get(group_key(g))
        if s is None or beats.silent_for(group_key(g), s["beat"], now):
            parts.extend(collect_nodes(nodes, read, beats, now))
        else:
            parts.append(s)
    return ns.merge(parts)


def reads_per_round(nodes: int, ranks_per_node: int, fan_in: int = DEFAULT_FAN_IN) -> dict[str, int]:
    """Items each role reads per round (no silence): an aggregator its node's statuses and the claims counter; a
    leader also its group's summaries; the root the summaries of the groups (or of the nodes)."""
    groups = groups_of(nodes, fan_in)
    agg = ranks_per_node + 1
    if len(groups) == 1:
        return {"aggregator": agg, "leader": agg, "root": agg + nodes}
    biggest = max(len(g) for g in groups)
    return {"aggregator": agg, "leader": agg + biggest, "root": agg + biggest + len(groups)}


ENV = "SCOUT_CKPT_OBSERVER_HIERARCHY"  # "0": the flat observer even on several nodes; "1": the hierarchy on one


def job_config(rank: int, world_size: int, run_id: str, timeout_s: float) -> dict | None:
    """The "hier" part of an observer's config (training side, collective: every rank calls it at start), or None
    for the flat observer: a job on one node (as today), a setting of ENV to "0", no torchrun node layout
    (LOCAL_WORLD_SIZE, GROUP_RANK, global ranks consecutive per node), or no job store to publish the root's
    address in. Rank 0 picks the root store's port and publishes HOST:PORT in the job's store (HOST:
    MASTER_ADDR, where rank 0 runs under torchrun); each node's first rank reads it."""
    import os
    import socket

    setting = os.environ.get(ENV, "auto")
    if setting == "0":
        return None
    try:
        lws = int(os.environ["LOCAL_WORLD_SIZE"])
        # without torchrun's node rank and local rank, nodes are taken as consecutive blocks of lws ranks
        node = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", rank // max(lws, 1))))
        local = int(os.environ.get("LOCAL_RANK", rank % max(lws, 1)))
    except (KeyError, ValueError):
        return None
    if lws <= 0 or world_size % lws or rank != node * lws + local or (lws == world_size and setting != "1"):
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    key = f"scout-observer/{run_id}/hierarchy-root"
    addr = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        addr = f"{os.environ.get('MASTER_ADDR') or socket.getfqdn()}:{port}"
        store.set(key, addr)
    elif local == 0:
        import datetime

        store.wait([key], datetime.timedelta(seconds=timeout_s))
        addr = store.get(key).decode()
    host, _, port_s = (addr or ":0").rpartition(":")
    base = (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else os.environ.get("TMPDIR", "/tmp")
    )
    local_dir = os.path.join(base, f"scout-obs-{run_id}-n{node}")
    os.makedirs(local_dir, exist_ok=True)
    return {
        "node": node,
        "nodes": world_size // lws,
        "first": node * lws,
        "last": node * lws + lws - 1,
        "addr": host,
        "port": int(port_s),
        "local": local_dir,
        "fan_in": DEFAULT_FAN_IN,
    }
