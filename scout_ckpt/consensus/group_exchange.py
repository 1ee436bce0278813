"""One replica group's flat exchange at a save: a fixed-size header per member, all-gathered over the group.

The header (`header`: [7] int64) is a structure digest (so that replicas whose state has different keys, shapes,
dtypes or layouts are caught and the signature batches are known to line up), a 128-bit digest of the member's
[n, 2] signature rows, the time it took and its covers flag. `group_verdict` all-gathers it over the group and
decides (`verdict_of_headers`): the structures differ -> C3 over the structures; every signature digest equal ->
every piece agrees; otherwise the signatures themselves are gathered for per-tensor verdicts. On several nodes
the same headers go through the node aggregators instead (node_exchange.py), and `broadcaster` sends a class's
signature rows to the group where they differ. save_time.py runs both.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from scout_ckpt.consensus import node_exchange as nx
from scout_ckpt.consensus.c3 import GroupVerdict, c3_over_group, c3_verdict, combine, verdicts_from_gathered
from scout_ckpt.consensus.signatures import bytes_signature

STRUCTURE = nx.STRUCTURE_NAME


def leaf_kind(leaf: Any) -> str:
    return f"{leaf.dtype}{tuple(leaf.shape)}" if isinstance(leaf, torch.Tensor) else "bytes"


def structure_digest(names: list[str], flat: Mapping[str, Any], tags: Sequence[str] = ()) -> torch.Tensor:
    """[3] int64: entry count and a 128-bit digest of the names, dtypes and shapes (bytes leaves: their kind),
    and of `tags` (the layouts of the pieces compared elsewhere)."""
    blob = "".join(f"{n}\0{leaf_kind(flat[n])}\0" for n in names) + "".join(f"{t}\0" for t in tags)
    return torch.cat([torch.tensor([len(names)], dtype=torch.int64), bytes_signature(blob.encode())])


def header(
    flat: Mapping[str, Any], names: list[str], sigs: torch.Tensor, elapsed: float, tags: Sequence[str], covers: bool
) -> torch.Tensor:
    """[7] int64: structure digest (3), a 128-bit digest of the [n, 2] signature rows (2), the time taken (a
    float64's bits) and the covers flag."""
    return torch.cat(
        [
            structure_digest(names, flat, tags),
            bytes_signature(sigs.numpy().tobytes()),
            torch.tensor([elapsed], dtype=torch.float64).view(torch.int64),
            torch.tensor([int(covers)], dtype=torch.int64),
        ]
    )


def group_verdict(
    flat: Mapping[str, Any],
    names: list[str],
    pg,
    members: list[int],
    sigs: torch.Tensor,
    elapsed: float,
    tags: Sequence[str] = (),
    covers: bool = False,
) -> tuple[GroupVerdict, float, bool, bool]:
    """(verdict of one replica group, the slowest member's time to its signatures, whether the members' structure
    agreed, whether every member `covers` its whole state); identical on every member. One all_gather of a
    fixed-size header (structure digest, a 128-bit digest of the [n, 2] signature rows, the time taken, the covers
    flag) decides the healthy case; only when the signature digests differ are the signatures themselves gathered,
    for per-tensor verdicts."""
    mine = header(flat, names, sigs, elapsed, tags, covers)
    rows = [torch.empty_like(mine) for _ in members]
    dist.all_gather(rows, mine, group=pg)
    return verdict_of_headers(rows, members, names, sigs, lambda: c3_over_group(sigs, pg, members, names))


def verdict_of_headers(
    rows: list[torch.Tensor],
    members: list[int],
    names: list[str],
    sigs: torch.Tensor,
    per_tensor: Callable[[], GroupVerdict],
) -> tuple[GroupVerdict, float, bool, bool]:
    """`group_verdict` from every member's header (rows, in member order); `per_tensor()` gathers the
    signatures and gives the per-tensor verdict, called only when the signature digests differ."""
    slowest = max(float(r[5:6].view(torch.float64)) for r in rows)
    everyone_covers = all(int(r[6]) == 1 for r in rows)
    if any(not torch.equal(r[:3], rows[0][:3]) for r in rows):
        return (
            combine([c3_verdict([tuple(r[:3].tolist()) for r in rows])], members, [STRUCTURE]),
            slowest,
            False,
            everyone_covers,
        )
    if all(torch.equal(r[3:5], rows[0][3:5]) for r in rows):  # every member holds the same signatures
        return (
            verdicts_from_gathered(sigs.unsqueeze(0).expand(len(rows), -1, -1), members, names),
            slowest,
            True,
            everyone_covers,
        )
    return per_tensor(), slowest, True, everyone_covers


def broadcaster(sigs: torch.Tensor, pg) -> Callable[[int], torch.Tensor]:
    """node_exchange.verdict's `fetch`: the signature rows of a class's lowest rank, broadcast over the group."""

    def fetch(source: int) -> torch.Tensor:
        batch = sigs.clone() if source == dist.get_rank() else torch.empty_like(sigs)
        dist.broadcast(batch, src=source, group=pg)
        return batch

    return fetch
