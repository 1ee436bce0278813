"""At-rest check: a local shard must not change between its optimizer step and the save.

Why: with single-owner shards (pure FSDP2) nothing compares a shard with a copy, and an in-memory fault after the
update (a flipped low mantissa bit, a stray write) passes any plausibility bound. The optimizer step is the last
legitimate writer of parameters and optimizer state before a save, so an exact signature (xxh3-128 of the bytes,
`consensus.signatures.replica_signatures`: on the tensor's device for GPU tensors) taken right after the step must
equal the one taken at save time. Cheap: one hashing pass over the local shards per signed step and per save.

Protocol: `AtRestGuard(optimizer, model)` registers an optimizer step post-hook that signs every local shard of
every parameter and every optimizer state tensor (after every `every`-th step; with every=None only after the steps
`arm_next()` marks, which is what ShardEvidence does once it has seen the save cadence). `check(step)` is collective (every rank, at save time, before the bytes are
written): each rank re-signs, the verdicts are gathered on the guard's gloo side group, and every rank returns the
same evidence. A changed tensor is a `fail` naming the rank and the tensor; a save whose preceding step was not
signed (every > 1 off the cadence, or a save right after a resume) is `missing`.

Legitimate writes after the step (a weight projection, an EMA written into the parameters) must call `resign()`
after they are done, or they read as faults.

Frozen parameters (the model's parameters the optimizer does not hold: `requires_grad=False`, LoRA-style base
weights) are saved too, and nothing else vouches for a single-owner shard of one: no update replays it and no
peer holds it. They are signed once, after the first optimizer step this guard sees (training has begun, so the
weights are final) and again after every `resign()` (a load, a legitimate write), and every save checks them
against that signature: a change at any time since, not only between the last step and the save, is
`at_rest_changed` naming the tensor. Buffers are not covered here (running statistics change in every forward).
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from scout_ckpt import policy
from scout_ckpt.consensus.signatures import replica_signatures

KIND = "at_rest"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class AtRestGuard:
    """Signs the local shards after the optimizer step; `check` compares with the shards at save time.

    Construction is collective when `group` is None (it creates a gloo side group: same order on all ranks, at
    start-up). `check` is collective on that group; every rank returns the same evidence dict."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None, *, group=None,
                 every: int | None = 1, include_state: bool = True, timeout_s: float = 300.0):
        """every: sign after every `every`-th optimizer step; None: only after the steps `arm_next` marks (a
        caller that knows which steps saves follow, as ShardEvidence does once it has seen the save cadence)."""
        if every is not None and every < 1:
            raise ValueError("every must be >= 1 or None")
        self.optimizer, self.every, self.include_state = optimizer, every, include_state
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = group if group is not None or not dist.is_initialized() else dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self._steps = 0                                # optimizer steps seen
        self._signed: tuple[int, list[str], torch.Tensor] | None = None   # (steps, names, signatures)
        self._armed = False
        self.cpu_s = 0.0    # CPU seconds spent signing after steps (for the bench)
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self._frozen = [(n, p) for n, p in model.named_parameters() if id(p) not in held] if model is not None else []
        self._frozen_signed: torch.Tensor | None = None
        self._handle = optimizer.register_step_post_hook(self._post)

    def close(self) -> None:
        self._handle.remove()

    def _tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        names, tensors = [], []
        for gi, g in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(g["params"]):
                name = self._names.get(id(p), f"{gi}.{pi}")
                names.append(name)
                tensors.append(_local(p).detach())
                if self.include_state:
                    st = self.optimizer.state.get(p, {})
                    for k in sorted(st):
                        if isinstance(st[k], torch.Tensor):
                            names.append(f"{name}:{k}")
                            tensors.append(_local(st[k]).detach())
        return names, tensors

    def _sign(self) -> tuple[list[str], torch.Tensor]:
        names, tensors = self._tensors()
        return names, replica_signatures(tensors)

    def arm_next(self) -> None:
        """Sign after the next optimizer step whatever `every` says (a caller that knows a save follows it)."""
        self._armed = True

    def _sign_frozen(self) -> None:
        if self._frozen:
            self._frozen_signed = replica_signatures([_local(p).detach() for _, p in self._frozen])

    def _post(self, opt, args, kwargs) -> None:
        self._steps += 1
        if self._frozen_signed is None:
            self._sign_frozen()
        armed, self._armed = self._armed, False
        if armed or (self.every is not None and self._steps % self.every == 0):
            c0 = time.thread_time()
            self._signed = (self._steps, *self._sign())
            self.cpu_s += time.thread_time() - c0
        else:
            self._signed = None

    def resign(self) -> None:
        """Adopt the current shards as the post-step state (after a legitimate write between step and save)."""
        self._signed = (self._steps, *self._sign())
        self._sign_frozen()

    def _frozen_changed(self) -> list[str]:
        if not self._frozen or self._frozen_signed is None:
            return []
        sigs = replica_signatures([_local(p).detach() for _, p in self._frozen])
        diff = (sigs != self._frozen_signed).any(dim=1).nonzero().reshape(-1).tolist()
        return [f"{self._frozen[i][0]} (frozen)" for i in diff]

    def local_check(self) -> dict:
        """This rank's result: {"rank", "status", "changed": [tensor names]}."""
        frozen = self._frozen_changed()
        if self._signed is None or self._signed[0] != self._steps:
            if frozen:
                return {"rank": self.rank, "status": policy.FAIL, "changed": frozen}
            return {"rank": self.rank, "status": policy.MISSING, "changed": []}
        _, names0, sigs0 = self._signed
        names, sigs = self._sign()
        if names != names0 or sigs.shape != sigs0.shape:
            return {"rank": self.rank, "status": policy.FAIL, "changed": ["<set of tensors changed>"]}
        diff = (sigs != sigs0).any(dim=1).nonzero().reshape(-1).tolist()
        changed = [names[i] for i in diff] + frozen
        return {"rank": self.rank, "status": policy.FAIL if changed else policy.PASS, "changed": changed}

    def check(self, step: int) -> dict:
        """Collective at save time (before the write): evidence for the shards saved at `step`, same on every rank."""
        mine = self.local_check()
        if self.group is None:
            every = [mine]
        else:
            every = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(every, mine, group=self.group)
        return at_rest_evidence(every, step)


def at_rest_evidence(results: list[dict], step: int) -> dict:
    """Evidence (policy format) from every rank's `local_check`."""
    failed = [r for r in results if r["status"] == policy.FAIL]
    if failed:
        return policy.evidence(policy.FAIL, [{"code": "at_rest_changed", "ranks": [r["rank"]], "step": step,
                                              "tensors": r["changed"][:16], "n_tensors": len(r["changed"])}
                                             for r in failed], ranks=sorted(r["rank"] for r in failed))
    missing = sorted(r["rank"] for r in results if r["status"] == policy.MISSING)
    if missing:
        return policy.evidence(policy.MISSING, [{"code": "at_rest_unsigned", "ranks": missing, "step": step}])
    return policy.evidence(policy.PASS, [], ranks=sorted(r["rank"] for r in results))


__all__ = ["KIND", "AtRestGuard", "at_rest_evidence"]
