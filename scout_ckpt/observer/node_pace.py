"""A node slow as a whole is a straggler: the hierarchy's root compares the nodes' paces.

Stragglers are judged per node by its aggregator, against the node's other ranks (observer/stragglers.py): a
node all of whose ranks are slow (a slow host, a throttled CPU or GPU, a node-wide data loader) has no odd rank
inside it. Each node's summary therefore carries its pace (StragglerJudge.pace): the sample of its fastest rank
in the aggregator's latest window, in the measure the node uses (compute per step from the step stamps, arrival
skew, busy time). The fastest rank, so that one slow rank never makes its node slow: a node is slow only when
every rank of it is, and a single slow rank is still named by its aggregator as before.

The root (`NodePaceJudge.update`, each round over the merged summary) takes a window once every node has sent a
new one in the same measure, applies the same rule as between ranks (consensus/timing.py: robust outliers over
three nodes or more, `pair_outlier` between two), confirms it over `rounds` windows in a row, and names the node
once per episode: a `straggler` event whose ranks are the node's ranks, with the node and its host. A silent
node, a node without a pace (it has not judged a window yet: not every rank runs), or nodes using different
measures give no window: could not compare is never a verdict. Pure: no I/O.
"""

from __future__ import annotations

from statistics import median

from scout_ckpt.consensus.timing import Confirmer, robust_outliers
from scout_ckpt.observer.stragglers import pair_outlier


class NodePaceJudge:
    """`rule`: the observer config's `straggler` dict (rounds, k, floors; window options are the aggregators')."""

    def __init__(self, *, rounds: int = 3, k: float = 3.0, abs_floor_s: float = 0.01, rel_floor: float = 0.5, **_):
        self.rule = {"k": k, "abs_floor_s": abs_floor_s, "rel_floor": rel_floor}
        self.confirmer = Confirmer(rounds)
        self.seen: dict[str, str] = {}  # node -> the window id last used
        self._reported: set[int] = set()

    def update(self, summary: dict) -> list[dict]:
        """Straggler events ({"ranks", "step", "detail"}) of nodes confirmed slow at this round; [] when no new
        window of every node is there (see the module docstring)."""
        nodes, pace = summary.get("nodes") or {}, summary.get("pace") or {}
        if len(nodes) < 2 or set(pace) != set(nodes) or summary.get("silent"):
            return []
        if len({p[3] for p in pace.values()}) != 1 or any(self.seen.get(n) == p[1] for n, p in pace.items()):
            return []
        self.seen = {n: p[1] for n, p in pace.items()}
        samples = {int(n): float(p[0]) for n, p in pace.items()}
        flagged = pair_outlier(samples, **self.rule) if len(samples) == 2 else robust_outliers(samples, **self.rule)
        confirmed = self.confirmer.update(flagged)
        self._reported &= set(flagged)
        med = median(samples.values())
        step = max(int(p[2]) for p in pace.values())
        measure = next(iter(pace.values()))[3]
        events = []
        for node, slowdown in confirmed.items():
            if node in self._reported:
                continue
            self._reported.add(node)
            host, lo, hi, _beat = nodes[str(node)]
            than = f"node {min(samples, key=lambda q: samples[q])}" if len(samples) == 2 else "the median node"
            events.append(
                {
                    "ranks": list(range(lo, hi + 1)),
                    "step": step,
                    "detail": {
                        "reason": f"node {node} ({host}) is {slowdown:.1f}x slower than {than}: every rank of it "
                        f"({measure} per step of its fastest rank, in {self.confirmer.rounds} windows in a row)",
                        "scope": "node",
                        "node": node,
                        "host": host,
                        "slowdown": round(slowdown, 3),
                        "rounds": self.confirmer.rounds,
                        "node_s_per_step": {str(q): round(v, 6) for q, v in sorted(samples.items())},
                        "median_node_s": round(med, 6),
                        "measure": measure,
                        "rule": self.rule,
                    },
                }
            )
        return events
