"""The observer's part in the hierarchy (observer/hierarchy.py) on a job of several nodes.

Every observer writes its status each round to a node-local folder (/dev/shm; `hier["local"]`), not to ROOT: the
checkpoint filesystem sees a status only when a trainer's state changes (start, death, close), which is what
aftermath.py and the start-up's wait read there. The observer of the node's first rank is its aggregator: each
round it reads its node's statuses, publishes the node's summary to the root's store, runs the straggler rule
over its node's ranks (a straggler is named against its node's peers; the node's pace goes into its summary,
and the root compares the nodes' paces: observer/node_pace.py), and copies the store's claims counter
into the node-local `claims-gen` file, from which every observer of the node learns that an incident was
published (it then lists ROOT's claims once, not every round). Node 0's aggregator is the root: it hosts the
store, reads the summaries and judges the job (node_summary.judge), publishing through the same claim protocol as
the flat judge (observer/incidents.py). A group leader (with more than `fan_in` nodes) also merges its group's
summaries.

Could not reach the store (the root gone, the network cut) is not a verdict: the aggregator logs it once, keeps
its node's statuses going and retries each round.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from scout_ckpt.observer import hierarchy as hier
from scout_ckpt.observer import node_summary as ns
from scout_ckpt.observer import stacks as stacks_mod
from scout_ckpt.observer.channel import write_status
from scout_ckpt.observer.verdicts import spans

log = logging.getLogger("scout_ckpt.observer")

CLAIMS_GEN = "claims-gen"


class NodeRole:
    """`daemon`: the observer (daemon.Daemon) whose node this is; `hier`: its config's "hier" dict."""

    def __init__(self, daemon, hier_cfg: dict):
        self.d = daemon
        self.h = hier_cfg
        self.node, self.first, self.last = hier_cfg["node"], hier_cfg["first"], hier_cfg["last"]
        self.local = Path(hier_cfg["local"])
        self.aggregator = daemon.rank == self.first
        self.root = self.aggregator and self.node == 0
        self.groups = hier.groups_of(hier_cfg["nodes"], hier_cfg.get("fan_in", hier.DEFAULT_FAN_IN))
        self.leads = next(
            (g for g, members in enumerate(self.groups) if len(self.groups) > 1 and members[0] == self.node), None
        )
        self.transport: Any = None  # store_transport.StoreTransport, connected at the first round (it imports torch)
        # how long a round's store calls (the first connect included) may hold this observer's loop: its trainer's
        # watch, its exit and its node's summary wait meanwhile. A root that is down (or stopped, its host stuck)
        # fails the round in this time, and a later round tries again.
        self.store_timeout_s = max(daemon.live_timeout_s, 5.0)
        from scout_ckpt.observer.store_transport import Bounded

        self.bounded = Bounded(self.store_timeout_s)
        self.beats = hier.Beats(daemon.live_timeout_s)
        self.claims_seen = -1
        self.channel_state: str | None = None  # the trainer's state last written to ROOT's channel
        self.unsettled = False  # the root: some rank's last word is not final yet (someone is left to judge)
        self.local_gen: str | None = None
        self._failing = False
        self.heard_root = False  # the root's store answered at least once
        self.lost_since: float | None = None  # since when it does not (this host's clock)
        self.lost_recorded = False
        self.stragglers = None
        if self.aggregator:
            from scout_ckpt.observer.stragglers import StragglerJudge

            self.stragglers = StragglerJudge(self.last - self.first + 1, **daemon.cfg["straggler"])
        self.node_pace = None
        if self.root:
            from scout_ckpt.observer.node_pace import NodePaceJudge

            self.node_pace = NodePaceJudge(**daemon.cfg["straggler"])

    def status_path(self, rank: int) -> Path:
        return self.local / f"status-{rank}.json"

    # ---- every observer ---------------------------------------------------------------------------------------

    def exchange(self, now: float, final: bool = False) -> None:
        """The observer's status to the node-local folder (and to ROOT's channel when its trainer's state
        changed), the node's round if this observer aggregates it, and the claims when the node's counter
        moved. `final`: the observer's last word, at exit."""
        d = self.d
        write_status(self.status_path(d.rank), d.last_status)
        if d.last_status["state"] != self.channel_state or final:
            self.channel_state = d.last_status["state"]
            write_status(d.status_path, d.last_status)
        if final:
            self.leave()
            return
        self.round(now)
        if self.new_claims():
            d._check_claims()

    def stays(self, now: float) -> bool:
        """Whether the observer stays after its trainer is done: an aggregator (up to three lingers) while its
        node's other ranks are still watched (its summary is their voice); the root while some rank's last
        word is not final (a silent node is judged only once its silence lasted). A SIGTERM (Observer.stop)
        ends it at once."""
        d = self.d
        if not self.aggregator or d._stop or d.gone_since is None:
            return False
        return now - d.gone_since < 3 * d.cfg["linger_s"] and (
            self.node_alive(now) or (self.root and self.unsettled) or self.lost_pending()
        )

    def lost_pending(self) -> bool:
        """The root's store stopped answering and this survivor has not recorded it yet (observer/root_lost.py)."""
        return not self.root and self.heard_root and self.lost_since is not None and not self.lost_recorded

    def new_claims(self) -> bool:
        """The node-local claims counter moved since the last call (an incident was published somewhere)."""
        try:
            gen = (self.local / CLAIMS_GEN).read_text()
        except FileNotFoundError:
            return False
        if gen == self.local_gen:
            return False
        self.local_gen = gen
        return True

    def leave(self) -> None:
        """At exit: the aggregator, once no other observer of its node runs, removes the node-local folder (the
        final statuses are in ROOT's channel). The others leave their last word for it to read."""
        if not self.aggregator or self.node_alive(time.monotonic()):
            return
        for p in sorted(self.local.glob("*")) + sorted(self.local.glob(".*")):
            try:
                p.unlink()
            except OSError:
                pass
        try:
            self.local.rmdir()
        except OSError:
            pass

    # ---- the aggregator ---------------------------------------------------------------------------------------

    def node_alive(self, now: float) -> bool:
        """Another rank of this node still has a live observer and a trainer that is not done: the aggregator
        stays to speak for it."""
        for r in range(self.first, self.last + 1):
            if r == self.d.rank:
                continue
            row = self.d.read_row(r, now, self.status_path(r))
            if row is not None and row["live"] and row["state"] in ("running", "stopped"):
                return True
        return False

    def round(self, now: float) -> None:
        if not self.aggregator:
            return
        rows = {}
        for r in range(self.first, self.last + 1):
            row = self.d.read_row(r, now, self.status_path(r))
            if row is not None:
                rows[r] = row
        for ev in self.stragglers.update(now, rows) if self.stragglers is not None else ():
            key = f"straggler-r{ev['ranks'][0]}-s{ev['step']}"
            ev["detail"]["node"] = self.node
            self.d.incidents.publish("straggler", ev["ranks"], ev["step"], ev["detail"], key, rows)
        pace = self.stragglers.pace() if self.stragglers is not None else None
        summary = ns.summarize(self.node, self.d.host, self.first, self.last, self.d.beat, rows, self.d.stall_s, pace)
        try:
            # the root talks to its own store (a thread of its own process); any other aggregator's calls reach
            # another host's, and are bounded (store_transport.Bounded)
            gen = self._talk(now, summary) if self.root else self.bounded(lambda: self._talk(now, summary))
        except Exception as e:  # the store unreachable: could not check, never a verdict (module docstring)
            if not self._failing:  # before the first answer the root may still be starting: no warning yet
                log.log(
                    logging.WARNING if self.heard_root else logging.INFO,
                    "hierarchy: the root's store at %s:%s %s: %s: %s",
                    self.h["addr"],
                    self.h["port"],
                    "failed" if self.heard_root else "does not answer yet",
                    type(e).__name__,
                    e,
                )
            self._failing = True
            if self.lost_since is None:
                self.lost_since = now
            self.record_root_lost(now, rows)
            return
        self._failing = False
        self.heard_root, self.lost_since = True, None
        if gen != self.claims_seen:
            self.claims_seen = gen
            tmp = self.local / f".{CLAIMS_GEN}.tmp"
            tmp.write_text(str(gen))
            os.replace(tmp, self.local / CLAIMS_GEN)

    def _talk(self, now: float, summary: dict) -> int:
        """This round's store calls: the node's summary (and its group's merge) out, the root's judgement, the
        claims counter in."""
        if self.transport is None:
            from scout_ckpt.observer.store_transport import StoreTransport

            self.transport = StoreTransport(
                self.h["addr"], self.h["port"], serve=self.root, timeout_s=self.store_timeout_s
            )
        t = self.transport
        t.publish(hier.node_key(self.node), summary)
        if self.leads is not None:
            t.publish(
                hier.group_key(self.leads),
                hier.leader_round(self.groups[self.leads], t.read, self.beats, now, self.d.beat),
            )
        if self.root:
            job = hier.root_round(self.groups, t.read, self.beats, now)
            self.unsettled = any(f[0] in ("running", "stopped") for f, _ in job["groups"])
            self.judge(now, job)
            self.judge_pace(job)
        return t.claims()

    def record_root_lost(self, now: float, rows: dict) -> None:
        """Once the store has been silent for the live timeout times this node's number (the lowest surviving
        node first), record what this survivor can judge (observer/root_lost.py), once, through ROOT's claims."""
        d = self.d
        since = self.lost_since
        if since is None or not self.lost_pending() or now - since < d.live_timeout_s * max(self.node, 1):
            return
        from scout_ckpt.observer import root_lost

        lws = self.last - self.first + 1
        own = ns.summarize(self.node, d.host, self.first, self.last, d.beat, rows, d.stall_s)
        got = root_lost.judge(own, (0, lws - 1), now - since, d.world, d.stall_s)
        self.lost_recorded = True
        key = f"root-lost-{got['kind']}"
        d.incidents.publish(got["kind"], got["ranks"], got["step"], got["detail"], key, rows)

    # ---- the root ---------------------------------------------------------------------------------------------

    def judge_pace(self, job: dict) -> None:
        """Nodes slow as a whole (observer/node_pace.py), named with their node's ranks."""
        for ev in self.node_pace.update(job) if self.node_pace is not None else ():
            key = f"straggler-n{ev['detail']['node']}-s{ev['step']}"
            table = {
                k: {**{f: v for f, v in row.items() if f not in ("ranks", "n")}, "rank": spans(row["ranks"])}
                for k, row in ns.to_rows(job, self.d.stall_s).items()
            }
            if self.d.incidents.publish("straggler", ev["ranks"], ev["step"], ev["detail"], key, table):
                self.transport.bump_claims()

    def judge(self, now: float, job: dict) -> None:
        d = self.d
        verdict = ns.judge(job, d.world, d.stall_s)
        if verdict is None:
            d.pending.clear()
            return
        rows = ns.to_rows(job, d.stall_s)
        due = d.due(verdict, rows, now)
        if due is None:
            return
        key, first = due
        extra = job.get("extra", {})
        fresh = {r: extra[str(r)]["stacks"] for r in verdict["ranks"] if str(r) in extra}
        running = {r for k, row in rows.items() if row["state"] == "running" for r in row["ranks"]}
        stopped = {r for k, row in rows.items() if row["state"] == "stopped" for r in row["ranks"]}
        alive = running | stopped  # a stopped rank's observer records why it has no dump: waited for as a dump is
        needs = [r for r in verdict["ranks"] if r in alive and r not in fresh]
        if needs and verdict["kind"] != "crash" and now - first < d.stacks_wait_s and len(needs) < 64:
            return
        stacks = stacks_mod.collect(
            verdict["ranks"][:64],
            fresh,
            lambda r: r not in alive,
            "process is gone or silent",
            d.channel,
            stopped=stopped.__contains__,
        )
        detail = stacks_mod.incident_detail(verdict, stacks, d.stall_s, d.cfg["action"])
        detail["hierarchy"] = {"nodes": len(job["nodes"]), "silent": job.get("silent", {})}
        for rank in verdict["ranks"][:1]:
            where = ns.node_of(job, rank)
            if where is not None:
                detail["node_rank"], detail["host"] = where
        if verdict.get("nodes_silent"):
            detail["nodes_silent"] = verdict["nodes_silent"]
        table = {
            k: {**{f: v for f, v in row.items() if f not in ("ranks", "n")}, "rank": spans(row["ranks"])}
            for k, row in rows.items()
        }
        if d.incidents.publish(verdict["kind"], verdict["ranks"], verdict["step"], detail, key, table):
            self.transport.bump_claims()
        d.pending.clear()
