"""The live evidence of DeepSpeed's drop-in (integrations.deepspeed): consensus over the state every
data-parallel rank holds whole, the `zero_partitions` evidence of what ZeRO gives one owner alone, and the finite
check of what a rank writes. What each ZeRO stage replicates is in integrations.deepspeed's docstring."""

from __future__ import annotations

import torch

from scout_ckpt import policy
from scout_ckpt.invariants.finite import UncheckableDtype, is_finite

__all__ = ["live", "nonfinite_tensors"]


def live(engine, *, stage: int, unsupported: str | None, groups, world: int, accept_single_owner: bool) -> dict:
    """Collective: consensus over what every rank holds whole (identical evidence on every rank), and the
    `zero_partitions` evidence of what only its owner holds.

    Args:
        engine: the DeepSpeed engine.
        stage: its ZeRO stage.
        unsupported: why the ranks are not data-parallel replicas (consensus is then `topology_unsupported`), or None.
        groups: the consensus groups (None: consensus off).
        world: the world size.
        accept_single_owner: as `install`'s.
    """
    e = engine
    replicated = {
        "counters": {
            "global_steps": int(e.global_steps),
            "global_samples": int(e.global_samples),
            "skipped_steps": int(getattr(e, "skipped_steps", 0)),
        },
        "scheduler": e.lr_scheduler.state_dict() if getattr(e, "lr_scheduler", None) is not None else {},
    }
    single: list[str] = []
    if stage == 0:
        replicated["module"] = e.module.state_dict()
        replicated["optimizer"] = e.optimizer.state_dict() if e.optimizer is not None else {}
    elif stage in (1, 2):
        replicated["module"] = e.module.state_dict()
        single = ["optimizer: Adam moments and fp32 master weights (each rank's partition)"]
    else:
        single = [
            "module: parameters (each rank's partition)",
            "optimizer: Adam moments and fp32 master weights (each rank's partition)",
        ]
    ev = {}
    if unsupported:
        ev["consensus"] = policy.evidence(policy.MISSING, [{"code": "topology_unsupported", "detail": unsupported}])
    elif groups is not None:
        from scout_ckpt.consensus.save_time import save_time_consensus

        ev["consensus"] = save_time_consensus(replicated, groups)
    if single:
        reason = {
            "code": "zero_single_owner",
            "stage": stage,
            "state": single,
            "ranks": list(range(world)),
            "detail": f"ZeRO stage {stage} partitions this state: one rank holds each part, no replica "
            "to compare; bytes and finite checks alone do not vouch for it",
        }
        status = policy.NOT_APPLICABLE if accept_single_owner else policy.MISSING
        ev["zero_partitions"] = policy.evidence(status, [reason], stage=stage, accepted=accept_single_owner)
    else:
        ev["zero_partitions"] = policy.evidence(policy.PASS, [], stage=stage, single_owner=[])
    return ev


def nonfinite_tensors(obj, prefix: str = "") -> list[str]:
    """Dotted names of the tensors in a (nested) state dict that hold a NaN or an infinity (the one finite check);
    a dtype the check cannot decide counts as not finite (fail closed)."""
    out: list[str] = []
    if isinstance(obj, torch.Tensor):
        try:
            ok = is_finite(obj.detach())
        except UncheckableDtype:
            ok = False
        return [] if ok else [prefix or "<tensor>"]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += nonfinite_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += nonfinite_tensors(v, f"{prefix}.{i}" if prefix else str(i))
    return out
