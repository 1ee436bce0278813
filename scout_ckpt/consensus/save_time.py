"""Consensus at a save boundary: do all replicas of the same state hold the same bits?

Each piece of state is compared within its replica group (`mesh.py`: the ranks that hold the same bits, from the
DeviceMesh and the piece's placements): a DTensor's local shard across the mesh dims it is replicated along (its
replicate peers hold the same shard), plain state (DDP parameters, step counters, scalars) across the world. C3
runs per replica group and the verdicts of all groups are gathered to every rank over the world gloo group, so the
evidence returned is identical on every rank. Collective over all ranks; call it before the DCP write.

Signatures are replica signatures (`replica_signatures`): xxh3-128 of a CPU tensor's bytes, the additive torch-op
signature on device for an accelerator tensor. Replicas are compared with each other at the same moment on the
same device type, so additivity is not needed here (full_signatures keeps it for resharded loads).

Two halves (`start_consensus`, then `PendingConsensus.finish`): the hashing, local, then the exchange; with
`background` both run in a thread of their own (the Checkpointer overlaps them with DCP's write, of the live state
in a sync save, of the staged copy in an async save's commit thread), and the tensors this rank writes are signed
by the writer as it writes them (`in_flight.py`: one pass over their bytes for the file digest and the signature). The replica rows of plain state double as
the load-verification signatures (`replica_rows` -> `full_signatures(known=...)`), so each replicated byte is
hashed once per rank; where every rank hashed every leaf (`full_rows`), those signatures need no collective.

Collectives, per set of compare dims (the topology's order, the same on every rank), over this rank's group for
it (group_exchange.py): one tiny all_gather of a fixed-size header: a structure digest (so that replicas whose state has different
keys, shapes, dtypes or layouts are caught and the signature batches are known to line up), a 128-bit digest of
the [n, 2] signatures and the time taken. When all members' digests are equal (the healthy case) every piece
AGREEs and nothing more is exchanged within the group; otherwise one all_gather of the [n, 2] signatures gives
per-tensor verdicts. Then one all_gather_object of the small group verdicts over the world group, except where the
only group is the world (DDP): every rank already holds the only verdict. A healthy DDP save thus costs one
collective of 56 bytes per rank. A group that times out raises (gloo's timeout of `ConsensusGroups`).

On a multi-node torchrun job (`ConsensusGroups.nodes`) the headers and the group verdicts go through each node's
aggregator and the coordinator instead (node_exchange.py), with the same decisions: what one process receives then
grows with the node count, not the rank count.

Non-tensor leaves are compared by their canonical encoding (canonical.py: sets sorted, floats by bits, ...); a leaf
that has none is not compared: it is listed in the evidence (`not_comparable`: key and why, `n_not_comparable`)
and changes no status, as a key left out by `consensus_exclude` does. Its bytes are still covered by the file
digests.

What the status means: `fail` some group ATTRIBUTED; `inconclusive` some group disagreed without a strict
majority; `missing` a piece's layout could not be determined (`consensus_layout_unknown`) or nothing at all was
compared (`consensus_nothing_compared`: everything excluded, or only single-owner shards): no evidence, never a
pass; `not_applicable` everything compared agreed but some pieces have no replica anywhere (FSDP shards, TP shards
under FSDP: `no_replicas`), so only invariants can vouch for them; `pass` every piece was compared and agreed.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping

import torch
import torch.distributed as dist

from scout_ckpt.consensus import node_exchange as nx
from scout_ckpt.consensus.c3 import (
    ATTRIBUTED,
    INCONCLUSIVE,
)
from scout_ckpt.consensus.canonical import NotComparable
from scout_ckpt.consensus.full import shard_partials
from scout_ckpt.consensus.group_exchange import (  # noqa: F401  (STRUCTURE, structure_digest: this module's names too)
    STRUCTURE,
    broadcaster,
    group_verdict,
    header,
    leaf_kind,
    structure_digest,
)
from scout_ckpt.consensus.groups import ConsensusGroups
from scout_ckpt.consensus.in_flight import InFlightDigests
from scout_ckpt.consensus.mesh import LayoutError, dtensor_dims_cached, is_dtensor
from scout_ckpt.consensus.signatures import digest_row, flatten_state, replica_signatures
from scout_ckpt.policy import FAIL, MISSING, NOT_APPLICABLE, PASS, evidence
from scout_ckpt.policy import INCONCLUSIVE as EV_INCONCLUSIVE

MAX_NAMES = 8  # tensor names listed per reason
GATE_S = 60.0  # the longest background hashing waits for the write to start: a write never started only
WRITE_S = 600.0  # delays it; nor does a write that outlasts WRITE_S (its tensors are then hashed here)


def _select(flat: Mapping[str, Any], names_filter: Callable[[str], bool] | Collection[str] | None) -> list[str]:
    if names_filter is None:
        keep = flat
    elif callable(names_filter):
        keep = [n for n in flat if names_filter(n)]
    else:
        wanted = set(names_filter)
        keep = [n for n in flat if n in wanted]
    return sorted(keep)


@dataclass
class _Plan:
    """Where each selected piece of state goes: compared across some dims, single-owner, or a problem."""

    by_dims: dict = field(default_factory=dict)  # compare dims -> names
    single: list[str] = field(default_factory=list)  # no replica anywhere
    problems: list[tuple[str, str]] = field(default_factory=list)  # (name, why its layout is unknown)
    tags: list[str] = field(default_factory=list)  # name + layout of every piece not compared as plain state
    not_comparable: list[tuple[str, str]] = field(default_factory=list)  # (name, why): no canonical encoding


def _plan(flat: Mapping[str, Any], names: list[str], groups: ConsensusGroups) -> _Plan:
    grid = groups.grid
    plain = grid.plain_dims
    plan = _Plan()
    # every plain leaf goes where `plain` goes: decided once, not per leaf (hundreds of leaves a save)
    plain_single = grid.group_size(plain) < 2
    plain_known = groups.kind_of(plain) is not None
    plain_names = plan.by_dims.setdefault(plain, []) if not plain_single and plain_known else None
    for n in names:
        leaf = flat[n]
        if isinstance(leaf, NotComparable):
            # a value without a canonical encoding (canonical.py): left out, said so in the evidence, never an SDC;
            # its name still goes into the structure digest, so replicas that disagree on it are seen
            plan.not_comparable.append((n, leaf.why))
            plan.tags.append(f"{n}\0not_comparable")
            continue
        if is_dtensor(leaf):
            try:
                dims = dtensor_dims_cached(leaf, grid, groups.layouts)
            except LayoutError as e:
                plan.problems.append((n, str(e)))
                plan.tags.append(f"{n}\0problem")
                continue
        elif plain_names is not None:
            plain_names.append(n)
            continue
        else:
            dims = plain
        if grid.group_size(dims) < 2:
            plan.single.append(n)
        elif groups.kind_of(dims) is None:
            plan.problems.append(
                (
                    n,
                    f"compared across {grid.dim_names(dims)}, a layout the topology does not "
                    "list (no side group was made for it at start-up)",
                )
            )
        else:
            plan.by_dims.setdefault(dims, []).append(n)
        if dims != plain:
            plan.tags.append(f"{n}\0{leaf_kind(leaf)}\0{grid.dim_names(dims)}")
    if plain_names is not None and not plain_names:
        del plan.by_dims[plain]  # as before: a dims entry only where some piece goes
    return plan


def _hash_groups(
    flat: Mapping[str, Any], plan: _Plan, groups: ConsensusGroups, t0: float, in_flight: InFlightDigests | None = None
) -> tuple[dict, float]:
    """({kind index: [n, 2] replica signatures of the names compared in that kind}, seconds since t0): the only
    pass over the state's bytes. No collective, so it may run in a background thread; with `in_flight` it first
    waits for the writer's CPU-bound part to end (at most GATE_S), leaves the tensors the writer signs to it, and
    hashes itself any that the writer did not deliver."""
    if in_flight is not None:
        in_flight.cpu_free(GATE_S)
    sigs, deferred = {}, []
    for index, kind in enumerate(groups.kinds):
        if len(kind.members) < 2:
            continue
        items = [flat[n] for n in plan.by_dims.get(kind.dims, [])]
        later = {i for i, x in enumerate(items) if in_flight.expects(x)} if in_flight is not None else set()
        rows = torch.zeros(len(items), 2, dtype=torch.int64)
        now = [i for i in range(len(items)) if i not in later]
        if now:
            rows[now] = replica_signatures([items[i] for i in now])
        deferred += [(rows, i, items[i]) for i in sorted(later)]
        sigs[index] = rows
    if deferred:
        # set when the writer returns or fails (the caller's `release` too); past WRITE_S (a write still going)
        # the rest is hashed here: the state is held either way, so the signatures are the same
        in_flight.done.wait(WRITE_S)
        missing = []
        for rows, i, item in deferred:
            digest = in_flight.take(item)
            if digest is None:
                missing.append((rows, i, item))
            else:
                rows[i] = torch.tensor(digest_row(digest), dtype=torch.int64)
        if missing:
            for (rows, i, _), row in zip(missing, replica_signatures([item for _, _, item in missing])):
                rows[i] = row
    return sigs, time.perf_counter() - t0


_HASHER: tuple[int, ThreadPoolExecutor] | None = None


def _hasher() -> ThreadPoolExecutor:
    """One background thread per process for consensus hashing (its own, not signatures' pool, whose threads the
    hashing itself may use); made again in a forked child."""
    global _HASHER
    if _HASHER is None or _HASHER[0] != os.getpid():
        _HASHER = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="scout-consensus"))
    return _HASHER[1]


class PendingConsensus:
    """Save-time consensus in two halves: `start_consensus` plans and hashes (in a background thread with
    `background=True`: xxh3 releases the GIL, so the hashing overlaps DCP's serialization and writing), `finish`
    exchanges and decides (collective). The state must not change in between (a sync save holds the training
    thread; an async save hashes its staged copy)."""

    def __init__(self, flat, names, plan, groups, t0, work, *, source=None, partials: Future | None = None):
        self._flat, self._names, self._plan, self._groups, self._t0 = flat, names, plan, groups, t0
        self._source = source  # the state dict `flat` was flattened from (None: not reusable, `flattened`)
        self._work = work  # a Future or the (sigs, elapsed) pair itself
        self._exchanged: Future | None = None  # background: the exchange, queued behind the hashing
        self._partials = partials  # background: this rank's DTensor partial signatures (full.py)
        # Local: every leaf of the state is plain and compared as plain state, so replica_rows() holds a signature
        # of every leaf. `everyone_covers` (after finish) says it holds on every rank.
        plain = groups.grid.plain_dims if groups.world_size >= 2 else None
        self._covers = (
            groups.world_size >= 2
            and len(names) == len(flat)
            and not plan.problems
            and not plan.single
            and len(plan.by_dims.get(plain, [])) == len(names)
            and not any(is_dtensor(v) for v in flat.values())
        )
        self.everyone_covers = False

    def flattened(self, state_dict) -> dict | None:
        """`flatten_state(state_dict, keep_dtensor=True)` as this consensus took it, when `state_dict` is the very
        object it was started with (held unchanged until the save ends), else None. A save's load signatures
        reuse it: flattening walks every leaf and encodes every non-tensor one, a few ms a save on a loaded host."""
        return self._flat if self._source is not None and state_dict is self._source else None

    def shard_partials(self) -> dict[str, torch.Tensor]:
        """{key: [2] partial signature} of this rank's DTensor leaves, computed in the hashing thread during the
        write (`full.shard_partials`), for `full_signatures(partials=...)`; {} when none were computed or their
        computation failed (the caller then computes them itself). Waits for them; local."""
        if self._partials is None:
            return {}
        try:
            return self._partials.result()
        except Exception:  # fail closed: full_signatures signs the leaves itself (and raises where they raise)
            return {}

    def keep_partials(self) -> None:
        """The caller signs this state for load verification: later saves' background hashing also computes the
        DTensor partial signatures (ConsensusGroups.sign_partials), off the critical path."""
        self._groups.sign_partials = True

    def _hashed(self) -> tuple[dict, float]:
        return self._work.result() if isinstance(self._work, Future) else self._work

    def full_rows(self) -> dict[str, torch.Tensor] | None:
        """After `finish`: {name: [2] replica signature} of every leaf when every rank's state is plain state
        compared as plain state (`everyone_covers`, the same answer on every rank, from the exchange), else None.
        Then every rank already holds a replica signature of every leaf, and `full_signatures(plain="replica",
        known=..., complete=True)` needs no collective."""
        return self.replica_rows() if self.everyone_covers else None

    def replica_rows(self) -> dict[str, torch.Tensor]:
        """{name: [2] replica signature} of the plain (non-DTensor) state compared as plain state: exactly what
        `full_signatures(plain="replica")` records for such a leaf, so load verification reuses them instead of
        hashing the bytes a second time. Waits for the hashing; local."""
        if self._groups.world_size < 2:
            return {}
        sigs, _ = self._hashed()
        plain = self._groups.grid.plain_dims
        out = {}
        for index, kind in enumerate(self._groups.kinds):
            if kind.dims == plain and index in sigs:
                for n, row in zip(self._plan.by_dims.get(kind.dims, []), sigs[index]):
                    if not is_dtensor(self._flat[n]):
                        out[n] = row
        return out

    def finish(self) -> dict:
        """The evidence (see `save_time_consensus`); collective over all ranks, in the same order everywhere. With
        `start_consensus(background=True)` the exchange already ran (or runs) in the hashing thread: this waits
        for it and re-raises its error."""
        if self._exchanged is not None:
            return self._exchanged.result()
        return self._exchange()

    def _exchange(self) -> dict:
        groups, flat, plan = self._groups, self._flat, self._plan
        if groups.world_size < 2:
            return evidence(
                NOT_APPLICABLE,
                [{"code": "no_replicas", "mode": groups.mode, "detail": "single process"}],
                mode=groups.mode,
                groups=[],
                tensors_compared=0,
                single_owner=0,
                duration_s=0.0,
            )
        sigs, elapsed = self._hashed()
        plain = groups.grid.plain_dims
        per_node = groups.nodes is not None  # a multi-node torchrun job: through the node aggregators
        taking = [(i, k) for i, k in enumerate(groups.kinds) if len(k.members) >= 2]  # the same order everywhere
        tags = {i: plan.tags if k.dims == plain else [] for i, k in taking}
        decided = {}
        if per_node:
            items = [
                (
                    i,
                    k.index,
                    tuple(header(flat, plan.by_dims.get(k.dims, []), sigs[i], elapsed, tags[i], self._covers).tolist()),
                )
                for i, k in taking
            ]
            decided = nx.exchange_headers(groups.nodes, groups.rank, items, groups.world_group)
        entries, structure_ok, covered = [], True, []
        for index, kind in taking:
            mine = plan.by_dims.get(kind.dims, [])
            if per_node:
                decision, slowest, covers = decided[index]
                gv = nx.verdict(decision, mine, kind.members, sigs[index], broadcaster(sigs[index], kind.pg))
                same = decision[0] != nx.STRUCTURE
            else:
                gv, slowest, same, covers = group_verdict(
                    flat, mine, kind.pg, kind.members, sigs[index], elapsed, tags[index], self._covers
                )
            structure_ok = structure_ok and same
            covered.append(covers)
            entries.append(
                {
                    "kind": index,
                    **({"group": kind.index} if per_node else {"members": list(gv.group_ranks)}),
                    "dims": list(kind.names),
                    "verdict": gv.status,
                    "attributed": list(gv.attributed_ranks),
                    "attributed_tensors": gv.attributed_tensors,
                    "inconclusive_tensors": gv.inconclusive_tensors,
                    "tensors_compared": len(gv.per_tensor),
                    "plain": kind.dims == plain,
                    "duration_s": slowest,
                }
            )
        local = {
            "rank": groups.rank,
            "entries": entries,
            "single": plan.single,
            "problems": plan.problems,
            "not_comparable": plan.not_comparable,
            "n_selected": len(self._names),
            "duration_s": max([e["duration_s"] for e in entries], default=elapsed),
        }
        world_only = len(groups.kinds) == 1 and len(groups.kinds[0].members) == groups.world_size
        if world_only:  # DDP: one group of every rank, whose verdict every rank already holds
            if not structure_ok:  # the layouts differ between ranks: report the structure verdict only
                local.update(single=[], problems=[], not_comparable=[])
            everyone: list[Any] = nx.unfold(nx.fold([{**local, "covers": True}]), groups) if per_node else [local]
            self.everyone_covers = bool(covered) and all(covered)  # the world's header said it
        elif per_node:  # the verdicts folded per node, then at the coordinator, and sent back down
            folded = nx.exchange_locals(
                groups.nodes, groups.rank, {**local, "covers": self._covers}, groups.world_group
            )
            everyone = nx.unfold(folded, groups)
            self.everyone_covers = folded["covers"]
        else:
            local["covers"] = self._covers
            everyone = [None] * groups.world_size
            dist.all_gather_object(everyone, local, group=groups.world_group)
            self.everyone_covers = all(e["covers"] for e in everyone)
        out = _summarise(everyone, groups)
        if per_node:
            out["exchange"] = "per_node"  # through the node aggregators (the flat path writes no such key)
        return out


def start_consensus(
    state_dict: Mapping,
    groups: ConsensusGroups,
    *,
    names_filter: Callable[[str], bool] | Collection[str] | None = None,
    background: bool = False,
    in_flight: InFlightDigests | None = None,
) -> PendingConsensus:
    """Plan and hash (local, no collective); `finish()` on the result is the collective half. With `background`
    the hashing and then the exchange run in a thread of its own and `finish`/`replica_rows` wait for them; every
    rank must then make no other call on the consensus groups until `finish` returns. `in_flight` (background
    only; consensus/in_flight.py): the hashing starts when the caller's write has started, and the tensors the
    writer signs as it writes them are taken from it; the caller must `release()` it however the write ends."""
    t0 = time.perf_counter()
    if groups.world_size < 2:
        return PendingConsensus({}, [], _Plan(), groups, t0, ({}, 0.0))
    flat = flatten_state(state_dict, keep_dtensor=True)
    names = _select(flat, names_filter)
    plan = _plan(flat, names, groups)
    if not background:
        return PendingConsensus(flat, names, plan, groups, t0, _hash_groups(flat, plan, groups, t0), source=state_dict)
    if in_flight is not None:
        in_flight.want(
            flat[n] for kind in groups.kinds if len(kind.members) >= 2 for n in plan.by_dims.get(kind.dims, [])
        )
    hashing = _hasher().submit(_hash_groups, flat, plan, groups, t0, in_flight)
    # after the hashing, so also once the writer's CPU-bound part is over (the disk's flush, the other ranks'
    # writes and DCP's metadata round leave this rank's CPU idle), and before the exchange, whose collectives
    # wait for the slowest rank anyway
    partials = (
        _hasher().submit(shard_partials, flat)
        if groups.sign_partials and any(is_dtensor(v) for v in flat.values())
        else None
    )
    pending = PendingConsensus(flat, names, plan, groups, t0, hashing, source=state_dict, partials=partials)
    # The exchange follows in the same thread as soon as the hashing is done, so it overlaps DCP's write too. Its
    # collectives are on the consensus groups only, which nothing else uses during a save (replay uses them at
    # step() and before a save's write, never while one is in flight), so the order on every rank is fixed.
    pending._exchanged = _hasher().submit(pending._exchange)
    return pending


def _reasons(entry: dict) -> list[dict]:
    reasons = []
    if entry["attributed_tensors"]:
        reasons.append(
            {
                "code": "consensus_attributed",
                "ranks": entry["attributed"],
                "tensors": entry["attributed_tensors"][:MAX_NAMES],
                "n_tensors": len(entry["attributed_tensors"]),
                "group": entry["members"],
            }
        )
    if entry["inconclusive_tensors"]:
        reasons.append(
            {
                "code": "consensus_inconclusive",
                "ranks": entry["members"],
                "tensors": entry["inconclusive_tensors"][:MAX_NAMES],
                "n_tensors": len(entry["inconclusive_tensors"]),
                "group": entry["members"],
            }
        )
    return reasons


def _problem_reasons(everyone: list[dict], groups: ConsensusGroups) -> list[dict]:
    """Pieces whose layout is unknown, from the topology (the same everywhere) and from every rank's plan."""
    reasons = [
        {"code": "consensus_layout_unknown", **{k: v for k, v in p.items() if k != "code"}} for p in groups.problems
    ]
    ranks = sorted(e["rank"] for e in everyone if e["problems"])
    if ranks:
        names = sorted({n for e in everyone for n, _ in e["problems"]})
        first = next(e["problems"][0][1] for e in everyone if e["problems"])
        reasons.append(
            {
                "code": "consensus_layout_unknown",
                "ranks": ranks,
                "tensors": names[:MAX_NAMES],
                "n_tensors": len(names),
                "detail": first,
            }
        )
    return reasons


def save_time_consensus(
    state_dict: Mapping, groups: ConsensusGroups, *, names_filter: Callable[[str], bool] | Collection[str] | None = None
) -> dict:
    """Consensus evidence, in the policy's format, identical on every rank. Collective over all ranks (every
    rank calls it at the same save, with the same `groups`); a group that times out raises on its members.

    status (see the module docstring): pass | fail ("consensus_attributed": attributed global ranks, the first
    few tensor names, the group) | inconclusive ("consensus_inconclusive": the group's ranks and tensors) | missing
    ("consensus_layout_unknown", "consensus_nothing_compared") | not_applicable ("no_replicas": a single process,
    or pieces without any replica). Detail: "mode", "groups" (per replica group: members, dims, verdict,
    attributed, tensors_compared), "tensors_compared" (summed over groups), "single_owner" (pieces without a
    replica), "plain_state_only" (some pieces have no replica and only plain state was compared), "duration_s"
    (the slowest rank's time to its signatures: flattening and hashing, before the exchange).

    `names_filter` (a predicate on dotted names, or a collection of names) limits what is compared, e.g. to
    leave out state that legitimately differs per rank (per-rank RNG states, rank ids).
    """
    return start_consensus(state_dict, groups, names_filter=names_filter).finish()


def _summarise(everyone: list[dict], groups: ConsensusGroups) -> dict:
    """The evidence from every rank's local result (the same list, in rank order, on every rank)."""
    by_group: dict = {}
    for local in everyone:  # members of a group hold the same verdict; keep the first
        for entry in local["entries"]:
            by_group.setdefault((entry["kind"], tuple(entry["members"])), entry)
    ordered = [
        by_group[(i, tuple(g))] for i, k in enumerate(groups.kinds) for g in k.groups if (i, tuple(g)) in by_group
    ]
    reasons = [r for g in ordered for r in _reasons(g)]
    problems = _problem_reasons(everyone, groups)
    single = sorted({n for e in everyone for n in e["single"]})
    not_comparable = sorted({(n, why) for e in everyone for n, why in e.get("not_comparable") or []})
    compared = sum(g["tensors_compared"] for g in ordered)
    verdicts = {g["verdict"] for g in ordered}
    if ATTRIBUTED in verdicts:
        status = FAIL
    elif INCONCLUSIVE in verdicts:
        status = EV_INCONCLUSIVE
    elif problems:
        status = MISSING
    elif compared == 0:
        status = MISSING
        reasons = [
            {
                "code": "consensus_nothing_compared",
                "n_selected": max(e["n_selected"] for e in everyone),
                "single_owner": len(single),
                "detail": "no piece of state had a replica to compare with (all excluded, or single-owner)",
            }
        ]
    elif single:
        status = NOT_APPLICABLE
        reasons = [
            {"code": "no_replicas", "mode": groups.mode, "tensors": single[:MAX_NAMES], "n_tensors": len(single)}
        ]
    else:
        status = PASS
    return evidence(
        status,
        reasons + problems,
        mode=groups.mode,
        groups=[
            {
                "members": g["members"],
                "dims": g["dims"],
                "verdict": g["verdict"],
                "attributed": g["attributed"],
                "tensors_compared": g["tensors_compared"],
            }
            for g in ordered
        ],
        tensors_compared=compared,
        single_owner=len(single),
        not_comparable=[{"key": n, "why": why} for n, why in not_comparable[:MAX_NAMES]],
        n_not_comparable=len({n for n, _ in not_comparable}),
        plain_state_only=bool(compared and single) and all(g["plain"] or not g["tensors_compared"] for g in ordered),
        duration_s=max(e["duration_s"] for e in everyone),
    )
