"""Consensus's exchange aggregated per node: what one process receives grows with the node count, not the ranks.

The flat exchange (save_time.py) all-gathers a fixed-size header over each replica group, so every member of a
DDP job's one group receives 56 bytes per rank of the job (5.6 MB a save at 10^5 ranks), and then all-gathers the
group verdicts over the world. On a multi-node torchrun job (consensus/nodes.py) the same decisions travel up and
down a tree of node aggregators instead:

  round 1 (headers)  every rank sends its header per replica group (structure digest, digest of its signature
                     rows, time taken, covers flag) to its node's aggregator (local rank 0); the aggregator groups
                     identical headers (the ranks per distinct (structure, signatures) key, as runs of ranks:
                     replicas that agree collapse to one entry), keeps the slowest time and whether all cover, and
                     sends that node summary to the coordinator (global rank 0). The coordinator merges every
                     node's summary per replica group, decides (`decide`), and sends each aggregator the decisions
                     of the groups its node takes part in; the aggregator passes each rank its own.
  per-tensor         only where a group's members hold different signatures with the same structure: one
                     broadcast over the group's gloo group per distinct signature batch, from that class's lowest
                     rank, so every member holds every class's [n, 2] rows and computes the per-tensor verdicts
                     (c3.verdicts_from_classes: the same verdicts as over every member's rows)
  round 2 (verdicts) where the job has more than the world's one group: every rank's local result goes up, each
                     aggregator and then the coordinator fold them (`fold`: group entries once per group, the union
                     of the rest), and the folded result comes down; every rank builds the same evidence from it.

The decision is the flat path's, computed from the grouped form: the structure digests differ -> C3 over the
members' structures; all keys equal -> every piece agrees; otherwise per-tensor C3 over the signatures. A
verdict's strict majority, its minority ranks and "inconclusive" are thus the same whether the minority is one
rank inside a node or a whole node (tests/test_consensus_node_exchange.py compares both over header tables).

Messages are consensus/nodes.py's point-to-point links on the consensus world group, with tags of their own. A
rank that dies blocks its aggregator's or the coordinator's receive until that group's timeout, as it blocked the
flat all_gather.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Iterable, Sequence

from scout_ckpt.consensus import nodes
from scout_ckpt.consensus.nodes import COORDINATOR, NodePlan

HEADERS_TAG, VERDICTS_TAG = 4201, 4203  # each uses tag and tag + 1 (length, payload)
AGREE, STRUCTURE, SIGS = "agree", "structure", "sigs"
STRUCTURE_NAME = "(state structure)"  # the piece a structure verdict names (save_time.STRUCTURE)
KEY = struct.Struct("<5q")  # structure digest (count, 128 bits), signature digest (128 bits)


# ---- the grouped form (pure) ---------------------------------------------------------------------------------


def runs(ranks: Iterable[int]) -> tuple[int, ...]:
    """Sorted distinct ranks as flat (start, stop) pairs: a node's or a majority's ranks in a few integers."""
    out: list[int] = []
    for r in sorted(set(ranks)):
        if out and out[-1] == r:
            out[-1] = r + 1
        else:
            out += [r, r + 1]
    return tuple(out)


def unruns(spec: Sequence[int]) -> list[int]:
    return [r for i in range(0, len(spec), 2) for r in range(spec[i], spec[i + 1])]


def key_of(header: Sequence[int]) -> bytes:
    """What replicas that agree share: the structure digest and the signature digest (header[:5]); the time
    (header[5]) and the covers flag (header[6]) are folded separately."""
    return KEY.pack(*header[:5])


def structure_of(key: bytes) -> tuple[int, int, int]:
    return KEY.unpack(key)[:3]


def elapsed_of(header: Sequence[int]) -> float:
    return struct.unpack("<d", struct.pack("<q", header[5]))[0]


def node_summary(items: Iterable[tuple[int, tuple[int, int, Sequence[int]]]]) -> dict:
    """{(kind, group index): ({key: runs of ranks}, slowest seconds, every member covers)} from a node's
    (rank, (kind, group index, header)) items."""
    classes: dict[tuple[int, int], dict[bytes, list[int]]] = {}
    slowest: dict[tuple[int, int], float] = {}
    covers: dict[tuple[int, int], bool] = {}
    for rank, (kind, index, header) in items:
        g = (kind, index)
        classes.setdefault(g, {}).setdefault(key_of(header), []).append(rank)
        slowest[g] = max(slowest.get(g, float("-inf")), elapsed_of(header))
        covers[g] = covers.get(g, True) and int(header[6]) == 1
    return {g: ({k: runs(v) for k, v in c.items()}, slowest[g], covers[g]) for g, c in classes.items()}


def join(specs: Iterable[Sequence[int]]) -> tuple[int, ...]:
    """Several runs of ranks (disjoint, as different nodes' are) as one: O(runs log runs), not O(ranks)."""
    pairs = sorted((spec[i], spec[i + 1]) for spec in specs for i in range(0, len(spec), 2))
    out: list[int] = []
    for lo, hi in pairs:
        if out and out[-1] >= lo:
            out[-1] = max(out[-1], hi)
        else:
            out += [lo, hi]
    return tuple(out)


def merge(summaries: Iterable[dict]) -> dict:
    """Node summaries merged per replica group: {(kind, index): ({key: runs of ranks}, slowest, covers)}."""
    out: dict[tuple[int, int], tuple[dict[bytes, list], float, bool]] = {}
    for s in summaries:
        for g, (classes, slowest, covers) in s.items():
            have, t, c = out.get(g, ({}, float("-inf"), True))
            for k, spec in classes.items():
                have.setdefault(k, []).append(spec)
            out[g] = (have, max(t, slowest), c and covers)
    return {g: ({k: join(v) for k, v in c.items()}, t, cov) for g, (c, t, cov) in out.items()}


def decide(classes: dict[bytes, Sequence[int]]) -> tuple:
    """One replica group's decision from its members grouped by key ({key: runs of ranks}), as the flat path
    decides from every member's header: (STRUCTURE, [(structure, runs)]) when the structure digests differ;
    (AGREE,) when every member holds the same key; else (SIGS, [(lowest rank, runs)]): the classes whose
    signature batches the members exchange for per-tensor verdicts. Classes in order of their lowest rank."""
    ordered = sorted(classes.items(), key=lambda kv: kv[1][0])
    structures: dict[tuple[int, int, int], list] = {}
    for k, spec in ordered:
        structures.setdefault(structure_of(k), []).append(spec)
    if len(structures) > 1:
        return (STRUCTURE, [(st, join(specs)) for st, specs in structures.items()])
    if len(ordered) == 1:
        return (AGREE,)
    return (SIGS, [(spec[0], tuple(spec)) for _, spec in ordered])


def positions(spec: Sequence[int], members: Sequence[int]) -> list[int]:
    """The members' indices of the ranks in `spec` (runs)."""
    at = {r: i for i, r in enumerate(members)}
    return [at[r] for r in unruns(spec)]


def fold(locals_: Iterable[dict]) -> dict:
    """Ranks' local results (save_time's `local`, entries keyed by (kind, group index) instead of members)
    folded into one: each group's entry once (the first seen: members hold the same one), the union of single
    and not-comparable pieces, the ranks with layout problems, the largest selection and time, and whether
    every rank covers. Folding folded results gives the same as folding their ranks' results."""
    out: dict[str, Any] = {
        "entries": {},
        "single": set(),
        "problems": {},
        "not_comparable": set(),
        "n_selected": 0,
        "duration_s": float("-inf"),
        "covers": True,
    }
    for loc in locals_:
        for e in loc["entries"].values() if isinstance(loc["entries"], dict) else loc["entries"]:
            out["entries"].setdefault((e["kind"], e["group"]), e)
        out["single"] |= set(loc["single"])
        if isinstance(loc["problems"], dict):
            out["problems"].update(loc["problems"])
        elif loc["problems"]:
            out["problems"][loc["rank"]] = list(loc["problems"])
        out["not_comparable"] |= {tuple(x) for x in loc["not_comparable"]}
        out["n_selected"] = max(out["n_selected"], loc["n_selected"])
        out["duration_s"] = max(out["duration_s"], loc["duration_s"])
        out["covers"] = out["covers"] and loc["covers"]
    return out


def unfold(folded: dict, groups) -> list[dict]:
    """A folded result as the list of local results save_time._summarise reads: one carrying the entries (with
    their members from the topology), then one per rank with layout problems, in rank order."""
    entries = []
    for (kind, index), e in folded["entries"].items():
        entries.append({**{k: v for k, v in e.items() if k != "group"}, "members": groups.kinds[kind].groups[index]})
    carrier = {
        "rank": -1,
        "entries": entries,
        "single": sorted(folded["single"]),
        "problems": [],
        "not_comparable": sorted(folded["not_comparable"]),
        "n_selected": folded["n_selected"],
        "duration_s": folded["duration_s"],
    }
    return [carrier] + [
        {
            "rank": r,
            "entries": [],
            "single": [],
            "problems": p,
            "not_comparable": [],
            "n_selected": 0,
            "duration_s": folded["duration_s"],
        }
        for r, p in sorted(folded["problems"].items())
    ]


def verdict(decision: tuple, names: list[str], members: list[int], sigs, fetch: Callable[[int], Any]):
    """The GroupVerdict of one replica group from its decision, the same as save_time's flat path gives from
    every member's header. SIGS: `fetch(lowest rank)` gives each class's [n, 2] signature rows, classes in order
    (save_time broadcasts them over the group: collective on its members)."""
    from scout_ckpt.consensus.c3 import c3_of_classes, combine, verdicts_from_classes, verdicts_from_gathered

    if decision[0] == AGREE:
        return verdicts_from_gathered(sigs.unsqueeze(0).expand(len(members), -1, -1), members, names)
    if decision[0] == STRUCTURE:
        classes = [(value, positions(spec, members)) for value, spec in decision[1]]
        return combine([c3_of_classes(classes, len(members))], members, [STRUCTURE_NAME])
    rows = [fetch(source) for source, _ in decision[1]]
    return verdicts_from_classes(rows, [positions(spec, members) for _, spec in decision[1]], members, names)


# ---- the tree (collective) -----------------------------------------------------------------------------------


def _tree(
    p: NodePlan,
    rank: int,
    mine: Any,
    group,
    tag: int,
    node_fold: Callable[[list[tuple[int, Any]]], tuple[int, Any]],
    root: Callable[[list[tuple[int, Any]]], Callable[[Any], Any]],
    split: Callable[[Any, int, Any], Any],
) -> Any:
    """Up to the node's aggregator, up to the coordinator, and down again. `node_fold` makes a node summary
    (number of ranks it covers, body) from its ranks' payloads; `root` takes every node's summary and returns the
    answer for one summary's aggregator; `split(node answer, rank, payload)` that rank's answer."""
    if rank != p.leader:
        nodes.send(mine, p.leader, group, tag)
        return nodes.recv(p.leader, group, tag)[0]
    got = [(rank, mine)] + [(m, nodes.recv(m, group, tag)[0]) for m in p.members if m != rank]
    summary = node_fold(got)
    if rank != COORDINATOR:
        nodes.send(summary, COORDINATOR, group, tag)
        answer = nodes.recv(COORDINATOR, group, tag)[0]
    else:
        summaries = [(rank, summary)]
        covered = summary[0]
        while covered < p.world:  # from any aggregator, in arrival order, until every rank is accounted for
            s, src = nodes.recv(None, group, tag)
            summaries.append((src, s))
            covered += int(s[0])
        answer_for = root(summaries)
        answer = None
        for src, s in summaries:
            a = answer_for(s)
            if src == rank:
                answer = a
            else:
                nodes.send(a, src, group, tag)
    for m, payload in got[1:]:
        nodes.send(split(answer, m, payload), m, group, tag)
    return split(answer, rank, mine)


def exchange_headers(p: NodePlan, rank: int, items: list[tuple[int, int, tuple]], group) -> dict:
    """Round 1: `items` are this rank's (kind, group index, header) for every kind it takes part in; returns
    {kind: (decision, slowest seconds, every member covers)} of this rank's groups. Collective over the job."""

    def node_fold(got):
        return (len(got), node_summary((r, it) for r, items_ in got for it in items_))

    def root(summaries):
        merged = merge(s for _, (_, s) in summaries)
        decided = {g: (decide(c), t, cov) for g, (c, t, cov) in merged.items()}
        return lambda s: {g: decided[g] for g in s[1]}

    def split(answer, _rank, items_):
        return {kind: answer[(kind, index)] for kind, index, _ in items_}

    return _tree(p, rank, items, group, HEADERS_TAG, node_fold, root, split)


def exchange_locals(p: NodePlan, rank: int, local: dict, group) -> dict:
    """Round 2: this rank's local result up, the job's folded result (`fold`) back. Collective over the job."""

    def node_fold(got):
        return (len(got), fold(x for _, x in got))

    def root(summaries):
        folded = fold(s for _, (_, s) in summaries)
        return lambda _s: folded

    return _tree(p, rank, local, group, VERDICTS_TAG, node_fold, root, lambda a, _r, _x: a)
