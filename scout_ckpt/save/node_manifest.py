"""A save's file lists and digests, gathered per node: what the coordinator receives grows with the node count.

Who sends what (Committer.finish calls `gather` on every rank, after DCP's write finished everywhere):

  every rank        its report {"rank", "files", "finite_bad"} -> its node's aggregator (the node's local rank 0)
  aggregator        writes the node's reports as a node manifest into the temp dir (format/node_manifest.py,
                    fsynced) or, on an object store, as an object of the save attempt's prefix (durable once its
                    upload completed: ObjectStore.write_object), then sends the coordinator one compact summary:
                    (node, rank, ranks, size, digest, files, bytes, finite_bad of its failing ranks, error)
  coordinator       the aggregator of its own node; receives summaries until every rank of the job is accounted
                    for, and returns the list `Committer._publish` and the evidence take: one row per node, plus a
                    row per rank whose finite check failed, plus its own `.metadata`

The links are point-to-point messages on the commit's own group (consensus/nodes.py: a length, then the pickled
payload), so no new process group is created at a save. A node is what torchrun calls one (consensus/nodes.py,
`plan`); without one, or on one node, `plan` gives None and the commit gathers flat lists as before. A POSIX
root and an object-store root take the same gather; only where the node manifest is written differs (`tmp`: the
temp dir, or a function that writes one object of the attempt).

On failure: an aggregator that cannot write its node manifest still sends its summary, with the error; the
coordinator then fails the publish (CommitError on every rank, nothing published). A rank that dies blocks the
links as it blocked gather_object, until the group's timeout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Union

from scout_ckpt.consensus import nodes
from scout_ckpt.consensus.nodes import COORDINATOR, NodePlan, plan, wire  # noqa: F401  (the node layout: consensus's)
from scout_ckpt.format import node_manifest as fm
from scout_ckpt.format.layout import DCP_METADATA, atomic_write_bytes

# Where an aggregator writes its node manifest: the temp dir of a POSIX save, or put(name, bytes) (an object store)
Target = Union[Path, Callable[[str, bytes], None]]


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


def write_node(tmp: Target, node: int, step: int, attempt: str | None, leader: int, reports: list[dict]) -> tuple:
    """An aggregator's part: the node manifest into `tmp` (fsynced with its directory: on a shared filesystem
    another host publishes the directory; on an object store, `tmp(name, data)` returns once the object is
    stored), and the summary for the coordinator. Never raises: an error travels in the summary, so the
    coordinator still hears from every node."""
    finite_bad = {str(r["rank"]): r["finite_bad"] for r in reports if r.get("finite_bad")}
    try:
        doc = fm.build(node, step, attempt, reports)
        data = fm.encode(doc)
        if callable(tmp):
            tmp(fm.name(node), data)
        else:
            atomic_write_bytes(Path(tmp) / fm.name(node), data)
        return summary(node, leader, len(reports), fm.entry(doc, data, leader), finite_bad, None)
    except Exception as e:  # every rank must still reach the coordinator's receive (see the module docstring)
        return summary(node, leader, len(reports), None, finite_bad, f"{type(e).__name__}: {e}"[:300])


def gather(p: NodePlan, rank: int, report: dict, tmp: Target, step: int, attempt: str | None, group) -> list | None:
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
    nodes.send(obj, dst, group)


def _recv(src: int | None, group) -> tuple[Any, int]:
    return nodes.recv(src, group)
