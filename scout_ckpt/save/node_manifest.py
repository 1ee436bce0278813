"""A save's file lists and digests, gathered per node: what the coordinator receives grows with the node count.

Who sends what (Committer.finish calls `gather` on every rank, after DCP's write finished everywhere):

  every rank        its report {"rank", "files", "finite_bad"} -> its node's aggregator (the node's local rank 0)
  aggregator        writes the node's reports as a node manifest into the temp dir (format/node_manifest.py,
                    fsynced), then sends the coordinator one compact summary: (node, rank, ranks, size, digest,
                    files, bytes, finite_bad of its failing ranks, error)
  coordinator       the aggregator of its own node; receives summaries until every rank of the job is accounted
                    for, and returns the list `Committer._publish` and the evidence take: one row per node, plus a
                    row per rank whose finite check failed, plus its own `.metadata`

The links are point-to-point messages on the commit's own group (a length, then the pickled payload, as
gather_object pickles), so no new process group is created at a save, where an async save's commit thread could
not create one safely. A node is what torchrun calls one: LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, and global
ranks contiguous per node (torchrun assigns them so). Without them, on one node, or on an object store, `plan`
gives None and the commit gathers flat lists as before.

On failure: an aggregator that cannot write its node manifest still sends its summary, with the error; the
coordinator then fails the publish (CommitError on every rank, nothing published). A rank that dies blocks the
links as it blocked gather_object, until the group's timeout.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from scout_ckpt.format import node_manifest as fm
from scout_ckpt.format.layout import DCP_METADATA, atomic_write_bytes

COORDINATOR = 0
_LEN_TAG, _DATA_TAG = 4101, 4102


@dataclass(frozen=True)
class NodePlan:
    """This rank's node: its number (GROUP_RANK), its aggregator (local rank 0) and its ranks."""

    node: int
    leader: int
    members: tuple[int, ...]
    world: int


def plan(rank: int, world: int, env: Mapping[str, str] | None = None) -> NodePlan | None:
    """The node of `rank` from torchrun's environment, or None where the flat gather applies (no torchrun, a
    single node, or values that do not describe a node of this job)."""
    env = os.environ if env is None else env
    try:
        local, size, node = (int(env[k]) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"))
    except (KeyError, ValueError):
        return None
    if not (0 <= local < size < world) or node < 0 or rank - local < 0:
        return None
    leader = rank - local
    return NodePlan(node=node, leader=leader, members=tuple(range(leader, min(leader + size, world))), world=world)


def wire(obj) -> bytes:
    """The bytes one message carries (pickled, as gather_object pickles)."""
    return pickle.dumps(obj)


def summary(node: int, leader: int, ranks: int, row: dict | None, finite_bad: dict, error: str | None) -> tuple:
    """What an aggregator sends the coordinator: a tuple, not a dict, since at 10^5 ranks its size is the
    coordinator's whole receive per save (bench/scale.py)."""
    if row is None:
        return (node, leader, ranks, None, None, 0, 0, finite_bad or None, error)
    return (node, leader, ranks, row["size"], row["digest"], row["files"], row["bytes"], finite_bad or None, error)


def node_rows(s: tuple) -> list[dict]:
    """The coordinator's rows of one summary: the node's row, then one per rank whose finite check failed (the
    invariants evidence names ranks), or the error."""
    node, leader, ranks, size, digest, nfiles, nbytes, finite_bad, error = s
    out: list[dict] = []
    if error is not None:
        out.append({"rank": leader, "files": [], "finite_bad": [], "error": f"node {node}: {error}"})
        return out
    row = {
        "path": fm.name(node),
        "size": size,
        "digest": digest,
        "rank": leader,
        "node": node,
        "ranks": ranks,
        "files": nfiles,
        "bytes": nbytes,
    }
    out.append({"rank": leader, "files": [row], "finite_bad": []})
    for r, bad in sorted((finite_bad or {}).items(), key=lambda kv: int(kv[0])):
        out.append({"rank": int(r), "files": [], "finite_bad": bad})
    return out


def write_node(tmp: Path, node: int, step: int, attempt: str | None, leader: int, reports: list[dict]) -> tuple:
    """An aggregator's part: the node manifest into `tmp` (fsynced with its directory: on a shared filesystem
    another host publishes the directory), and the summary for the coordinator. Never raises: an error travels
    in the summary, so the coordinator still hears from every node."""
    finite_bad = {str(r["rank"]): r["finite_bad"] for r in reports if r.get("finite_bad")}
    try:
        doc = fm.build(node, step, attempt, reports)
        data = fm.encode(doc)
        atomic_write_bytes(Path(tmp) / fm.name(node), data)
        return summary(node, leader, len(reports), fm.entry(doc, data, leader), finite_bad, None)
    except Exception as e:  # every rank must still reach the coordinator's receive (see the module docstring)
        return summary(node, leader, len(reports), None, finite_bad, f"{type(e).__name__}: {e}"[:300])


def gather(p: NodePlan, rank: int, report: dict, tmp: Path, step: int, attempt: str | None, group) -> list | None:
    """Collective on `group` (every rank of the job): the per-node gather described in the module docstring.
    Returns the coordinator's rows ([{"rank", "files", "finite_bad"[, "error"]}]), None on other ranks."""
    if rank != p.leader:
        _send(report, p.leader, group)
        return None
    reports = [report] + [_recv(m, group)[0] for m in p.members if m != rank]
    s = write_node(tmp, p.node, step, attempt, rank, reports)
    if rank != COORDINATOR:
        _send(s, COORDINATOR, group)
        return None
    summaries = [s]
    covered = len(p.members)
    while covered < p.world:  # from any aggregator, in arrival order, until every rank is accounted for
        got, _src = _recv(None, group)
        summaries.append(got)
        covered += int(got[2])
    rows = [r for x in sorted(summaries, key=lambda t: t[1]) for r in node_rows(x)]
    metadata = [f for f in report["files"] if f["path"] == DCP_METADATA]
    rows[0] = {**rows[0], "files": metadata + rows[0]["files"]}
    return rows


def _send(obj, dst: int, group) -> None:
    data = wire(obj)
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst, group=group, tag=_LEN_TAG)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst, group=group, tag=_DATA_TAG)


def _recv(src: int | None, group) -> tuple[Any, int]:
    n = torch.zeros(1, dtype=torch.int64)
    sender = dist.recv(n, src=src, group=group, tag=_LEN_TAG)
    buf = torch.empty(int(n[0]), dtype=torch.uint8)
    dist.recv(buf, src=sender, group=group, tag=_DATA_TAG)
    return pickle.loads(buf.numpy().tobytes()), sender  # this job's own ranks, trusted as gather_object trusts them
