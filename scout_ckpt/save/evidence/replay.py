"""SDC replay as checkpoint evidence: the runner (a rotation every step, a sweep at every save) together with its
ledger bookkeeping (replay rows, `sdc` events, coverage since the last certified step, re-deciding checkpoints
that waited on it).

One object, so that every save path (Checkpointer, a framework's checkpoint manager) wires replay with the same
few calls and no copy of the bookkeeping: `start` at construction, `bind` once the run has a ledger and an id,
`on_step` after each optimizer step, `sweep` at a save boundary before the write, `evidence` in the save's live
evidence (coordinator), `begin` after a load, `close`.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch.distributed as dist

from scout_ckpt import policy
from scout_ckpt.errors import NoTargets
from scout_ckpt.ledger import journal
from scout_ckpt.options import ReplayOptions, as_replay
from scout_ckpt.replay import ReplayRunner
from scout_ckpt.replay import coverage as replay_coverage
from scout_ckpt.save import local_tier_rows as local_rows
from scout_ckpt.save import log


class ReplayEvidence:
    def __init__(self, runner: ReplayRunner) -> None:
        self.runner = runner
        self._events_seen = 0
        self.ledger = self.root = self.run_id = self.policy = None
        self.is_coordinator = False
        # Replay captures from the per-step hook: a script that never calls ckpt.step() gets no replay, and its
        # saves say so (`not_applicable`, replay_no_step_hook) instead of waiting forever on coverage.
        self.stepped = False
        self._warned_unstepped = False

    @staticmethod
    def off_by_default(world_size: int, mode: str) -> str | None:
        """Why replay stays off by default for this job, or None where it is on (every topology of 2+ ranks,
        tensor-parallel meshes included). One rank has no peer to replay on. A block sharded by tensor parallelism
        is replayed whole (its shards gathered at the capture) by every rank of the peer group on the same captured
        inputs: its sharded live math is not compared bit for bit (no live signature), so a persistent fault is
        caught and named by the peers' replays, and a fault of the live step alone only by the other targets'
        live checks (docs/replay.md)."""
        del mode  # kept in the signature: integrations pass their mode
        if world_size < 2:
            return "one rank: no peer to replay on"
        return None

    @classmethod
    def start(
        cls, replay, *, model, optimizer, groups, auto_on: bool, off_reason: str | None = None
    ) -> ReplayEvidence | None:
        """The replay a configuration asks for, or None. `replay` is None (auto: `auto_on` decides, with a
        WARNING naming `off_reason` where it is off, and a model with nothing to replay only turns it off with a
        WARNING), False, True, a dict of runner options or ReplayOptions (an explicit request for a model with
        nothing to replay is an error: NoTargets)."""
        replay = as_replay(replay)  # a misspelled key or a bad value fails here, naming the field
        auto = replay is None
        first = not dist.is_initialized() or dist.get_rank() == 0  # one WARNING per job, not one per rank
        if auto:
            replay = auto_on
            if not auto_on and off_reason and model is not None and first:
                log.logger.warning("replay is off (%s): a rank computing wrongly (SDC) is not detected", off_reason)
        if not (replay and model is not None):
            return None
        opts = replay if isinstance(replay, ReplayOptions) else ReplayOptions()
        try:
            runner = ReplayRunner(model, optimizer, groups=groups, **opts.runner_kwargs())
        except NoTargets as e:
            if not auto:
                raise
            if first:
                log.logger.warning("replay is off, SDC is not detected: %s", e)
            return None
        runner.begin(0)
        return cls(runner)

    def bind(self, *, ledger, root: Path, run_id: str, policy: dict, is_coordinator: bool) -> None:
        """Where the bookkeeping goes (the coordinator holds the ledger; the others only replay)."""
        self.ledger, self.root, self.run_id, self.policy = ledger, root, run_id, policy
        self.is_coordinator = is_coordinator

    def targets(self) -> list:
        return self.runner.targets()

    def begin(self, step: int) -> None:
        """After a load: the schedule and coverage start again from the loaded step."""
        self.runner.begin(step)

    def on_step(self, step: int, loss: float | None = None) -> float:
        """The rotation after an optimizer step (collective on the replay's side groups at scheduled steps), and
        the loss triage where `loss` is given (replay.loss_triage). Returns the coordinator's bookkeeping seconds
        (not training time: the straggler rule must not see it)."""
        self.stepped = True
        return self._record(self.runner.on_step(step, loss))

    def sweep(self, step: int) -> None:
        """The save-boundary sweep: every target replayed once on this step's captured inputs, so the checkpoint
        carries complete same-step replay evidence."""
        self._record(self.runner.sweep(step))

    def start_sweep(self, step: int) -> PendingSweep:
        """The sweep of `sweep`, started in a thread of its own so that it overlaps the save's write; its rows
        reach the ledger only at `PendingSweep.finish()` (the calling thread, before the save's evidence). Safe
        beside the write: replay's collectives run on its own gloo group (never the save's or the consensus
        thread's), its replays run on copies of the modules, and the training thread is held in save() until
        finish() returns, so the state both read cannot change and no forward draws from the RNG the replay forks.

        The sweep must be finished before save() returns, never left running into the next training steps: a
        replay sets the process's global RNG state (replay/execute.py: `fork_rng`, then `set_rng_state` to the
        captured step's) and the process-wide deterministic-algorithms flag for its duration, and a training
        forward with dropout running meanwhile would draw from that RNG state, changing the training itself."""
        return PendingSweep(self, step)

    def _record(self, rows: list[dict]) -> float:
        events = self.runner.events()
        new_events, self._events_seen = events[self._events_seen :], len(events)
        if not (self.is_coordinator and (rows or new_events)):
            return 0.0
        t0 = time.monotonic()
        self.ledger.add_replays([dict(r, run_id=self.run_id) for r in rows])
        for r in rows:
            if r["status"] in ("ATTRIBUTED", "INCONCLUSIVE"):
                self.ledger.add_event(
                    "sdc",
                    step=r["step"],
                    ranks=r["ranks"],
                    run_id=self.run_id,
                    detail={
                        "source": "replay",
                        "recipe": r["recipe"],
                        "target": r["target"],
                        "status": r["status"],
                        # the source's live step alone disagreed with every replay of it
                        "live_step": bool((r.get("detail") or {}).get("live_disagree")),
                        # replay/triage.py: persistent / transient / not_hardware per rank
                        **({"triage": r["detail"]["triage"]} if (r.get("detail") or {}).get("triage") else {}),
                    },
                )
        for e in new_events:
            self.ledger.add_event(
                e["kind"], step=e.get("step"), ranks=e.get("ranks"), detail=e.get("detail"), run_id=self.run_id
            )
        self.settle_pending()
        return time.monotonic() - t0

    def evidence(self, step: int) -> dict:
        """Coordinator: replay evidence for the state at `step`, from this incarnation's replays since the
        previous certified step, including those after `step` (a checkpoint waits for each target's next clean
        replay). A run that never called the per-step hook has no replay at all: `not_applicable`, saying why
        (the run's policy accepts it; `resume --latest-clean --require replay` does not), with one WARNING."""
        if not self.stepped:
            if not self._warned_unstepped:
                self._warned_unstepped = True
                log.logger.warning(
                    "replay covers nothing: ckpt.step(step) was never called before the save of step %d (replay "
                    "captures from it). Saves are certified without SDC coverage (evidence: replay not_applicable, "
                    "replay_no_step_hook); call ckpt.step(step) after each optimizer step",
                    step,
                )
            return policy.evidence(
                policy.NOT_APPLICABLE,
                [
                    {
                        "code": "replay_no_step_hook",
                        "targets": [t[1] for t in self.targets()],
                        "detail": "ckpt.step() was never called: no step was captured, no target replayed",
                    }
                ],
            )
        prev = self.ledger.latest("certified", below=step)
        rows = self.ledger.replays(run_id=self.run_id, after=prev["step"] if prev else None)
        return replay_coverage(rows, self.targets(), step=step)

    def settle_pending(self) -> None:
        """Coordinator: re-decide this incarnation's checkpoints that wait on replay evidence."""
        for row in self.ledger.checkpoints(states=("committed",)):
            if row["run_id"] != self.run_id:
                continue
            ev = self.ledger.evidence(row["step"])
            if (ev.get("replay") or {}).get("status") != policy.MISSING:
                continue
            new = self.evidence(row["step"])
            if new["status"] == policy.MISSING and new["reasons"] == ev["replay"].get("reasons"):
                continue
            self.ledger.put_evidence(row["step"], {"replay": new}, source="replay")
            v = policy.evaluate(self.policy, self.ledger.evidence(row["step"]))
            if v.state != row["state"]:  # reasons alone change with the evidence rows just written
                journal.record_transition(
                    self.ledger,
                    self.root,
                    row["step"],
                    v.state,
                    v.reasons,
                    source="replay",
                    expect="committed",
                    attempt=row["attempt"],
                )
        # the fast tier's saves wait on the same coverage: their rows are re-decided alike
        local_rows.settle_replay(self.ledger, self.run_id, self.policy, self.evidence, policy.MISSING)

    @property
    def process_groups(self) -> list:
        """Replay's own gloo group (not training collectives: an observer ignores it)."""
        return self.runner.process_groups

    def close(self) -> None:
        self.runner.close()


class PendingSweep:
    """A save-boundary sweep running in its own thread (ReplayEvidence.start_sweep), beside the save's write and
    joined before save() returns: never beside training (the replay's RNG state is the process's)."""

    def __init__(self, evidence: ReplayEvidence, step: int) -> None:
        self._evidence = evidence
        self._rows: list[dict] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(step,), name="scout-replay-sweep", daemon=True)
        self._thread.start()

    def _run(self, step: int) -> None:
        try:
            self._rows = self._evidence.runner.sweep(step)
        except BaseException as e:  # raised in the saving thread by finish(), on every rank where it happened
            self._error = e

    def join(self) -> None:
        """Wait for the sweep (a collective: bounded by replay's group timeout when a peer is gone)."""
        self._thread.join()

    def finish(self) -> None:
        """Join, raise the sweep's error if it failed, else record its rows (coordinator: the ledger)."""
        self.join()
        if self._error is not None:
            raise self._error
        self._evidence._record(self._rows)
