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
incomplete: never a pass) and is captured by copies from then on. Every rank keeps a copy of the targets'
parameters as its forward used them (the self-check replays it, self_check.py; the source sends its copy with the
inputs only where some peer's own copy differs from it, shared_params.py); with the self-check off, only the source
keeps one.

The sweep's module targets are checked in a ring by default (replay.ring): each rank replays its predecessor's
capture against the predecessor's live outputs and gradients, one replay per target per rank, so a fault that
struck any rank's live step at a save, or a rank that computes wrongly, is caught at that save. The optimizer
target, targets without a live check and a deferred rotation capture go through the broadcast round: every peer
replays the source's capture, compared with each other AND with what the source's live step produced (the
cross-check, replay.live; the sweep's source rotates over the peers save by save, `sweep_source`).
`sweep="broadcast"` checks the module targets that way too, then every rank replays its own capture once more
against its own live step (the self-check).

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

from scout_ckpt.errors import NoTargets
from scout_ckpt.options import DEFAULT_REPLAY_INTERVAL as AUTO_INTERVAL  # until the save period is known
from scout_ckpt.replay import live as live_step
from scout_ckpt.replay import (
    ring,
    shared_params,
    triage,  # re-execution of an attributed rank's work: persistent / transient / not hw
)
from scout_ckpt.replay import rows as replay_rows
from scout_ckpt.replay import self_check as own_round  # the self-check round
from scout_ckpt.replay.capture import ModuleCapture, current_state
from scout_ckpt.replay.execute import replay_copy, replay_mode, replay_module, replay_target
from scout_ckpt.replay.loss_triage import LossTriage
from scout_ckpt.replay.optimizer_replay import (
    DEFAULT_ELEMS,
    OptimizerCapture,
    supports,
    unwrap_optimizer,
)
from scout_ckpt.replay.schedule import SaveForecast, Schedule, Target, rotation_interval
from scout_ckpt.replay.stragglers import StragglerRule
from scout_ckpt.replay.targets import discover, resolve, runs_compiled, sites, tensor_parallel_targets
from scout_ckpt.replay.transport import broadcast_each, host, peer_group

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
    the replays with the source's live outputs (replay.live; False: the sweep replays with the parameters
    held when it runs, and no parameter copy is kept). self_check: every rank replays its own sweep capture and
    compares it with its own live step (replay.live; needs live_check; costs every rank a parameter copy of the
    targets at the save step and one more replay per target per save).
    `on_step` and `sweep` return replay rows for the ledger, identical on all peers.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        groups,
        targets: list | None = None,
        interval: int | None = 1,
        deterministic: bool = True,
        peers: str = "auto",
        opt_elems: int = DEFAULT_ELEMS,
        save_every: int | None = None,
        straggler_rounds: int = 3,
        live_check: bool = True,
        self_check: bool = True,
        sweep: str = "ring",
    ):
        self.forecast = SaveForecast(save_every)  # first: a bad save_every is refused before anything else
        optimizer = unwrap_optimizer(optimizer)  # accelerate's AcceleratedOptimizer: the torch one it wraps
        self.model = model
        self.optimizer = optimizer
        self.deterministic = deterministic
        opt = optimizer if optimizer is not None and supports(optimizer) else None
        # What replay does not check, for `explain`: an optimizer whose update is not elementwise.
        self.not_covered = (
            []
            if optimizer is None or opt is not None
            else [f"optimizer {type(optimizer).__name__} (not elementwise: window replay does not apply)"]
        )
        # first, before any process group is touched: a model replay cannot cover is refused at once
        self._targets = resolve(model, targets, opt) if targets is not None else discover(model, opt)
        if targets is None:  # layers that are themselves tensor-parallel are left out by discovery: say so
            self.not_covered += [
                f"{p} (tensor-parallel layer: its inputs and outputs are shards; the block holding it is replayed)"
                for p in tensor_parallel_targets(model)
                if not any(p == t or p.startswith(f"{t}.") for _, t in self._targets)
            ]
        self.rank = dist.get_rank()
        # interval None (the Checkpointer's default): AUTO_INTERVAL until the save period is known, then
        # stretched to it (_arm); an explicit interval is kept as given
        self._interval = interval
        self.schedule = Schedule(self._targets, interval or AUTO_INTERVAL)
        self.group, self.peers = peer_group(groups, peers)
        where = sites(model)
        # A whole-model torch.compile runs no hook added after compiling: steps with a module capture armed run
        # eagerly (torch.compiler.set_stance), the others compiled. Per-block compile needs nothing (hooks sit on
        # the compiled wrapper, outside the graph).
        self._under_compile = any(where[n].under_compile for r, n in self._targets if r != "optimizer")
        self._eager = False
        self._sites = {n: where[n] for r, n in self._targets if r != "optimizer"}
        self._opt_elems = opt_elems
        # Targets whose live output cannot be compared with a replay bit for bit, and why (replay.live).
        # (Under a whole-model compile the capture steps run eagerly, per-block compiled wrappers included.)
        self.live_check = live_check
        modules = [n for r, n in self._targets if r != "optimizer"]
        self.live_excluded = live_step.excluded(
            modules, live_check, [n for n in modules if not self._under_compile and runs_compiled(where[n].outer)]
        )
        self.self_check = live_check and self_check
        if sweep not in ("ring", "broadcast"):
            raise ValueError(f"replay sweep must be 'ring' or 'broadcast', got {sweep!r}")
        # the ring needs every rank's live capture (the self-check's arming) and 2+ peers
        self.ring_sweep = sweep == "ring" and self.self_check and len(self.peers) >= 2
        self._grad_params, self.grad_notes = own_round.live_grad_params(model, self._sites)
        self._captures: dict[str, Any] = {}  # rotation
        for recipe, name in self._targets:
            if recipe == "optimizer":
                if optimizer is None:
                    raise NoTargets("replay target 'optimizer' needs the optimizer")
                self._captures[name] = OptimizerCapture(optimizer, opt_elems)
            else:
                self._captures[name] = ModuleCapture(
                    where[name].outer, where[name].inner, live=name not in self.live_excluded
                )
        # Sweep captures, double-buffered: `_live` has its hooks on for the coming step; `_done` holds the
        # step just finished until its sweep (which comes after on_step, before the next forward). With each,
        # the sweep's source for that step, chosen when it was armed (it alone snapshots parameters).
        self._live: tuple[int, dict[str, Any], int] | None = None
        self._done: tuple[int, dict[str, Any], int] | None = None
        self._armed: tuple[int, Target] | None = None
        self._next: int | None = None  # the step whose forward comes next (armed for)
        self._replayed: tuple[int, set[str]] = (0, set())  # targets the rotation replayed at that step
        self._deferred: tuple | None = None  # (step, target, _frozen capture): the rotation's replay left to the sweep
        self._events: list[dict] = []
        self._stragglers = StragglerRule(straggler_rounds)
        # Sweep captures keep references to the live inputs (capture.py); a target whose referenced inputs were
        # written in place before a sweep is captured by clones from then on (on this rank).
        self._clone_targets: set[str] = set()
        self.loss = LossTriage()  # a non-finite or spiking loss: the rank's work re-executed (loss_triage.py)

    @property
    def process_groups(self) -> list:
        """The gloo group replay's collectives run on (transport.peer_group), e.g. for an observer to ignore."""
        return [self.group] if self.group is not None else []

    def targets(self) -> list[Target]:
        """The coverage set: a step certifies only if each has a clean replay (see schedule.coverage)."""
        return list(self._targets)

    @property
    def sites(self) -> dict:
        """Module target name -> where its capture hooks go (targets.sites)."""
        return self._sites

    def events(self) -> list[dict]:
        """Straggler events found from replay timings, and the loss triage's sdc events, so far (identical on all
        peers)."""
        return list(self._events)

    def begin(self, step: int) -> None:
        """Arm for step+1 before the first on_step (e.g. right after resuming at `step`)."""
        self.close()
        self._arm(step + 1)
        self._set_eager()

    def close(self) -> None:
        for cap in self._captures.values():
            cap.disarm()
        self.loss.disarm()
        self._armed = self._deferred = None
        self._live = self._done = None
        self._set_eager()

    def on_step(self, step: int, loss: float | None = None) -> list[dict]:
        """Called once per optimizer step, after it, on every rank: replay what step `step` captured, arm next.
        Collective over the peer group at scheduled steps; every peer returns the same rows. `loss`: this rank's
        loss of the step, given at the same steps on every rank (replay.loss_triage: a gather per step)."""
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
        self._events.extend(self.loss.on_step(self, step, loss))
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
        need = (
            self._live is not None
            or self.loss.armed
            or any(self._captures[name].armed for recipe, name in self._targets if recipe != "optimizer")
        )
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
        nothing is replayed and [] is returned: that checkpoint then waits for the rotation (coverage).

        Never beside a training step (it may run beside the save's write, save/evidence/replay.py): each replay
        sets the process's global RNG state to the captured step's (execute.py, under `fork_rng`), and a forward
        with dropout running meanwhile would draw from it and change the training."""
        armed = self._done is not None and self._done[0] == step
        deferred = self._deferred if self._deferred is not None and self._deferred[0] == step else None
        items: list = []
        if armed:
            done = self._replayed[1] if self._replayed[0] == step else set()
            # the rotation's own capture of its target (taken with the parameters its forward used) replaces the
            # sweep's: the same replay the rotation would have run, in the sweep's collectives
            items = [
                (t, deferred[2] if deferred is not None and t == deferred[1] else self._done[1][t[1]])
                for t in self._targets
                if t[1] not in done
            ]
        # one gather: armed everywhere?, and the digests of every rank's parameter copies (shared_params.py)
        words = self._gather(
            [int(armed)]
            + shared_params.digest_words(self._targets, {t[1]: cap for t, cap in items} if armed else None),
            dtype=torch.int64,
        )
        everywhere = all(v[0] for v in words.values())
        rows: list[dict] = []
        if everywhere:
            self._deferred = None
            src = self._done[2]  # chosen at arming: the source rotates over saves (sweep_source)
            share = shared_params.shared(words, self._targets, src, offset=1)
            for t, cap in items:
                inv = getattr(cap, "invocation", None)
                if t[0] != "optimizer" and inv is not None and not inv.intact():
                    self._clone_targets.add(t[1])
                    warnings.warn(
                        f"replay sweep at step {step}: the inputs captured for {t[1]} were written in "
                        f"place after capture; captured by copies from the next save on"
                        + (" (not replayed now: coverage incomplete)" if self.rank == src else "")
                    )
            if self.ring_sweep:
                # module targets with a live check: the ring (one replay each per rank); the optimizer, targets
                # without a live check and the rotation's deferred capture: the broadcast round, no self-check
                ringed = [
                    (t, cap)
                    for t, cap in items
                    if t[0] != "optimizer" and t[1] not in self.live_excluded and (deferred is None or t != deferred[1])
                ]
                rest = [(t, cap) for t, cap in items if all(t != r[0] for r in ringed)]
                rows = self._replay_batch(step, rest, src, share=share) if rest else []
                if ringed:
                    found, unchecked = ring.run(
                        step,
                        ringed,
                        peers=self.peers,
                        group=self.group,
                        words=words,
                        targets=self._targets,
                        offset=1,
                        deterministic=self.deterministic,
                        gather=self._gather,
                    )
                    # triage (replay/triage.py): an attributed rank's own capture executed again, on it and another
                    triage.after_round(self, step, found, {t[1]: (t, cap, None) for t, cap in ringed}, own_capture=True)
                    by_name = {t[1]: t for t, _ in ringed}  # a target no rank could check has no row
                    for row in found:
                        t = by_name[row["target"]]
                        self._timing(step, t, {int(r): d for r, d in row["detail"]["durations"].items()})
                        row["detail"].update(live_step.grads_detail(self.grad_notes.get(t[1]) or []))
                    rows += found
                    if unchecked:  # no live signature anywhere (the same on every rank): the peers' cross replay
                        again = [(t, cap) for t, cap in ringed if t[1] in set(unchecked)]
                        rows += self._replay_batch(step, again, src, share=share)
                    order = {t[1]: i for i, t in enumerate(self._targets)}
                    rows.sort(key=lambda r: order.get(r["target"], len(order)))
            else:
                rows = self._replay_batch(step, items, src, own=self.self_check, share=share)
            for row in rows:  # the rotation's replay run here is still the rotation's (its own capture)
                row["detail"]["sweep"] = deferred is None or row["target"] != deferred[1][1]
        else:
            rows = self._flush_deferred() if deferred is not None else []
            if armed or step in self.forecast.expected:
                warnings.warn(
                    f"replay sweep at step {step}: not every peer captured the step; coverage of this "
                    f"checkpoint waits for the rotation"
                )
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
        """The peer whose live step the sweep of the next step to be saved checks (replay.live.sweep_source)."""
        return live_step.sweep_source(self.forecast, None if self._done is None else self._done[0], self.peers)

    def _arm_sweep(self, step: int) -> None:
        if (self._live is not None and self._live[0] == step) or not self.forecast.due(step):
            return
        src = self.sweep_source()
        me = self.rank == src and self.live_check
        own = me or self.self_check  # keeps its parameters and signs its live step (the self-check: replay.live)
        caps: dict[str, Any] = {}
        for recipe, name in self._targets:
            if recipe == "optimizer":
                caps[name] = OptimizerCapture(self.optimizer, self._opt_elems)
                caps[name].arm(step)
            else:
                # the parameters its forward used: the live checks replay exactly that (every rank with the
                # self-check, else the source alone; the others then join the source's gathers of TP shards)
                caps[name] = ModuleCapture(
                    self._sites[name].outer,
                    self._sites[name].inner,
                    params=own,
                    refs=name not in self._clone_targets,
                    live=own and name not in self.live_excluded,
                    gather=self.live_check and not own,
                    grads=self.self_check,
                    grad_params=self._grad_params.get(name),
                )
                caps[name].arm()
        if self._live is not None:
            for cap in self._live[1].values():
                cap.disarm()
        self._live = (step, caps, src)

    # ---- arming ------------------------------------------------------------------------------------------------

    def _arm(self, step: int) -> None:
        self._next = step
        self.schedule.interval = rotation_interval(self._interval, self.forecast.period(), AUTO_INTERVAL)
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

    def _replay_batch(
        self, step: int, items: list, src: int, own: bool = False, share: set[str] = frozenset()
    ) -> list[dict]:
        """Replay several targets in a fixed number of blocking collectives (whatever their count): one broadcast
        of the source's capture structures (their tensors follow asynchronously, one broadcast each: a peer
        replays a target as soon as its tensors are in), one gather of per-target headers, one all_gather of every
        signature. A target the source did not run this step gives no row. Every peer returns the same rows.
        `own`: every peer also self-checks its own capture of each module target (replay.live), its outcome in
        the header gather (no collective more). `share`: the targets sent without parameters, replayed by every
        peer with its own copy (shared_params.py)."""
        payloads = None
        if self.rank == src:
            # a capture whose referenced live tensors were written since is not sent: no row, coverage incomplete
            payloads = [
                host(cap.capture)
                if t[0] == "optimizer"
                else None
                if cap.invocation is None or not cap.invocation.intact()
                else host(shared_params.without_params(cap.invocation))
                if t[1] in share
                else host(cap.invocation)
                for t, cap in items
            ]
        # asynchronous: target i is replayed as soon as its own tensors have arrived (transport.Arrivals)
        arrivals = broadcast_each(payloads, src, self.group)
        work = [(i, t, cap) for i, (t, cap) in enumerate(items) if arrivals.present(i)]
        results: list[list] = []  # per target: [labels, its replayed tensors -> their signatures, seconds, payload]
        pending: list[int] = []  # targets replayed but not hashed yet
        held = 0  # bytes of their tensors
        selfc: list[int] = []  # per target: this rank's self-check outcome (live.SELF_*)
        for i, target, cap in work:
            payload = live = None
            # before waiting for the source's tensors: the self-replay overlaps their transfer
            selfc.append(
                own_round.check_own(
                    step,
                    target,
                    cap,
                    rank=self.rank,
                    src=src,
                    deterministic=self.deterministic,
                    optimizer=self.optimizer,
                )
                if own and target[0] != "optimizer"
                else live_step.SELF_NONE
            )
            t0 = time.perf_counter()
            try:
                payload = arrivals.get(i)
                t0 = time.perf_counter()  # the replay's own time (the straggler rule's), not the transfer's
                if target[1] in share:
                    payload = shared_params.with_own(payload, cap)
                if target[0] != "optimizer" and not payload.params and not payload.buffers:
                    # a sweep capture without the source's parameters (live_check off): replay with the parameters
                    # held now (the state being saved)
                    payload.params, payload.buffers = current_state(cap.inner)
                labels, tensors = replay_target(target[0], cap, payload, self.deterministic, self.optimizer)
                if target[0] != "optimizer" and getattr(payload, "live", None) is not None:
                    live = live_step.votes(labels, payload.live, self.rank == src)
                    labels = live_step.vote_labels(labels, live)
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
        own_round.settle(work, results, selfc)  # the source's self-check is its own cross replay
        for res in results:  # the live check's votes, now that the replays' signatures are known
            if res[4] is not None and res[1] is not None:
                res[1] = live_step.signed(res[1], res[4])
        arrivals.wait_all()
        if not work:
            return []
        # One small gather: per target, every peer's time and whether it has signatures (and how many).
        header = self._gather(replay_rows.header_values(results, selfc))
        comparable = replay_rows.comparable(header, len(work))
        mine = [sig for (lab, sig, dt, _, _), ok in zip(results, comparable) if ok]
        gathered = None
        if mine:
            flat = torch.cat(mine).to(torch.int64).contiguous()
            out = [torch.empty_like(flat) for _ in self.peers]
            dist.all_gather(out, flat, group=self.group)
            gathered = torch.stack(out)
        found, offset = [], 0
        for i, ((_, target, _), (labels, _, _, payload, _)) in enumerate(zip(work, results)):
            self._timing(step, target, replay_rows.durations(header, i))
            sigs = None
            if comparable[i]:
                sigs, offset = gathered[:, offset : offset + len(labels)], offset + len(labels)
            found.append(
                replay_rows.replay_row(
                    step, target, payload, labels, header, i, sigs, src, self.peers, self.grad_notes.get(target[1])
                )
            )
        # triage (replay/triage.py): an attributed rank's work executed again on it and on another rank, and the
        # row's detail classified persistent / transient / not_hardware; no collective when nothing is attributed
        triage.after_round(self, step, found, {t[1]: (t, cap, res[3]) for (_, t, cap), res in zip(work, results)})
        return found

    def _sign(self, step: int, work: list, results: list[list], pending: list[int]) -> None:
        """Sign the pending targets' replayed tensors (replay.rows.sign)."""
        replay_rows.sign(step, work, results, pending, self.rank)

    def _gather(self, values: list, dtype: torch.dtype = torch.float64) -> dict[int, list]:
        """Every peer's `values` (the same length everywhere); int64 for words that must stay exact (digests)."""
        mine = torch.tensor(values, dtype=dtype)
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


__all__ = ["ReplayRunner", "replay_copy", "replay_mode", "replay_module"]
