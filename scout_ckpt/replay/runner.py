"""The in-situ SDC replay runner: re-execute captured layers (or optimizer windows) on every peer and compare.

Why it exists: a rank whose arithmetic is silently wrong contaminates the all-reduced gradients of every replica,
so the replicas' parameters stay bit-identical and checkpoint consensus sees nothing. Replaying the *same* captured
invocation on every peer and comparing exact signatures (C3) exposes the rank that computes differently.

Two schedules share the machinery:

Rotation, driven by `on_step(step)` (called after each optimizer step), one target every `interval` steps:
  on_step(S-1)  arm capture hooks on the target the schedule gives step S
  step S        the hooks clone the target's inputs, parameters, RNG state and output gradient
  on_step(S)    disarm; the source peer (rotating) broadcasts its capture over the peer group; every peer
                re-executes it on copies; C3 over the signatures -> one replay row, identical on all peers.
                When a save is known to be due at S, this replay is left to the sweep, which runs it with the
                other targets in one round of collectives (or on_step(S+1) does, if the save does not come).

Sweep, driven by `sweep(step)` at a save boundary: every target once, on the inputs captured during the save
step, so the checkpoint carries complete replay evidence of its own step (no waiting for later rotations).
Capture for the save step must be armed before its forward: `expect_save(S)`, `save_every=`, or the period of the
last two saves; until one of these is known every step is captured, so the first saves get a sweep too. The
sweep's captures hold references to the block inputs and output gradients, not copies (capture.py): a target whose
referenced inputs were written in place before its sweep is not replayed at that save (its coverage stays
incomplete: never a pass) and is captured by copies from then on. Only the sweep's source (one peer) keeps a copy
of the targets' parameters as its forward used them, and sends it with the inputs.

The live check: replays are compared with each other (a rank that computes differently whenever it computes) AND
with what the source's live step produced (a fault that struck the live step only, which no replay repeats): the
source signs each target's live output as its forward returns it (capture.py, live=True), and for those
signatures the source's vote is its live value while every other peer's is its replay (`live:output[i]` in a
row's signatures). With 3+ peers a live step that disagrees with the replays is attributed to the source; with 2
it is inconclusive. Either way the save's replay evidence fails, which policy.live_faults reads as the live state
being bad. The sweep's source rotates over the peers save by save (`sweep_source`), so every peer's live step at a
save is checked within len(peers) saves; the rotation's source rotates too, step by step. A target whose live
forward is compiled (per-block torch.compile, module.compile()) gets no live check: the replay runs it eagerly,
which rounds differently (`live_excluded`). Not checked live: the live gradients (only the replays' gradients
are compared), and modules outside every target (a final norm between the last block and the head).

Replay durations also feed a straggler rule (replay.stragglers): one round per step, confirmed over several steps.

All communication is on gloo side groups, never the training group (except the sweep's DTensor gathers of sharded
parameters, see capture.current_state); live grads, parameters, buffers and RNG streams are never touched (replay
runs under `torch.random.fork_rng` on deep copies).
"""

from __future__ import annotations

import time
import warnings
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scout_ckpt.consensus.c3 import verdicts_from_gathered
from scout_ckpt.consensus.signatures import replica_signatures
from scout_ckpt.replay.capture import ModuleCapture, current_state
from scout_ckpt.replay.execute import replay_copy, replay_mode, replay_module
from scout_ckpt.replay.optimizer_replay import (
    DEFAULT_ELEMS,
    OptimizerCapture,
    replay_signature_inputs,
    supports,
    unwrap_optimizer,
)
from scout_ckpt.replay.schedule import SaveForecast, Schedule, Target
from scout_ckpt.replay.stragglers import StragglerRule
from scout_ckpt.replay.targets import NoTargets, discover, resolve, runs_compiled, sites
from scout_ckpt.replay.transport import broadcast_each, host

# A sweep hashes its targets' replayed tensors together, in batches of at least this many bytes (bounded: the
# tensors of a batch are held until it is hashed; on a large model one batch per target is no loss).
HASH_BATCH_BYTES = 256 << 20

# ---- the runner -----------------------------------------------------------------------------------------------

