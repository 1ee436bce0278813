"""A node's compact summary of its ranks' statuses, how summaries merge up a tree, and the job-level verdict over
them: pure functions, no I/O (observer/hierarchy.py moves the summaries).

Why grouped rows: what the judge's rule (verdicts.attribute) needs from a rank is a dozen fields (state, whether
it is stalled, step, collective numbers, fingerprint, where it waits). Ranks that agree on all of them say the
same thing, so a node sends one group per distinct set of fields with the ranks that hold it (as spans: a node's
ranks are consecutive), and a merge unites equal groups across nodes. A healthy job of 100,000 ranks stalled in
one collective is one group; a laggard is a group of one. Counts are sums of group sizes and named ranks are the
groups' members, so a strict majority means over a merged summary what it means over every rank's row: a
minority rank inside a node and a minority node are both named.

A summary: {"nodes": {node: [host, first_rank, last_rank, beat]}, "groups": [[fields, spans], ...],
"extra": {rank: {"stacks", "hb"}}, "silent": {node: seconds}, "pace": {node: [seconds per step, window, step,
measure]}} where `fields` follows FIELDS and `spans` is
[[lo, hi], ...] (inclusive). `extra` carries the stack-dump positions of stalled ranks outside their node's
largest group (the likely culprits); `silent` lists the nodes whose summaries stopped coming (their groups are
kept with `live` false: unknown unless their last word was final).
"""

from __future__ import annotations

from typing import Iterable, Iterator

from scout_ckpt.observer.verdicts import attribute, members, spans, weight

FIELDS = (
    "state",
    "live",
    "stalled",
    "step",
    "phase",
    "seq",
    "fp",
    "in_coll",
    "in_side",
    "error",
    "cseq",
    "pos",
    "off_watch",
    "gone_at",
)
FINAL = ("gone", "closed", "aborted")


def _key(row: dict, stall_s: float) -> tuple:
    return (
        row["state"],
        bool(row.get("live", True)),
        row.get("age_s", 0.0) >= stall_s,
        row["step"],
        row.get("phase", "idle"),
        row["seq"],
        row["fp"],
        bool(row.get("in_coll")),
        bool(row.get("in_side")),
        bool(row.get("error")),
        row.get("cseq") or 0,
        row.get("pos") or 0,
        bool(row.get("off_watch")),
        row.get("gone_at") if row["state"] == "gone" else None,
    )


def to_spans(ranks: Iterable[int]) -> list[list[int]]:
    """[0, 1, 2, 5] -> [[0, 2], [5, 5]]."""
    out: list[list[int]] = []
    for r in sorted(ranks):
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return out


