"""C3: strict-majority verdicts over replicas.

Over N peers' values: all equal -> AGREE; one value held by a strict majority (more than N/2 peers) -> every other
peer ATTRIBUTED; otherwise INCONCLUSIVE. Two peers that differ can be detected but never attributed (1 of 2 is no
majority). INCONCLUSIVE blocks certification just like ATTRIBUTED.

`c3_verdict` is pure. `c3_over_group` all-gathers a batch of signatures over a (gloo) process group in one
collective and applies `c3_verdict` to each tensor; every member computes the same verdict from the same gathered
data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

AGREE, ATTRIBUTED, INCONCLUSIVE = "agree", "attributed", "inconclusive"


@dataclass(frozen=True)
class C3Result:
    status: str  # agree | attributed | inconclusive
    attributed: tuple[int, ...] = ()  # indices of the peers that differ from the majority
    majority: Any = None  # the value held by a strict majority (None if there is none)
    evidence: tuple[str, ...] = ()  # what was seen, in order, for a person
    classes: tuple[tuple[int, ...], ...] = ()  # peers grouped by equal value, in order of first appearance


def _key(v: Any) -> Any:
    """A hashable stand-in for a value: tensors and lists compare by content."""
    if hasattr(v, "tolist") and callable(v.tolist):
        v = v.tolist()
    if isinstance(v, (list, tuple)):
        return tuple(_key(x) for x in v)
    return v


def c3_verdict(values: Sequence[Any]) -> C3Result:
    """Verdict over one value per peer (peer i holds values[i])."""
    n = len(values)
    if n == 0:
        raise ValueError("c3_verdict needs at least one peer")
    classes: dict[Any, list[int]] = {}
    for i, v in enumerate(values):
        classes.setdefault(_key(v), []).append(i)
    return _decide(tuple(tuple(peers) for peers in classes.values()), n, lambda i: values[i])


def c3_of_classes(classes: Sequence[tuple[Any, Sequence[int]]], n: int) -> C3Result:
    """`c3_verdict` from the peers grouped by value: [(value, peer indices)], the values distinct, every peer of
    range(n) in exactly one class. The same result as `c3_verdict` over the list those classes spell out (a
    per-node exchange sends the classes, not one value per peer: consensus/node_exchange.py)."""
    if n == 0:
        raise ValueError("c3_of_classes needs at least one peer")
    ordered = sorted(((tuple(sorted(p)), v) for v, p in classes if p), key=lambda pv: pv[0][0])
    if sum(len(p) for p, _ in ordered) != n:
        raise ValueError(f"classes hold {sum(len(p) for p, _ in ordered)} peers, not {n}")
    value_of = {p[0]: v for p, v in ordered}
    groups = tuple(p for p, _ in ordered)
    return _decide(groups, n, lambda i: value_of[i])


def _decide(groups: tuple[tuple[int, ...], ...], n: int, value_of) -> C3Result:
    """The verdict over peers grouped by equal value (classes in order of first appearance, peers ascending);
    `value_of(i)` the value of the class whose first peer is i."""
    if len(groups) == 1:
        return C3Result(AGREE, (), value_of(0), (f"all {n} peers hold the same value",), groups)
    evidence = [f"{n} peers hold {len(groups)} distinct values"]
    evidence += [f"value #{j} held by peers {list(peers)}" for j, peers in enumerate(groups)]
    largest = max(groups, key=len)  # first-appearing on ties: deterministic
    if 2 * len(largest) > n:
        odd = tuple(sorted(i for peers in groups if peers is not largest for i in peers))
        evidence.append(
            f"peers {list(largest)} are a strict majority ({len(largest)} of {n} > {n / 2:g}); attributed: {list(odd)}"
        )
        return C3Result(ATTRIBUTED, odd, value_of(largest[0]), tuple(evidence), groups)
    evidence.append(
        f"no value is held by a strict majority (largest: {len(largest)} of {n}, "
        f"needs > {n / 2:g}): the odd peer cannot be named"
    )
    return C3Result(INCONCLUSIVE, (), None, tuple(evidence), groups)


@dataclass
class GroupVerdict:
    """C3 over one replica group for a batch of tensors. Identical on every member."""

    status: str  # agree | attributed | inconclusive (overall)
    group_ranks: list[int]  # global ranks of the members, in group-rank order
    per_tensor: list[C3Result]  # one per tensor of the batch
    attributed_ranks: list[int] = field(default_factory=list)  # global ranks attributed on some tensor
    attributed_bitmap: int = 0  # bit p set: member p (group rank p) attributed
    disagreeing: list[int] = field(default_factory=list)  # indices of tensors whose peers differ
    disagreeing_names: list[str] = field(default_factory=list)
    attributed_tensors: list[str] = field(default_factory=list)  # names of tensors with an ATTRIBUTED verdict
    inconclusive_tensors: list[str] = field(default_factory=list)  # names of tensors with an INCONCLUSIVE one

    def to_dict(self) -> dict:
        return {
            "status": self.status,
            "members": list(self.group_ranks),
            "attributed": list(self.attributed_ranks),
            "attributed_bitmap": self.attributed_bitmap,
            "disagreeing": list(self.disagreeing_names),
            "attributed_tensors": list(self.attributed_tensors),
            "inconclusive_tensors": list(self.inconclusive_tensors),
        }


def combine(per_tensor: list[C3Result], group_ranks: Sequence[int], names: Sequence[str] | None = None) -> GroupVerdict:
    """Overall verdict of a group from its per-tensor verdicts: ATTRIBUTED if any tensor names an odd peer (a
    proven fault; the union of attributed peers), else INCONCLUSIVE if any tensor disagrees, else AGREE."""
    names = list(names) if names is not None else [str(i) for i in range(len(per_tensor))]
    disagreeing = [i for i, r in enumerate(per_tensor) if r.status != AGREE]
    attributed_peers = sorted({p for r in per_tensor for p in r.attributed})
    gv = GroupVerdict(
        status=AGREE,
        group_ranks=list(group_ranks),
        per_tensor=per_tensor,
        attributed_ranks=[group_ranks[p] for p in attributed_peers],
        attributed_bitmap=sum(1 << p for p in attributed_peers),
        disagreeing=disagreeing,
        disagreeing_names=[names[i] for i in disagreeing],
        attributed_tensors=[names[i] for i in disagreeing if per_tensor[i].status == ATTRIBUTED],
        inconclusive_tensors=[names[i] for i in disagreeing if per_tensor[i].status == INCONCLUSIVE],
    )
    if gv.attributed_tensors:
        gv.status = ATTRIBUTED
    elif gv.inconclusive_tensors:
        gv.status = INCONCLUSIVE
    return gv


def verdicts_from_gathered(gathered, group_ranks: Sequence[int], names: Sequence[str] | None = None) -> GroupVerdict:
    """Per-tensor and overall verdicts from gathered signatures [members, n, 2] (a CPU tensor)."""
    members, n = gathered.shape[0], gathered.shape[1]
    if members != len(group_ranks):
        raise ValueError(f"{members} gathered rows for {len(group_ranks)} members")
    if names is not None and len(names) != n:
        raise ValueError(f"{len(names)} names for {n} signatures")
    equal = (gathered == gathered[0:1]).all(dim=2).all(dim=0).tolist() if n else []
    per_tensor: list[C3Result] = []
    for i in range(n):
        if equal[i]:
            per_tensor.append(
                C3Result(
                    AGREE,
                    (),
                    tuple(gathered[0, i].tolist()),
                    (f"all {members} peers hold the same value",),
                    (tuple(range(members)),),
                )
            )
        else:
            per_tensor.append(c3_verdict([tuple(row) for row in gathered[:, i].tolist()]))
    return combine(per_tensor, group_ranks, names)


def verdicts_from_classes(
    rows: Sequence[Any], peers: Sequence[Sequence[int]], group_ranks: Sequence[int], names: Sequence[str] | None = None
) -> GroupVerdict:
    """`verdicts_from_gathered` where the members come in classes: class j's members (indices into group_ranks)
    `peers[j]` all hold the [n, 2] signatures `rows[j]` (a CPU tensor). The same verdicts as over the gathered
    [members, n, 2] those classes spell out, without building it (at 10^5 members it would be n x 1.6 MB)."""
    members = len(group_ranks)
    if len(rows) != len(peers) or not rows:
        raise ValueError(f"{len(rows)} signature batches for {len(peers)} classes")
    n = rows[0].shape[0]
    if names is not None and len(names) != n:
        raise ValueError(f"{len(names)} names for {n} signatures")
    values = [r.tolist() for r in rows]
    per_tensor: list[C3Result] = []
    for i in range(n):
        by_value: dict[tuple, list[int]] = {}
        for v, p in zip(values, peers):
            by_value.setdefault(tuple(v[i]), []).extend(p)
        if len(by_value) == 1:
            per_tensor.append(
                C3Result(
                    AGREE,
                    (),
                    next(iter(by_value)),
                    (f"all {members} peers hold the same value",),
                    (tuple(range(members)),),
                )
            )
        else:
            per_tensor.append(c3_of_classes(list(by_value.items()), members))
    return combine(per_tensor, group_ranks, names)


def c3_over_group(
    sigs, group, group_ranks: Sequence[int] | None = None, names: Sequence[str] | None = None
) -> GroupVerdict:
    """All-gather this rank's [n, 2] int64 signatures over `group` (one collective for the whole batch) and return
    the verdicts. Every member must call it with the same n. `group_ranks` are the members' global ranks in
    group-rank order (torch sorts them); by default they are read from the group. group=None is the default
    group, as in torch.distributed, except that a rank alone (group_ranks of one, or no process group at all)
    agrees with itself without any collective."""
    import torch
    import torch.distributed as dist

    sigs = sigs.detach().to("cpu", torch.int64).contiguous()
    if sigs.dim() != 2 or sigs.shape[1] != 2:
        raise ValueError(f"signatures must have shape [n, 2], got {tuple(sigs.shape)}")
    if not dist.is_initialized() or (group_ranks is not None and len(group_ranks) == 1):
        ranks = list(group_ranks) if group_ranks is not None else [0]
        if len(ranks) != 1:
            raise ValueError("a group of several members needs a process group")
        return verdicts_from_gathered(sigs.unsqueeze(0), ranks, names)
    actual = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    if group_ranks is not None and list(group_ranks) != list(actual):
        raise ValueError(f"group_ranks {list(group_ranks)} differ from the group's members {actual}")
    out = [torch.empty_like(sigs) for _ in actual]
    dist.all_gather(out, sigs, group=group)
    return verdicts_from_gathered(torch.stack(out), actual, names)
