"""Pure decisions of the shard update replay (no torch, no processes): which units a rank checks at a step, who
verifies them, the verdict on one owner's update from digests, and the evidence for a saved step from the rows.

See `scout_ckpt.replay.shard_optimizer` for the protocol; these functions are kept apart so that they are
unit-tested alone and importable on read-only paths (no torch import).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from scout_ckpt import policy

KIND = "shard_replay"


@dataclass(frozen=True)
class Unit:
    param: str  # parameter name (model name or "group.index")
    offset: int  # into the flattened local shard
    length: int


def plan_units(numels: list[tuple[str, int]], chunk: int) -> list[Unit]:
    """Cut each local shard (name, numel) into units of at most `chunk` elements; empty shards give none."""
    return [Unit(name, o, min(chunk, n - o)) for name, n in numels for o in range(0, n, chunk)]


def permutation(n: int, seed: int, rank: int) -> list[int]:
    """The fixed order in which `rank` checks its units: any rank can recompute it."""
    order = list(range(n))
    random.Random(f"{seed}:{rank}").shuffle(order)
    return order


def positions(step: int, start: int, per_step: int, n: int) -> list[int]:
    """Positions into the permutation checked at `step`: consecutive, wrapping, so `ceil(n / per_step)`
    consecutive steps cover all n."""
    if n == 0:
        return []
    first = ((step - start) * per_step) % n
    return sorted({(first + j) % n for j in range(min(per_step, n))})


def verifiers(owner: int, step: int, world: int, peers: int) -> list[int]:
    """The ranks other than `owner` that recompute its slices at `step` (rotating with the step)."""
    if world < 2:
        return []
    k = min(peers, world - 1)
    return [(owner + 1 + (step + j) % (world - 1)) % world for j in range(k)]


def decide(owner: int, live: list[str] | None, recomputed: dict[int, list[str] | None]) -> tuple[str, list[dict]]:
    """Verdict on one owner's update at one step from digests (one per unit): (status, reasons).

    live: the owner's digests of its live results; recomputed: rank -> its digests of its recomputation of the
    owner's units (the owner's own entry is its self-check). None = that computation is missing (failed)."""
    if live is None:
        return policy.MISSING, [{"code": "shard_replay_missing", "ranks": [owner], "detail": "no live capture"}]
    mine = recomputed.get(owner)
    if mine is not None and mine != live:
        units = [i for i, (a, b) in enumerate(zip(live, mine)) if a != b]
        agree = sorted(v for v, d in recomputed.items() if v != owner and d == mine)
        return policy.FAIL, [
            {
                "code": "shard_update_mismatch",
                "ranks": [owner],
                "units": units,
                "detail": "live update differs from the owner's recomputation",
                "recomputation_confirmed_by": agree,
            }
        ]
    missing = sorted(v for v, d in recomputed.items() if d is None)
    votes = {owner: live, **{v: d for v, d in recomputed.items() if v != owner and d is not None}}
    reasons: list[dict] = []
    status = policy.PASS
    if missing:
        status = policy.INCONCLUSIVE
        reasons.append({"code": "shard_replay_failed", "ranks": missing, "owner": owner})
    if len({tuple(d) for d in votes.values()}) <= 1:
        return status, reasons
    counts: dict[tuple, list[int]] = {}
    for v, d in votes.items():
        counts.setdefault(tuple(d), []).append(v)
    best = max(counts.values(), key=len)
    if len(best) * 2 <= len(votes):
        return policy.INCONCLUSIVE, reasons + [
            {
                "code": "shard_replay_inconclusive",
                "ranks": sorted(votes),
                "owner": owner,
                "split": sorted(sorted(c) for c in counts.values()),
            }
        ]
    for v in sorted(votes):
        if v not in best:
            code = "shard_update_mismatch" if v == owner else "shard_recompute_mismatch"
            reasons.append({"code": code, "ranks": [v], "owner": owner, "majority": sorted(best)})
    return policy.FAIL, reasons


def worst(statuses) -> str:
    order = [policy.FAIL, policy.INCONCLUSIVE, policy.MISSING, policy.PASS]
    statuses = list(statuses)
    return next((s for s in order if s in statuses), policy.PASS)


# ---- evidence from rows ----------------------------------------------------------------------------------------


def shard_replay_evidence(rows: list[dict], step: int, cycle: int, start: int | None = None) -> dict:
    """Evidence (policy format) for the state saved at `step`, from this incarnation's rows (since `begin`).

    fail / inconclusive: any such row so far (a wrong update persists in the shard, so every later state carries
    it; a fault found after `step` is also charged to `step` when it may have begun before it, i.e. within one
    cycle). pass: the `cycle` steps ending at `step` all have passing rows, so every unit of every rank was
    recomputed clean in that window -- or, with `start` (the step this incarnation began after) less than a cycle
    back, every step since `start` has: the first saves are then decided at their commit instead of waiting for a
    cycle, and a fault the rest of the cycle turns up revokes them (`charged_steps`). Otherwise missing."""
    bad = [r for r in rows if r["status"] in (policy.FAIL, policy.INCONCLUSIVE) and r["step"] - cycle < step]
    detail = {"cycle": cycle}
    if bad:
        status = policy.FAIL if any(r["status"] == policy.FAIL for r in bad) else policy.INCONCLUSIVE
        reasons = [x for r in bad for x in r["reasons"] if x["code"] != "shard_replay_missing"] or [
            {"code": f"{KIND}_{status}", "steps": [r["step"] for r in bad]}
        ]
        return policy.evidence(
            status,
            reasons[:32],
            ranks=sorted({k for r in bad for k in r["ranks"]}),
            steps=[r["step"] for r in bad][:32],
            **detail,
        )
    clean = {r["step"] for r in rows if r["status"] == policy.PASS}
    first = step - cycle + 1 if start is None else max(step - cycle + 1, start + 1)
    window = list(range(first, step + 1))
    covered = sum(s in clean for s in window)
    if window and covered == len(window):
        # A fault found up to a cycle later is charged to this step too (charged_steps): until then a
        # certification on this evidence can still be revoked.
        return policy.evidence(
            policy.PASS, [], steps=[window[0], window[-1]], revocable_until=step + cycle - 1, **detail
        )
    return policy.evidence(
        policy.MISSING,
        [{"code": "shard_replay_coverage_incomplete", "covered_steps": covered, "needed_steps": len(window)}],
        **detail,
    )


def charged_steps(row: dict, cycle: int) -> tuple[int, int]:
    """(lo, hi]: the saved steps a fault row may already be in (it may have begun up to one cycle before it was
    seen: its unit was last recomputed clean at most a cycle earlier)."""
    return row["step"] - cycle, row["step"]


class ShardReplayLog:
    """This incarnation's rows, as the checkpointer keeps them: every fault row, and the clean rows a save's
    window can still need (the last 2 cycles), so memory stays bounded over a long run."""

    def __init__(self, cycle: int, start: int = 0):
        self.cycle, self.start = cycle, start
        self.rows: list[dict] = []

    def add(self, rows: list[dict]) -> list[dict]:
        """Keep `rows`; return those that found something (fail / inconclusive), to report as events."""
        self.rows += rows
        if self.rows:
            latest = max(r["step"] for r in self.rows)
            self.rows = [r for r in self.rows if r["status"] != policy.PASS or r["step"] > latest - 2 * self.cycle]
        return [r for r in rows if r["status"] in (policy.FAIL, policy.INCONCLUSIVE)]

    def evidence(self, step: int) -> dict:
        return shard_replay_evidence(self.rows, step, self.cycle, self.start)

    def reset(self, start: int = 0) -> None:
        """After a resume at `start`: the rows of the state before it no longer describe the shards."""
        self.rows, self.start = [], start


__all__ = [
    "KIND",
    "ShardReplayLog",
    "Unit",
    "charged_steps",
    "decide",
    "permutation",
    "plan_units",
    "positions",
    "shard_replay_evidence",
    "verifiers",
    "worst",
]
