"""Losing node 0 loses the root: what a surviving aggregator records when the root's store stops answering.

Node 0's aggregator is the hierarchy's root and hosts its store (observer/store_transport.py). When node 0 dies
(or only its observer, or the network to it), every other aggregator's store calls fail. That alone is "could
not check", never a verdict (observer/aggregator.py). But nobody would record the incident: so once the store
has been unreachable for the observers' live timeout, staggered by node number (node n waits n timeouts, so the
lowest surviving node speaks first), a surviving aggregator judges what it can see, its own node's ranks, with
node 0 marked silent (`judge`), and records the result through ROOT's claims (one writer, O_EXCL), as the flat
judge would record a rank that stopped answering:

- its own ranks all wait stalled in a collective, or died after a collective failed under them, and node 0's
  ranks are the only others (a job of two nodes): node 0's ranks are named, `attribution: node_silent`, a crash
  when ranks died of the failed collective, else a hang (node_summary.silent_nodes: the same rule the root
  applies to a silent node);
- otherwise (its ranks train on: only the root's observer or its network died; or other nodes exist whose
  state it cannot hear without the store) nobody is blamed: a `health` event without ranks says the root was
  lost (`what: observer_root_lost`), so that the gap in the observer's watch is on record.

A verdict about the survivor's own ranks (one of them gone without a failed collective) is recorded as such.
Pure but `record`'s caller: no I/O here.
"""

from __future__ import annotations

from scout_ckpt.observer import node_summary as ns

WHAT = "observer_root_lost"


def judge(own: dict, node0: tuple[int, int], silent_s: float, world: int, stall_s: float) -> dict:
    """{"kind", "ranks", "step", "detail"} to record, from the survivor's own node summary (`own`, as
    node_summary.summarize gives it) and node 0's ranks (first, last), silent for `silent_s` seconds."""
    job = {**own, "nodes": {**own["nodes"], "0": ["node 0", node0[0], node0[1], 0]}, "silent": {"0": silent_s}}
    verdict = ns.judge(job, world, stall_s)
    (judge_node,) = (int(n) for n in own["nodes"])
    base = {"root_lost": True, "judged_by_node": judge_node, "silent_s": round(silent_s, 3)}
    if verdict is not None and verdict["ranks"]:
        detail = {
            **{k: v for k, v in verdict.items() if k not in ("kind", "ranks", "step")},
            **base,
            "hierarchy": {"nodes": None, "silent": {"0": round(silent_s, 3)}},
        }
        if verdict.get("attribution") == "node_silent":
            detail["node_rank"] = 0
        return {"kind": verdict["kind"], "ranks": list(verdict["ranks"]), "step": verdict["step"], "detail": detail}
    steps = [f[3] for f, _ in own["groups"]]
    return {
        "kind": "health",
        "ranks": [],
        "step": max(steps) if steps else None,
        "detail": {
            "what": WHAT,
            **base,
            "reason": f"the hierarchy's root (node 0's observer and its store) has not answered for {silent_s:.1f}s; "
            f"node {judge_node} cannot tell whether node 0 or only its observer is lost: nobody is blamed",
        },
    }
