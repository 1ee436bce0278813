"""At-rest check: a local shard must not change between its optimizer step and the save.

Why: with single-owner shards (pure FSDP2) nothing compares a shard with a copy, and an in-memory fault after the
update (a flipped low mantissa bit, a stray write) passes any plausibility bound. The optimizer step is the last
legitimate writer of parameters and optimizer state before a save, so an exact signature (xxh3-64 of the bytes, local_signer.py;
a device tensor's `replica_signatures` row, on the device) taken right after the step must equal the one taken at
save time. Cheap: one hashing pass over the local shards per signed step and per save.

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

Between saves (the interval check). A change between one optimizer step and the next is folded into the following
updates, which the shard replay then reproduces faithfully, so the save-time comparison alone never sees it. An
optimizer step *pre*-hook therefore re-signs what the previous step's post-hook signed and compares: a change is
latched on that rank ({"tensor", "after_step", "before_step"}) and reported by the next save's `check` as
`at_rest_changed` (the same evidence, so the save is rejected and the Checkpointer ends the generation on every
rank together; nothing is raised on one rank alone, and no collective runs per step). By default every local tensor
(each parameter's local shard, then its optimizer state tensors) is compared in every interval: every byte an
optimizer step wrote is checked before the next step reads it. Two hash passes per step over the local state are
kept cheap by local_signer.py (the tensor list cached between passes, zero-copy byte views hashed with xxh3-64);
bench/at_rest_interval.py measures their share of a step. `interval_parts=K` > 1 is the cheaper partial schedule
(the tensors cut into K consecutive runs of about equal bytes, the interval after optimizer step s checking run
s mod K: a single change in the interval after a step no save follows, to a tensor outside that run, is then not
seen, and the evidence says so); None turns the interval check off. `s` is the training step (ShardEvidence sets
`next_step`), else the guard's own count of optimizer steps.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from scout_ckpt import policy
from scout_ckpt.save.evidence.local_signer import LocalTensors, sign_tensors
from scout_ckpt.save.evidence.local_signer import local_tensor as _local

KIND = "at_rest"
# Runs the local tensors are cut into for the interval check (one checked per interval between optimizer steps).
# 1: every byte in every interval, the default (local_signer.py keeps the two passes per step cheap).
INTERVAL_PARTS = 1


class AtRestGuard:
    """Signs the local shards after the optimizer step; `check` compares with the shards at save time.

    Construction is collective when `group` is None (it creates a gloo side group: same order on all ranks, at
    start-up). `check` is collective on that group; every rank returns the same evidence dict."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module | None = None,
        *,
        group=None,
        every: int | None = 1,
        include_state: bool = True,
        timeout_s: float = 300.0,
        interval_parts: int | None = INTERVAL_PARTS,
    ):
        """every: sign after every `every`-th optimizer step; None: only after the steps `arm_next` marks (a
        caller that knows which steps saves follow, as ShardEvidence does once it has seen the save cadence).
        interval_parts: the interval check between optimizer steps checks 1/interval_parts of the bytes per
        interval (1: all; None: off)."""
        if every is not None and every < 1:
            raise ValueError("every must be >= 1 or None")
        if interval_parts is not None and interval_parts < 1:
            raise ValueError("interval_parts must be >= 1 or None")
        self.interval_parts = interval_parts
        # the interval check's reference: (steps, names, indices into them or None for all, signatures, label)
        self._ref: tuple[int, list[str], list[int] | None, list | None, int] | None = None
        self._parts: tuple[tuple, list[list[int]]] | None = None  # (names and sizes, runs) cache
        self.findings: list[dict] = []  # changes the interval check found, latched until a save reports them
        # the caller's number for the next optimizer step (ShardEvidence: the training step), else this guard's
        # own count; the run an interval checks and the findings are numbered by it (torch's optimizer-state
        # initialisation for DCP runs a step of its own, which the guard's count includes)
        self.next_step: int | None = None
        self.interval_s = 0.0  # wall seconds spent in the interval check (both hooks; for the bench)
        self.optimizer, self.every, self.include_state = optimizer, every, include_state
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = (
            group
            if group is not None or not dist.is_initialized()
            else dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        )
        self._names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self._steps = 0  # optimizer steps seen
        self._signed: tuple[int, list[str], list] | None = None  # (steps, names, signatures)
        self._armed = False
        self.cpu_s = 0.0  # CPU seconds spent signing after steps (for the bench)
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self._frozen = [(n, p) for n, p in model.named_parameters() if id(p) not in held] if model is not None else []
        self._frozen_signed: list | None = None
        self._local = LocalTensors(optimizer, self._names, include_state)
        self._handle = optimizer.register_step_post_hook(self._post)
        self._pre_handle = optimizer.register_step_pre_hook(self._pre)

    def close(self) -> None:
        self._handle.remove()
        self._pre_handle.remove()

    def _tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        """(names, local tensors): each parameter's local shard, then its optimizer state tensors."""
        return self._local.current()

    def _sign(self) -> tuple[list[str], list]:
        return self._local.sign()

    def arm_next(self) -> None:
        """Sign after the next optimizer step whatever `every` says (a caller that knows a save follows it)."""
        self._armed = True

    def _sign_frozen(self) -> None:
        if self._frozen:
            self._frozen_signed = sign_tensors([_local(p) for _, p in self._frozen])

    def _post(self, opt, args, kwargs) -> None:
        self._steps += 1
        if self._frozen_signed is None:
            self._sign_frozen()
        armed, self._armed = self._armed, False
        if armed or (self.every is not None and self._steps % self.every == 0):
            c0 = time.thread_time()
            self._signed = (self._steps, *self._sign())
            self.cpu_s += time.thread_time() - c0
            if self.interval_parts is not None:
                # the interval after it: everything when a save follows (armed), else this step's run (a subset of
                # the signatures just taken: no extra pass here)
                names, sigs = self._signed[1], self._signed[2]
                idx = None if armed else self._run(names, self._label(True))
                self._ref = (
                    self._steps,
                    names,
                    idx,
                    sigs if idx is None else [sigs[i] for i in idx] if idx else None,
                    self._label(True),
                )
        else:
            self._signed = None
            if self.interval_parts is not None:
                t0 = time.perf_counter()
                self._sign_part()
                self.interval_s += time.perf_counter() - t0

    # ---- the interval check (between one optimizer step and the next) ----------------------------------------

    def _run(self, names: list[str], step: int) -> list[int] | None:
        """The indices the interval after `step` checks, None for all of them (interval_parts 1)."""
        if (self.interval_parts or 1) == 1:
            return None
        return self.part_of(names, self._tensors()[1], step)

    def part_of(self, names: list[str], tensors: list[torch.Tensor], step: int) -> list[int]:
        """Indices (into `names`) of the run the interval after optimizer step `step` checks: the tensors cut into
        `interval_parts` consecutive runs of about equal bytes, run `step % interval_parts`."""
        k = self.interval_parts or 1
        key = tuple((n, t.numel() * t.element_size()) for n, t in zip(names, tensors))
        if self._parts is None or self._parts[0] != key:
            total = sum(b for _, b in key) or 1
            runs: list[list[int]] = [[] for _ in range(k)]
            at = 0
            for i, (_, b) in enumerate(key):
                runs[min(k - 1, at * k // total)].append(i)
                at += b
            self._parts = (key, runs)
        return self._parts[1][step % k]

    def _label(self, in_post: bool = False) -> int:
        """The number of the optimizer step just taken (`in_post`: inside its post-hook, before the caller has
        moved `next_step` on) or last taken (elsewhere)."""
        if self.next_step is None:
            return self._steps
        return self.next_step if in_post else self.next_step - 1

    def _sign_part(self) -> None:
        names = self._tensors()[0]
        idx = self._run(names, self._label(True))
        self._ref = (
            self._steps,
            names,
            idx,
            self._local.sign(idx, checked=True)[1] if idx is None or idx else None,
            self._label(True),
        )

    def _pre(self, opt, args, kwargs) -> None:
        """Before optimizer step `_steps + 1`: what the last post-hook (or save check, or resign) signed must be
        unchanged; a change is latched for the next save's check (local: no collective per step)."""
        ref, self._ref = self._ref, None
        if ref is None or ref[0] != self._steps or ref[3] is None:
            return
        t0 = time.perf_counter()
        steps, names0, idx, sigs0, label = ref
        names = self._tensors()[0]
        if names is not names0 and names != names0:  # the optimizer's tensors changed (a param group added):
            return  # cannot compare, not a fault
        sigs = self._local.sign(idx, checked=True)[1]
        picked = range(len(names)) if idx is None else idx
        if len(sigs) == len(sigs0):
            for j, (a, b) in enumerate(zip(sigs, sigs0)):
                if a != b:
                    self.findings.append({"tensor": names[picked[j]], "after_step": label, "before_step": label + 1})
        self.interval_s += time.perf_counter() - t0

    def forget(self) -> None:
        """A checkpoint was loaded: changes found before it do not concern the state now in memory."""
        self.findings = []

    def resign(self) -> None:
        """Adopt the current shards as the post-step state (after a legitimate write between step and save)."""
        self._signed = (self._steps, *self._sign())
        self._sign_frozen()
        if self.interval_parts is not None:
            self._ref = (self._steps, self._signed[1], None, self._signed[2], self._label())

    def _frozen_changed(self) -> list[str]:
        if not self._frozen or self._frozen_signed is None:
            return []
        sigs = sign_tensors([_local(p) for _, p in self._frozen])
        return [f"{self._frozen[i][0]} (frozen)" for i, (a, b) in enumerate(zip(sigs, self._frozen_signed)) if a != b]

    def local_check(self) -> dict:
        """This rank's result: {"rank", "status", "changed": [tensor names], "interval": [findings]}. The interval
        check's findings since the last check are reported (a change between earlier steps: FAIL whatever the
        save-time comparison says) and then forgotten."""
        frozen = self._frozen_changed()
        found, self.findings = self.findings, []
        earlier = [f["tensor"] for f in found if f["tensor"] not in frozen]
        out = {"rank": self.rank, "interval": found[:16]} if found else {"rank": self.rank}
        if self._signed is None or self._signed[0] != self._steps:
            if self.interval_parts is not None and self._ref is None:
                # the save-time state is the reference of the interval after it (the pre-hook of the next step)
                names, sigs = self._sign()
                self._ref = (self._steps, names, None, sigs, self._label())
            if frozen or earlier:
                return {**out, "status": policy.FAIL, "changed": list(dict.fromkeys(earlier + frozen))}
            return {**out, "status": policy.MISSING, "changed": []}
        _, names0, sigs0 = self._signed
        names, sigs = self._sign()
        if self.interval_parts is not None:
            # from here to the next step, the state the save checked is the reference (a change found now is
            # reported now, not again by the interval check)
            self._ref = (self._steps, names, None, sigs, self._label())
        if (names is not names0 and names != names0) or len(sigs) != len(sigs0):
            return {**out, "status": policy.FAIL, "changed": ["<set of tensors changed>"]}
        diff = [i for i, (a, b) in enumerate(zip(sigs, sigs0)) if a != b]
        changed = list(dict.fromkeys(earlier + [names[i] for i in diff] + frozen))
        return {**out, "status": policy.FAIL if changed else policy.PASS, "changed": changed}

    def check(self, step: int) -> dict:
        """Collective at save time (before the write): evidence for the shards saved at `step`, same on every rank."""
        mine = self.local_check()
        if self.group is None:
            every = [mine]
        else:
            every = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(every, mine, group=self.group)
        return at_rest_evidence(every, step, coverage=self.coverage())

    def coverage(self) -> dict:
        """What the interval check covers between optimizer steps, for the evidence (`explain` shows it)."""
        k = self.interval_parts
        if k is None:
            return {"between_steps": "not checked: a change between two optimizer steps is not seen"}
        if k == 1:
            return {"between_steps": "every local tensor, in every interval between optimizer steps"}
        return {
            "between_steps": f"1 of {k} runs of the local tensors per interval between optimizer steps (run "
            f"s mod {k} after step s; everything after a step a save follows); not seen: a "
            f"single change, in the interval after any other step, to a tensor outside its "
            "run",
            "interval_parts": k,
        }


def at_rest_evidence(results: list[dict], step: int, coverage: dict | None = None) -> dict:
    """Evidence (policy format) from every rank's `local_check`; `coverage` (AtRestGuard.coverage) goes with a
    pass, saying what was and was not checked between the saves."""
    failed = [r for r in results if r["status"] == policy.FAIL]
    if failed:
        # "between_steps": the interval check's findings ({"tensor", "after_step", "before_step"}): a change
        # between two optimizer steps before this save, not between the last step and the save
        return policy.evidence(
            policy.FAIL,
            [
                {
                    "code": "at_rest_changed",
                    "ranks": [r["rank"]],
                    "step": step,
                    "tensors": r["changed"][:16],
                    "n_tensors": len(r["changed"]),
                    **({"between_steps": r["interval"]} if r.get("interval") else {}),
                }
                for r in failed
            ],
            ranks=sorted(r["rank"] for r in failed),
        )
    missing = sorted(r["rank"] for r in results if r["status"] == policy.MISSING)
    if missing:
        return policy.evidence(policy.MISSING, [{"code": "at_rest_unsigned", "ranks": missing, "step": step}])
    return policy.evidence(policy.PASS, [], ranks=sorted(r["rank"] for r in results), **(coverage or {}))


__all__ = ["INTERVAL_PARTS", "KIND", "AtRestGuard", "at_rest_evidence"]
