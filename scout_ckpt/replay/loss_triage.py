"""Triage from the loss: a non-finite loss or a spike far outside the run's recent window re-executes the rank's
work on it and on another rank, as a disputed replay row does (replay/triage.py), and records the class.

Why: replay compares replicas at scheduled steps; a loss that turns non-finite or jumps is often the first sign a
job gives of a device that computes wrongly, and the operator's question is the same: this device, for good or
once, or the data?

The rule (`anomaly`, pure, on each rank's own loss, the value passed to `ckpt.step(step, loss=...)`):

- a loss that is not finite (NaN, +-inf): `non_finite`;
- a spike: with at least LOSS_MIN_HISTORY finite losses in the window of the last LOSS_WINDOW (anomalies left
  out), the robust z-score (loss - median) / max(1.4826 x MAD, LOSS_REL_FLOOR x |median|, 1e-12) above LOSS_Z.
  Upward only: a loss that falls is not a fault.

The round (`LossTriage.on_step`, collective over the replay peer group at every step a loss is given): each peer
gathers every peer's verdict on its own loss. When some rank R's loss is anomalous at step S (and no loss triage
ran in the last LOSS_COOLDOWN steps), every peer arms a capture of every module target for step S+1 (inputs,
parameters and live output signatures, cloned), and at on_step(S+1) R's captures are executed again with the
same inputs, RUNS times on R and RUNS times on another rank Q (on another host where the job has one,
triage.other_rank). The step's own inputs are gone by the time its loss is seen: the work re-executed is R's next
step. `classify` decides from the exact signatures:

| outcome | class |
|---|---|
| Q gives two different answers to the same work | `not_hardware` (nondeterministic numerics) |
| R's answers differ from Q's | `persistent` (R computes the same work differently now) |
| R's and Q's answers agree, and differ from R's live step | `transient` (R's live step was wrong once) |
| they agree with R's live step, and R's output is not finite | `not_hardware` (Q reproduces the non-finite result from the same inputs: data or numerics, e.g. a NaN batch whose update reached every replica) |
| they agree with R's live step, finite | `transient` (R computes its work right on re-run: the anomaly did not persist) |

The result is an `sdc` event (detail.source "loss", the reason, each flagged rank's loss and z-score, and
detail.triage as replay rows carry it), which the fleet record takes like any other. It does not change a
checkpoint's certification: that rests on consensus and replay coverage, which see a device that still computes
wrongly at the next save. Costs: one gather of three numbers per step (when a loss is given); on an anomaly, one
step captured on every rank (a copy of the targets' parameters and inputs) and 2 x RUNS replays of every module target per triaged rank (at most MAX_RANKS).
Never raises: a replay that fails leaves its rank unclassified.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

from scout_ckpt.consensus.signatures import replica_signatures
from scout_ckpt.replay import live as live_step
from scout_ckpt.replay.capture import ModuleCapture
from scout_ckpt.replay.execute import replay_target
from scout_ckpt.replay.transport import broadcast_each, host
from scout_ckpt.replay.triage import MAX_RANKS, RUNS, node_ranks, other_rank

LOSS_WINDOW = 50  # the recent finite losses a spike is measured against
LOSS_MIN_HISTORY = 10  # no spike verdict on fewer
LOSS_Z = 10.0  # robust z-score above which a loss is a spike
LOSS_REL_FLOOR = 0.05  # the spread is at least this share of |median|: a flat loss does not make noise a spike
LOSS_COOLDOWN = LOSS_WINDOW  # steps after a loss triage before the next one (a bad stretch is one incident)
REASONS = {1: "non_finite", 2: "spike"}


def anomaly(loss: float, recent: Sequence[float]) -> tuple[str | None, float | None]:
    """Pure: (reason or None, robust z-score or None) of `loss` against the `recent` finite losses."""
    if not math.isfinite(loss):
        return "non_finite", None
    if len(recent) < LOSS_MIN_HISTORY:
        return None, None
    med = statistics.median(recent)
    mad = statistics.median(abs(v - med) for v in recent)
    z = (loss - med) / max(1.4826 * mad, LOSS_REL_FLOOR * abs(med), 1e-12)
    return ("spike" if z > LOSS_Z else None), z


def classify(on_rank: list, on_other: list, live_agrees: bool | None, non_finite: bool) -> str | None:
    """Pure: the class of a loss triage (module docstring's table). `on_rank`, `on_other`: the signatures of RUNS
    executions of R's work on R and on Q (None: an execution failed); `live_agrees`: R's re-run equals its live
    step (None: no live signature to compare with); `non_finite`: R's re-run output holds a non-finite value."""
    if any(s is None for s in on_rank + on_other) or not on_rank or not on_other:
        return None
    if len(set(on_other)) > 1:
        return "not_hardware"
    if set(on_rank) != set(on_other):
        return "persistent"
    if live_agrees is False:
        return "transient"
    return "not_hardware" if non_finite else "transient"


class LossTriage:
    """One per replay runner, on every rank: the loss window, and the captures armed after an anomaly."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=LOSS_WINDOW)
        self._armed: tuple[int, dict[str, ModuleCapture], int, dict[int, dict]] | None = None
        self._quiet_until = 0

    @property
    def armed(self) -> bool:
        return self._armed is not None

    def disarm(self) -> None:
        if self._armed is not None:
            for cap in self._armed[1].values():
                cap.disarm()
        self._armed = None

    def on_step(self, runner, step: int, loss) -> list[dict]:
        """After optimizer step `step`, on every peer with the same `loss is None`: the triage of a capture armed
        for this step, then this step's loss verdicts. Returns events (the same on every peer)."""
        out: list[dict] = []
        if self._armed is not None:
            armed, self._armed = self._armed, None
            for cap in armed[1].values():
                cap.disarm()
            if armed[0] == step:
                out.append(self._round(runner, step, armed[1], armed[2], armed[3]))
        if loss is None or len(runner.peers) < 2:
            return out
        value = float(loss)  # a tensor is read once here (a device sync, as logging it would be)
        reason, z = anomaly(value, self.recent)
        if reason is None:
            self.recent.append(value)
        code = next((k for k, v in REASONS.items() if v == reason), 0)
        finite = math.isfinite(value)
        mine = torch.tensor([code, value if finite else 0.0, z if z is not None else 0.0], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in runner.peers]
        dist.all_gather(every, mine, group=runner.group)
        flagged = {
            # a non-finite loss is recorded as None (JSON has no NaN)
            r: {
                "reason": REASONS[int(t[0])],
                "loss": None if int(t[0]) == 1 else float(t[1]),
                "z": None if int(t[0]) == 1 else float(t[2]),
            }
            for r, t in zip(runner.peers, every)
            if int(t[0])
        }
        if flagged and step >= self._quiet_until:  # the same decision on every peer: gathered values, step numbers
            self._quiet_until = step + LOSS_COOLDOWN
            self._arm(runner, step + 1, step, flagged)
        return out

    def _arm(self, runner, step: int, seen_at: int, flagged: dict[int, dict]) -> None:
        caps: dict[str, ModuleCapture] = {}
        for recipe, name in runner.targets():
            if recipe == "optimizer":
                continue
            site = runner.sites[name]
            caps[name] = ModuleCapture(
                site.outer, site.inner, params=True, refs=False, live=name not in runner.live_excluded
            )
            caps[name].arm()
        self._armed = (step, caps, seen_at, flagged)

    def _round(self, runner, step: int, caps: dict, seen_at: int, flagged: dict[int, dict]) -> dict:
        ranks = sorted(flagged)[:MAX_RANKS]
        names = list(caps)
        nodes = node_ranks(runner.group, runner.peers)
        pick = {r: other_rank(r, runner.peers, nodes, set(flagged)) for r in ranks}
        mine: dict[int, dict] = {}
        for r in ranks:
            payloads = None
            if runner.rank == r:  # R's own captures: only R holds them
                payloads = [
                    host(c.invocation) if c.invocation is not None and c.invocation.intact() else None
                    for c in caps.values()
                ]
            arrivals = broadcast_each(payloads, r, runner.group)
            if runner.rank in (r, pick[r]):
                mine[r] = _runs(runner, caps, names, arrivals, own=runner.rank == r)
            arrivals.wait_all()
        everyone: list = [None] * len(runner.peers)
        dist.all_gather_object(everyone, mine, group=runner.group)
        by_rank = dict(zip(runner.peers, everyone))
        tri: dict = {"ranks": {}}
        for r in ranks:
            q = pick[r]
            on_r = (by_rank.get(r) or {}).get(r) or {}
            on_q = (by_rank.get(q) or {}).get(r) or {} if q is not None else {}
            tri["ranks"][str(r)] = {
                "class": classify(
                    on_r.get("runs") or [], on_q.get("runs") or [], on_r.get("live"), bool(on_r.get("nf"))
                ),
                "other": q,
                "other_host": None if q is None else nodes[q][0],
                "other_node": None if q is None else nodes[q][1],
                "work": f"own capture of step {step}",
            }
        found = [v["class"] for v in tri["ranks"].values() if v["class"]]
        tri["class"] = next((c for c in ("persistent", "transient", "not_hardware") if c in found), None)
        return {
            "kind": "sdc",
            "step": seen_at,
            "ranks": ranks,
            "detail": {
                "source": "loss",
                "reason": flagged[ranks[0]]["reason"],
                "metric": {str(r): flagged[r] for r in sorted(flagged)},
                "replayed_step": step,
                "targets": names,
                "triage": tri,
            },
        }


def _runs(runner, caps: dict, names: list[str], arrivals, own: bool) -> dict:
    """RUNS executions of every module target R sent, on this rank: {"runs": [signatures per execution or None],
    "live": R's re-run equals its live output (on R; None where no target has a live signature), "nf": R's re-run
    output holds a non-finite value}."""
    runs: list = []
    live: bool | None = None
    nf = False
    for n in range(RUNS):
        digest: list = []
        try:
            for i, name in enumerate(names):
                payload = arrivals.get(i)
                if payload is None:
                    continue
                labels, tensors = replay_target("module", caps[name], payload, runner.deterministic, None)
                sigs = replica_signatures(tensors)
                digest.append((name, tuple(int(v) for v in sigs.reshape(-1).tolist())))
                if own and n == 0:
                    outs = [t for lab, t in zip(labels, tensors) if lab.startswith("output[")]
                    nf = nf or any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in outs)
                    inv = caps[name].invocation
                    if inv is not None and inv.live is not None:
                        ok = live_step.self_check(labels, sigs, inv) == live_step.SELF_AGREE
                        live = ok if live is None else (live and ok)
            runs.append(tuple(digest) if digest else None)
        except Exception as e:  # noqa: BLE001 - every peer must still reach the gather that follows
            warnings.warn(f"loss triage replay failed: {e!r}", stacklevel=2)
            runs.append(None)
    return {"runs": runs, "live": live, "nf": nf}


__all__ = ["LOSS_WINDOW", "LOSS_Z", "LossTriage", "anomaly", "classify"]
