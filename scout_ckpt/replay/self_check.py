"""The self-check round of a sweep: every rank replays its own capture of the save step and compares the replay
with its own live step (replay.live explains the check and its rule).

Why apart from runner.py: the runner moves the source's captures to every peer and compares the peers' replays;
this module is the per-rank side that needs no peer -- which parameters' live gradients a rank can sign at all
(`live_grad_params`, configuration, the same on every rank), the replay of the rank's own capture and its outcome
(`check_own`), and the source's outcome, which is read from its cross replay once that is signed (`settle`): the
source's own capture is the one every peer replays, so its self-check costs no replay of its own. The outcomes
(live.SELF_*) travel in the round's header gather (rows.py), so the round needs no collective for them.
"""

from __future__ import annotations

import warnings

from torch import nn

from scout_ckpt.consensus.signatures import replica_signatures
from scout_ckpt.replay import live as live_step
from scout_ckpt.replay.execute import replay_target

# The source's outcome before its cross replay is signed: read from that replay (`settle`), not replayed again.
SELF_IS_CROSS = -1


def check_own(step: int, target, cap, *, rank: int, src: int, deterministic: bool, optimizer) -> int:
    """This rank's own capture of module `target` replayed on a copy and compared with its own live signatures
    (live.self_check): a live.SELF_* outcome, or SELF_IS_CROSS on the source (`rank == src`), whose replay of the
    same capture is the round's cross replay. Never raises: a replay that fails leaves the rank unchecked (a
    rank that cannot replay must still reach the round's collectives, and "could not check" is not a fault)."""
    inv = getattr(cap, "invocation", None)
    if inv is None or inv.live is None or not inv.intact() or not inv.params:
        return live_step.SELF_UNCHECKED
    if rank == src:
        return SELF_IS_CROSS
    try:
        labels, tensors = replay_target(target[0], cap, inv, deterministic, optimizer)
        return live_step.self_check(labels, replica_signatures(tensors), inv)
    except Exception as e:  # noqa: BLE001 -- not checked, never a failed step
        warnings.warn(f"self-check replay of {target[1]} at step {step} failed on rank {rank}: {e!r}")
        return live_step.SELF_UNCHECKED


def settle(work: list, results: list[list], selfc: list[int]) -> None:
    """The source's outcomes (SELF_IS_CROSS in `selfc`) from its cross replays, now signed: `results[k]` holds
    target k's [labels, signatures, ...] (rows.py), `work[k]` its (index, target, capture)."""
    for k, (_, _, cap) in enumerate(work):
        if selfc[k] == SELF_IS_CROSS:
            labels, sigs = results[k][0], results[k][1]
            selfc[k] = (
                live_step.self_check(labels, sigs, cap.invocation) if sigs is not None else live_step.SELF_UNCHECKED
            )


def live_grad_params(model: nn.Module, sites: dict) -> tuple[dict[str, frozenset], dict[str, list[str]]]:
    """Per module target: the parameters whose live gradient the self-check signs (capture.py), and what it does
    not sign, and why (the same on every rank: configuration). Not signed: a parameter sharded as a DTensor
    (FSDP2: its gradient is reduce-scattered from an unsharded copy), one that a module outside the target also
    holds (tied weights: its gradient sums both uses)."""
    owners: dict[int, set[int]] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(id(m))
    signed: dict[str, frozenset] = {}
    notes: dict[str, list[str]] = {}
    for name, site in sites.items():
        inside = {id(m) for m in site.inner.modules()}
        names, sharded, tied = set(), [], []
        for n, p in site.inner.named_parameters():
            if hasattr(p, "full_tensor"):
                sharded.append(n)
            elif owners.get(id(p), set()) - inside:
                tied.append(n)
            else:
                names.add(n)
        signed[name] = frozenset(names)
        why = []
        if sharded:
            why.append(
                f"{len(sharded)} sharded parameters' gradients (DTensor/FSDP2: reduce-scattered from an unsharded copy)"
            )
        if tied:
            why.append(f"gradients of parameters shared with a module outside the target: {', '.join(tied[:4])}")
        notes[name] = why
    return signed, notes


__all__ = ["SELF_IS_CROSS", "check_own", "live_grad_params", "settle"]