def _join(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for lo, hi in sorted([*a, *b]):
        if out and out[-1][1] >= lo - 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def summarize(
    node: int,
    host: str,
    first: int,
    last: int,
    beat: int,
    rows: dict[int, dict],
    stall_s: float,
    pace: list | None = None,
) -> dict:
    """The summary of node `node` (global ranks first..last) from its ranks' status rows ({rank: row}, `live`
    and `age_s` brought up to date by the aggregator). A rank without a row is left out: unknown. `pace`: the
    node's pace (StragglerJudge.pace), which the root compares between nodes (observer/node_pace.py)."""
    groups: dict[tuple, list[int]] = {}
    for r, row in sorted(rows.items()):
        groups.setdefault(_key(row, stall_s), []).append(r)
    biggest = max((len(v) for v in groups.values()), default=0)
    extra = {}
    for key, ranks in groups.items():
        if key[2] and (len(ranks) < biggest or len(groups) == 1 or list(map(len, groups.values())).count(biggest) > 1):
            for r in ranks:
                if rows[r].get("stacks"):
                    extra[str(r)] = {"stacks": rows[r]["stacks"], "hb": rows[r].get("hb")}
    return {
        "beat": beat,
        "nodes": {str(node): [host, first, last, beat]},
        "groups": [[list(k), to_spans(v)] for k, v in groups.items()],
        "extra": extra,
        "silent": {},
        "pace": {str(node): pace} if pace is not None else {},
    }


def mark_silent(summary: dict, node: int, silent_s: float) -> dict:
    """The node's last summary, its groups no longer live (its aggregator stopped sending: dead or cut off)."""
    groups = []
    for fields, sp in summary["groups"]:
        f = list(fields)
        f[1] = False
        groups.append([f, sp])
    return {**summary, "groups": groups, "silent": {**summary.get("silent", {}), str(node): round(silent_s, 3)}}


def merge(summaries: Iterable[dict]) -> dict:
    """One summary for several (a group leader's, the root's): equal groups united."""
    nodes: dict = {}
    extra: dict = {}
    silent: dict = {}
    pace: dict = {}
    groups: dict[tuple, list[list[int]]] = {}
    for s in summaries:
        nodes.update(s["nodes"])
        extra.update(s.get("extra", {}))
        silent.update(s.get("silent", {}))
        pace.update(s.get("pace", {}))
        for fields, sp in s["groups"]:
            key = tuple(fields)
            groups[key] = _join(groups[key], sp) if key in groups else [list(x) for x in sp]
    return {
        "nodes": nodes,
        "groups": [[list(k), v] for k, v in groups.items()],
        "extra": extra,
        "silent": silent,
        "pace": pace,
    }


class Spans:
    """The ranks of a grouped row, as spans: iterable, sized and indexable at 0 (what verdicts.members, label
    and where use) without building a list of 100,000 ranks each round."""

    __slots__ = ("spans", "n")

    def __init__(self, sp: list[list[int]]):
        self.spans = sp
        self.n = sum(hi - lo + 1 for lo, hi in sp)

    def __iter__(self) -> Iterator[int]:
        for lo, hi in self.spans:
            yield from range(lo, hi + 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i != 0:
            raise IndexError(i)
        return self.spans[0][0]


def to_rows(summary: dict, stall_s: float) -> dict[int, dict]:
    """The grouped table verdicts.attribute takes: {group id: row with `n` and `ranks`}. A stalled group's age is
    stall_s (the aggregator judged it stalled), a running one's 0."""
    rows = {}
    for i, (fields, sp) in enumerate(summary["groups"]):
        row = dict(zip(FIELDS, fields))
        row["age_s"] = stall_s if row.pop("stalled") else 0.0
        ranks = Spans(sp)
        row["ranks"], row["n"] = ranks, ranks.n
        rows[i] = row
    return rows


def node_of(summary: dict, rank: int) -> tuple[int, str] | None:
    for node, (host, lo, hi, _beat) in summary["nodes"].items():
        if lo <= rank <= hi:
            return int(node), host
    return None


def judge(summary: dict, world_size: int, stall_s: float) -> dict | None:
    """The job-level verdict over a merged summary: verdicts.attribute over the groups whose word counts (live,
    or final), then the silent-node rule: when nodes stopped sending and every rank seen is stalled waiting in
    a collective, the silent nodes' ranks are the ones the job waits for (`node_silent`). A silent node whose
    peers keep running is never named: its ranks may be training fine behind a cut-off observer."""
    rows = to_rows(summary, stall_s)
    known = {k: row for k, row in rows.items() if row["live"] or row["state"] in FINAL}
    verdict = attribute(known, world_size, stall_s)
    if not summary.get("silent"):
        return verdict
    if verdict is not None and verdict["kind"] == "crash" and verdict["attribution"] != "only_rank":
        # the crash rule takes every rank it does not name for a survivor or a victim; a silent node's ranks
        # cannot vouch: the named ones must leave a strict majority among the ranks seen
        gone = [k for k, row in known.items() if row["state"] == "gone" and set(row["ranks"]) <= set(verdict["ranks"])]
        if weight(known, known) - weight(known, gone) < world_size // 2 + 1:
            verdict = None
    if verdict is not None and verdict["ranks"]:
        return verdict
    return silent_nodes(summary, rows, known, world_size, stall_s) or verdict


def silent_nodes(summary: dict, rows: dict, known: dict, world_size: int, stall_s: float) -> dict | None:
    """The silent-node rule of `judge`: every rank seen is either stalled waiting in a collective or gone
    after a collective failed under it (a victim), and the rest are the silent nodes': the job waits for them,
    or lost them. With victims the node is most likely dead (its sockets closed under its peers): a crash;
    else a hang (a stuck host, a cut-off node)."""
    # the silent nodes' ranks whose last word is not final, those missing from their last summary included
    silent = {r for n in summary["silent"] for r in range(summary["nodes"][n][1], summary["nodes"][n][2] + 1)}
    ranks = sorted(silent - set(members(known, known)))
    if not ranks or weight(known, known) + len(ranks) != world_size:
        return None
    seen = list(known)

    def waits(row: dict) -> bool:
        return row["state"] == "running" and row["age_s"] >= stall_s and bool(row["in_coll"] or row["in_side"])

    victims = [k for k in seen if known[k]["state"] == "gone" and known[k]["error"]]
    if not seen or any(not waits(known[k]) for k in seen if k not in victims):
        return None
    nodes = sorted(int(n) for n in summary["silent"])
    hosts = {n: summary["nodes"][str(n)][0] for n in nodes if str(n) in summary["nodes"]}
    top = max(seen, key=lambda k: (known[k]["step"], known[k]["seq"]))
    return {
        "kind": "crash" if victims else "hang",
        "ranks": ranks,
        "step": known[top]["step"],
        "seq": known[top]["seq"],
        "cseq": known[top]["cseq"],
        "attribution": "node_silent",
        "nodes_silent": nodes,
        "reason": f"node(s) {nodes} ({', '.join(hosts.values())}) stopped sending summaries for "
        f"{max(summary['silent'].values()):.1f}s (the node is down or cut off) while every other rank "
        f"({weight(known, seen)} of {world_size}) "
        + ("failed in a collective or " if victims else "")
        + f"waits in a collective for >= {stall_s:g}s: rank(s) "
        f"{spans(ranks)} are the ones the job waits for",
    }