class ReplayRunner:
    """Replays one scheduled target per `interval` steps across the peer group, and every target at a save
    (`sweep`); see the module docstring.

    groups: a consensus.groups.ConsensusGroups; its gloo groups carry all replay traffic. peers: "auto" uses the
    replica group when it has 3+ members and the world group otherwise (pure FSDP, 2-way HSDP); "replicas" or
    "world" force one. targets: (recipe, path) pairs or paths (targets.resolve); default: targets.discover, which
    raises NoTargets (a ScoutError) when the model has no repeated blocks. opt_elems: optimizer elements replayed
    per round over all parameters. save_every: arm the sweep capture for every multiple of it. live_check: compare
    the replays with the source's live outputs (module docstring; False: the sweep replays with the parameters
    held when it runs, and no parameter copy is kept).
    `on_step` and `sweep` return replay rows for the ledger, identical on all peers.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, groups,
                 targets: list | None = None, interval: int = 1, deterministic: bool = True,
                 peers: str = "auto", opt_elems: int = DEFAULT_ELEMS, save_every: int | None = None,
                 straggler_rounds: int = 3, live_check: bool = True):
        self.forecast = SaveForecast(save_every)   # first: a bad save_every is refused before anything else
        optimizer = unwrap_optimizer(optimizer)     # accelerate's AcceleratedOptimizer: the torch one it wraps
        self.model = model
        self.optimizer = optimizer
        self.deterministic = deterministic
        opt = optimizer if optimizer is not None and supports(optimizer) else None
        # What replay does not check, for `explain`: an optimizer whose update is not elementwise.
        self.not_covered = [] if optimizer is None or opt is not None else [
            f"optimizer {type(optimizer).__name__} (not elementwise: window replay does not apply)"]
        # first, before any process group is touched: a model replay cannot cover is refused at once
        self._targets = resolve(model, targets, opt) if targets is not None else discover(model, opt)
        self.rank = dist.get_rank()
        self.schedule = Schedule(self._targets, interval)
        self.group, self.peers = _peer_group(groups, peers)
        where = sites(model)
        # A whole-model torch.compile runs no hook added after compiling: steps with a module capture armed run
        # eagerly (torch.compiler.set_stance), the others compiled. Per-block compile needs nothing (hooks sit on
        # the compiled wrapper, outside the graph).
        self._under_compile = any(where[n].under_compile for r, n in self._targets if r != "optimizer")
        self._eager = False
        self._sites = {n: where[n] for r, n in self._targets if r != "optimizer"}
        self._opt_elems = opt_elems
        # Targets whose live output cannot be compared with a replay bit for bit, and why (module docstring).
        # (Under a whole-model compile the capture steps run eagerly, per-block compiled wrappers included.)
        self.live_check = live_check
        self.live_excluded = {n: "its live forward is compiled; the replay runs eagerly"
                              for r, n in self._targets if r != "optimizer" and not self._under_compile
                              and runs_compiled(where[n].outer)}
        if not live_check:
            self.live_excluded = {n: "replay.live_check is off" for r, n in self._targets if r != "optimizer"}
        self._captures: dict[str, Any] = {}   # rotation
        for recipe, name in self._targets:
            if recipe == "optimizer":
                if optimizer is None:
                    raise NoTargets("replay target 'optimizer' needs the optimizer")
                self._captures[name] = OptimizerCapture(optimizer, opt_elems)
            else:
                self._captures[name] = ModuleCapture(where[name].outer, where[name].inner,
                                                     live=name not in self.live_excluded)
        # Sweep captures, double-buffered: `_live` has its hooks on for the coming step; `_done` holds the
        # step just finished until its sweep (which comes after on_step, before the next forward). With each,
        # the sweep's source for that step, chosen when it was armed (it alone snapshots parameters).
        self._live: tuple[int, dict[str, Any], int] | None = None
        self._done: tuple[int, dict[str, Any], int] | None = None
        self._armed: tuple[int, Target] | None = None
        self._next: int | None = None          # the step whose forward comes next (armed for)
        self._replayed: tuple[int, set[str]] = (0, set())  # targets the rotation replayed at that step
        self._deferred: tuple | None = None   # (step, target, _frozen capture): the rotation's replay left to the sweep
        self._events: list[dict] = []
        self._stragglers = StragglerRule(straggler_rounds)
        # Sweep captures keep references to the live inputs (capture.py); a target whose referenced inputs were
        # written in place before a sweep is captured by clones from then on (on this rank).
        self._clone_targets: set[str] = set()

    def targets(self) -> list[Target]:
        """The coverage set: a step certifies only if each has a clean replay (see schedule.coverage)."""
        return list(self._targets)

    def events(self) -> list[dict]:
        """Straggler events found from replay timings so far (identical on all peers)."""
        return list(self._events)

    def begin(self, step: int) -> None:
        """Arm for step+1 before the first on_step (e.g. right after resuming at `step`)."""
        self.close()
        self._arm(step + 1)
        self._set_eager()

    def close(self) -> None:
        for cap in self._captures.values():
            cap.disarm()
        self._armed = self._deferred = None
        self._live = self._done = None
        self._set_eager()

    def on_step(self, step: int) -> list[dict]:
        """Called once per optimizer step, after it, on every rank: replay what step `step` captured, arm next.
        Collective over the peer group at scheduled steps; every peer returns the same rows."""
        rows = self._flush_deferred()
        armed, self._armed = self._armed, None
        if armed is not None:
            self._captures[armed[1][1]].disarm()
            if armed[0] == step and self._live is not None and self._live[0] == step and self.forecast.due(step, True):
                # a save is due at this step: the sweep replays this capture with the rest, in its collectives
                # (one round of them less per save); if the save does not come, the next on_step replays it. The
                # same decision on every rank: it derives from the save history, as the arming does. What was
                # captured is kept apart from the capture object, which the next arming resets.
                self._deferred = (step, armed[1], _frozen(self._captures[armed[1][1]]))
            elif armed[0] == step:
                row = self._replay(step, armed[1], self._captures[armed[1][1]])
                if row is not None:
                    rows.append(row)
                    self._replayed = (step, {row["target"]})
        live, self._live = self._live, None
        if live is not None:
            for cap in live[1].values():  # step `step` is over: its captures are complete
                cap.disarm()
        # kept for sweep(step); an older one's save did not come
        self._done = live if live is not None and live[0] == step else None
        self._arm(step + 1)
        self._set_eager()
        return rows

    def _flush_deferred(self) -> list[dict]:
        """The rotation's replay deferred to a sweep that did not come: replayed now, as on_step would have."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return []
        step, target, cap = deferred
        row = self._replay(step, target, cap)
        if row is None:
            return []
        self._replayed = (step, {row["target"]})
        return [row]

    def _set_eager(self) -> None:
        """Under a whole-model torch.compile: run the next step eagerly iff a module capture is armed for it."""
        if not self._under_compile:
            return
        need = (self._live is not None or
                any(self._captures[name].armed for recipe, name in self._targets if recipe != "optimizer"))
        if need != self._eager:
            torch.compiler.set_stance("force_eager" if need else "default")
            self._eager = need

    # ---- the save-boundary sweep ---------------------------------------------------------------------------

    def expect_save(self, step: int) -> None:
        """Say that `step` will be saved, before that step's forward (e.g. from the per-step hook of step-1, or
        at start-up): the sweep at that save then has every target's inputs. Local, no communication; every rank
        must say the same (as for any arming decision)."""
        self.forecast.expect(step)
        if self._next == step:
            self._arm_sweep(step)
            self._set_eager()

    def sweep(self, step: int) -> list[dict]:
        """Replay EVERY target once on the inputs captured during step `step` (the save step), after on_step(step)
        and before the next forward. Collective over the peer group: every peer calls it with the same step and
        gets the same rows (the shape `on_step` returns, with detail["sweep"] true). A target the rotation already
        replayed at this step is not replayed again. When the capture was not armed for `step` on every peer,
        nothing is replayed and [] is returned: that checkpoint then waits for the rotation (coverage)."""
        armed = self._done is not None and self._done[0] == step
        everywhere = all(v[0] for v in self._gather([float(armed)]).values())
        rows: list[dict] = []
        deferred = self._deferred if self._deferred is not None and self._deferred[0] == step else None
        if everywhere:
            self._deferred = None
            done = self._replayed[1] if self._replayed[0] == step else set()
            # the rotation's own capture of its target (taken with the parameters its forward used) replaces the
            # sweep's: the same replay the rotation would have run, in the sweep's collectives
            items = [(t, deferred[2] if deferred is not None and t == deferred[1] else self._done[1][t[1]])
                     for t in self._targets if t[1] not in done]
            src = self._done[2]   # chosen at arming: the source rotates over saves (sweep_source)
            for t, cap in items:
                inv = getattr(cap, "invocation", None)
                if t[0] != "optimizer" and inv is not None and not inv.intact():
                    self._clone_targets.add(t[1])
                    warnings.warn(f"replay sweep at step {step}: the inputs captured for {t[1]} were written in "
                                  f"place after capture; captured by copies from the next save on"
                                  + (" (not replayed now: coverage incomplete)" if self.rank == src else ""))
            rows = self._replay_batch(step, items, src)
            for row in rows:  # the rotation's replay run here is still the rotation's (its own capture)
                row["detail"]["sweep"] = deferred is None or row["target"] != deferred[1][1]
        else:
            rows = self._flush_deferred() if deferred is not None else []
            if armed or step in self.forecast.expected:
                warnings.warn(f"replay sweep at step {step}: not every peer captured the step; coverage of this "
                              f"checkpoint waits for the rotation")
        self._done = None
        self.forecast.saved(step)
        if self._live is not None and not self.forecast.due(self._live[0]):
            for cap in self._live[1].values():  # armed while learning the save period, which this save taught
                cap.disarm()
            self._live = None
        self._set_eager()
        return rows

    @property
    def save_every(self) -> int | None:
        """Arm the sweep capture for every multiple of it (None: learn the period from the saves)."""
        return self.forecast.save_every

    @save_every.setter
    def save_every(self, value: int | None) -> None:
        self.forecast.save_every = value

    def sweep_source(self) -> int:
        """The peer whose live step the sweep of the next step to be saved checks: peers[k % len(peers)], k the
        saves so far (a save still due whose sweep has not run counted), so consecutive saves take consecutive
        peers and every peer's live step is checked within len(peers) saves of one incarnation. The same on every
        rank (a function of the save history, as the arming is)."""
        k = len(self.forecast.saves)
        if self._done is not None and self.forecast.due(self._done[0], True) and \
                (not self.forecast.saves or self._done[0] > self.forecast.saves[-1]):
            k += 1   # armed for step S+1 before the save of S ran (a save every step)
        return self.peers[k % len(self.peers)]

    def _arm_sweep(self, step: int) -> None:
        if (self._live is not None and self._live[0] == step) or not self.forecast.due(step):
            return
        src = self.sweep_source()
        me = self.rank == src and self.live_check
        caps: dict[str, Any] = {}
        for recipe, name in self._targets:
            if recipe == "optimizer":
                caps[name] = OptimizerCapture(self.optimizer, self._opt_elems)
                caps[name].arm(step)
            else:
                # the source alone keeps the parameters its forward used: the live check replays exactly that
                caps[name] = ModuleCapture(self._sites[name].outer, self._sites[name].inner, params=me,
                                           refs=name not in self._clone_targets,
                                           live=me and name not in self.live_excluded,
                                           gather=self.live_check and not me)
                caps[name].arm()
        if self._live is not None:
            for cap in self._live[1].values():
                cap.disarm()
        self._live = (step, caps, src)

    # ---- arming ------------------------------------------------------------------------------------------------

    def _arm(self, step: int) -> None:
        self._next = step
        target = self.schedule.target_for(step)
        if target is not None:
            cap = self._captures[target[1]]
            if target[0] == "optimizer":  # consecutive rounds: every window of every tensor once per W rounds
                cap.arm(self.schedule.slot(step) // len(self._targets))
            else:
                cap.arm()
            self._armed = (step, target)
        self._arm_sweep(step)

    # ---- replays: capture from one source, re-executed by every peer, compared with C3 ------------------------

    def _replay(self, step: int, target: Target, cap) -> dict | None:
        """The rotation's one replay (source rotating with the schedule)."""
        src = self.peers[self.schedule.source_index(step, len(self.peers))]
        rows = self._replay_batch(step, [(target, cap)], src)
        return rows[0] if rows else None

    def _replay_batch(self, step: int, items: list, src: int) -> list[dict]:
        """Replay several targets in a fixed number of blocking collectives (whatever their count): one broadcast
        of the source's capture structures (their tensors follow asynchronously, one broadcast each: a peer
        replays a target as soon as its tensors are in), one gather of per-target headers, one all_gather of every
        signature. A target the source did not run this step gives no row. Every peer returns the same rows."""
        payloads = None
        if self.rank == src:
            # a capture whose referenced live tensors were written since is not sent: no row, coverage incomplete
            payloads = [host(cap.capture) if t[0] == "optimizer" else
                        host(cap.invocation) if cap.invocation is not None and cap.invocation.intact() else None
                        for t, cap in items]
        # asynchronous: target i is replayed as soon as its own tensors have arrived (transport.Arrivals)
        arrivals = broadcast_each(payloads, src, self.group)
        work = [(i, t, cap) for i, (t, cap) in enumerate(items) if arrivals.present(i)]
        results: list[list] = []   # per target: [labels, its replayed tensors -> their signatures, seconds, payload]
        pending: list[int] = []    # targets replayed but not hashed yet
        held = 0                   # bytes of their tensors
        for i, target, cap in work:
            payload = live = None
            t0 = time.perf_counter()
            try:
                payload = arrivals.get(i)
                t0 = time.perf_counter()  # the replay's own time (the straggler rule's), not the transfer's
                if target[0] != "optimizer" and not payload.params and not payload.buffers:
                    # a sweep capture without the source's parameters (live_check off): replay with the parameters
                    # held now (the state being saved)
                    payload.params, payload.buffers = current_state(cap.inner)
                labels, tensors = self._execute(target[0], cap, payload)
                if target[0] != "optimizer" and getattr(payload, "live", None) is not None:
                    live = self._live_votes(labels, payload.live, src)
                    labels = labels + [f"live:output[{j}]" for j in range(len(live[1]))]
            except Exception as e:  # noqa: BLE001 -- a peer that cannot replay must not leave the others waiting
                warnings.warn(f"replay of {target[1]} at step {step} failed on rank {self.rank}: {e!r}")
                labels, tensors = [], None
            results.append([labels, tensors, time.perf_counter() - t0, payload, live])
            if tensors is not None:
                pending.append(len(results) - 1)
                held += sum(getattr(t, "nbytes", 0) for t in tensors)
                if held >= HASH_BATCH_BYTES:
                    self._sign(step, work, results, pending)
                    held = 0
        self._sign(step, work, results, pending)
        for res in results:   # the live check's votes, now that the replays' signatures are known
            if res[4] is not None and res[1] is not None:
                mine, votes = res[4]
                res[1] = torch.cat([res[1], votes if mine else res[1][:len(votes)]])
        arrivals.wait_all()
        if not work:
            return []
        # One small gather: per target, every peer's time and whether it has signatures (and how many).
        header = self._gather([v for lab, sig, dt, _, _ in results
                               for v in (dt, float(sig is not None), float(len(lab)))])
        comparable = [all(h[3 * i + 1] for h in header.values()) and len({h[3 * i + 2] for h in header.values()}) == 1
                      for i in range(len(work))]
        mine = [sig for (lab, sig, dt, _, _), ok in zip(results, comparable) if ok]
        gathered = None
        if mine:
            flat = torch.cat(mine).to(torch.int64).contiguous()
            out = [torch.empty_like(flat) for _ in self.peers]
            dist.all_gather(out, flat, group=self.group)
            gathered = torch.stack(out)
        rows, offset = [], 0
        for i, ((_, target, cap), (labels, sigs, _, payload, live)) in enumerate(zip(work, results)):
            durations = {r: h[3 * i] for r, h in header.items()}
            self._timing(step, target, durations)
            detail: dict = {"source": src, "peers": list(self.peers), "signatures": len(labels),
                            "durations": {str(r): round(d, 6) for r, d in durations.items()}}
            if target[0] == "optimizer" and payload is not None:  # what this round compared: every window
                detail.update(tensors=len(payload.params), elements=payload.elements, round=payload.round,
                              cycle=payload.cycle)
            if not comparable[i]:
                status, ranks = "INCONCLUSIVE", []
                detail["failed_ranks"] = sorted(r for r, h in header.items() if not h[3 * i + 1])
                detail["counts"] = {str(r): int(h[3 * i + 2]) for r, h in header.items()}
            else:
                n = len(labels)
                verdict = verdicts_from_gathered(gathered[:, offset:offset + n], self.peers, labels)
                offset += n
                status, ranks, why = _summarise(verdict)
                detail.update(why)
                if any(lab.startswith("live:") for lab in labels):   # the source's live step was checked
                    detail["live_checked"] = src
                    # the live step alone: the replays agree with each other, not with what the source's step made
                    bad = [labels[j] for j in verdict.disagreeing]
                    detail["live_disagree"] = (any(n.startswith("live:") for n in bad)
                                               and not any(n.startswith("output[") for n in bad))
            if target[0] == "optimizer" and payload is not None and payload.unsupported:
                status, detail["unsupported"] = "INCONCLUSIVE", payload.unsupported
            rows.append({"step": step, "recipe": target[0], "target": target[1], "status": status, "ranks": ranks,
                         "duration_s": max(durations.values()), "detail": detail})
        return rows

    def _sign(self, step: int, work: list, results: list[list], pending: list[int]) -> None:
        """Replace the replayed tensors of the `pending` targets by their signatures, hashed in ONE call (per-call
        and per-tensor fixed costs were a tenth of a sweep). A batch that cannot be hashed is
        hashed per target, so that only the target whose tensors fail loses its signatures (INCONCLUSIVE, as a
        replay that failed). The straggler rule's durations are the replays' own, without the hashing."""
        if not pending:
            return
        try:
            sigs = replica_signatures([t for k in pending for t in results[k][1]])
            at = 0
            for k in pending:
                n = len(results[k][1])
                results[k][1], at = sigs[at:at + n], at + n
        except Exception:  # noqa: BLE001 -- find the target at fault
            for k in pending:
                try:
                    results[k][1] = replica_signatures(results[k][1])
                except Exception as e:  # noqa: BLE001
                    warnings.warn(f"replay of {work[k][1][1]} at step {step} failed on rank {self.rank}: {e!r}")
                    results[k][0], results[k][1] = [], None
        pending.clear()

    def _live_votes(self, labels: list[str], live: torch.Tensor, src: int) -> tuple[bool, torch.Tensor]:
        """The live check's votes for `live:output[i]`: the source votes its live output's signatures (mine=True,
        `live`), every other peer its replay's signatures of output[i], the first signatures of its replay (module
        docstring). A replay with fewer outputs than the live call votes for none of them: the peers' counts then
        differ, and the row is inconclusive."""
        n = int(live.shape[0])
        if n > sum(lab.startswith("output[") for lab in labels):
            n = 0
        return self.rank == src, live[:n].to(torch.int64)

    def _execute(self, recipe: str, cap, payload) -> tuple[list[str], list[torch.Tensor]]:
        if recipe != "optimizer":
            return replay_module(cap.inner, payload, self.deterministic,
                                 cap.hook_ids if cap.module is cap.inner else None)
        if payload.unsupported:
            return ["unsupported"], [torch.zeros(1)]
        device = next((p.device for g in self.optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        return replay_signature_inputs(type(self.optimizer), self.optimizer.defaults, payload.to(device),
                                       cap.capture)

    def _gather(self, values: list[float]) -> dict[int, list[float]]:
        mine = torch.tensor(values, dtype=torch.float64)
        out = [torch.zeros_like(mine) for _ in self.peers]
        dist.all_gather(out, mine, group=self.group)
        return {r: t.tolist() for r, t in zip(self.peers, out)}

    def _timing(self, step: int, target: Target, durations: dict[int, float]) -> None:
        """Replay durations feed the straggler rule one step at a time (see replay.stragglers)."""
        self._events.extend(self._stragglers.observe(step, durations, target[1]))


def _frozen(cap) -> SimpleNamespace:
    """What a capture holds now (its invocation, or its optimizer windows), apart from the capture object."""
    if isinstance(cap, OptimizerCapture):
        return SimpleNamespace(capture=cap.capture)
    return SimpleNamespace(invocation=cap.invocation, inner=cap.inner, module=cap.module, hook_ids=cap.hook_ids)


def _peer_group(groups, peers: str) -> tuple[Any, list[int]]:
    """The replica group when it can attribute on its own (3+ members, or peers="replicas"), else the world.

    Module targets replay full (unsharded) parameters and the optimizer recipe replays a broadcast slice, so any
    set of ranks is a valid peer set; the world is used where the replica group is missing (FSDP) or too small to
    name a culprit (HSDP with 2 replicas)."""
    if peers not in ("auto", "replicas", "world"):
        raise ValueError(f"peers must be auto, replicas or world, got {peers!r}")
    mine = list(groups.group_ranks)
    if groups.group is not None and len(mine) > 1 and (peers == "replicas" or (peers == "auto" and len(mine) >= 3)):
        return groups.group, mine
    return groups.world_group, list(range(groups.world_size))


def _summarise(verdict) -> tuple[str, list[int], dict]:
    """Row status, attributed global ranks, and what disagreed (at most 16 signature names, and how the peers
    split on the first of them)."""
    detail: dict = {"disagree": list(verdict.disagreeing_names[:16]), "n_disagree": len(verdict.disagreeing)}
    if verdict.disagreeing:
        first = verdict.per_tensor[verdict.disagreeing[0]]
        detail["split"] = [[verdict.group_ranks[p] for p in cls] for cls in first.classes]
    return verdict.status.upper(), sorted(verdict.attributed_ranks), detail


__all__ = ["ReplayRunner", "replay_copy", "replay_mode", "replay_module"]
