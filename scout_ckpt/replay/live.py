"""The live check: replays compared with what the source's live step produced, not only with each other.

Replays compared with each other catch a rank that computes differently whenever it computes. A fault that struck
the live step only -- the step the checkpoint carries -- is repeated by no replay, so the replays are also compared
with the live step: the source signs each target's live output as its forward returns it (capture.py, live=True),
and for those signatures the source's vote is its live value while every other peer's is its replay
(`live:output[i]` in a row's signatures): the cross-check. Alone, with 3+ peers a live step that disagrees with
the replays is attributed to the source, with 2 it is inconclusive (the source's own self-check, below, then
names it). Either way the save's replay evidence fails, which policy.live_faults reads as the live state being
bad. The sweep's source rotates over the peers save by save (`sweep_source`), so every peer's live step is
cross-checked within len(peers) saves; the rotation's source rotates too, step by step. `live_checked_ranks` in
the coverage detail: the ranks whose live step the replays at the saved step checked, by either check.

The self-check: every rank's own live step at every save. The cross-check above sees the source's live step only,
so an intermittent fault in another rank's live step at that save would go unchecked there (and be saved). So at
the save step EVERY rank captures its own target invocations (inputs by reference, plus a copy of the targets'
parameters as its forward used them, and the live output's and gradients' signatures: capture.py), and at the
sweep every rank also replays its OWN capture on a hook-free copy and compares that replay with its own live
signatures (`self_check`). Same rank, same inputs, same weights, same arithmetic: a healthy rank reproduces its
live step bit for bit, so a difference means that rank's hardware gave two answers to one computation. The rule:
the row is ATTRIBUTED to that rank whatever the number of peers, 2 included -- the rank disagrees with itself, so
no majority is needed to name it; whether its live step or its replay was the wrong one, the rank is faulty, and
the save is rejected either way (fail closed: the live state may carry the fault). Each rank's outcome per target
travels in the round's one small header gather (rows.py), so every rank records the same row. The source's
self-check is its cross replay (its own capture), at no extra cost; every other rank runs one more replay per
target per save. `ReplayOptions.self_check=False` turns it off (the sweep then keeps the parameter copy on the
source only, and the cross-check's rotation is the only live check).

The self-check compares, per target: the live output (`output[i]`), the live input gradients through this module
(`grad_input[i]`) and, for plain parameters, the per-parameter gradient of this backward (`grad_param:NAME`), with
the replay of the same capture (which backprops the captured output gradient). Not signed: FSDP2's (any DTensor's)
parameter gradients, parameters shared with a module outside the target (tied embeddings), the parameter
gradients of a call followed by another forward of the same module before its backward, and, on CUDA without
deterministic algorithms, every live gradient (atomics make a healthy backward differ from a replay of it); each
target's row says which (`live_grads`).

A target whose live forward is compiled (per-block torch.compile, module.compile()) gets no live check: the replay
runs it eagerly, which rounds differently (`excluded`); `ReplayOptions.live_check=False` turns the check off for
every target. Not checked live: modules outside every target (a final norm between the last block and the head).

Why apart from runner.py: the runner moves captures between peers and compares signatures; this module decides
which of those signatures speak for the live step and what the evidence says about it, on both sides of the
ledger (the runner's rows, schedule.coverage's detail). Importable without torch, as schedule.coverage must be
(read-only commands): the tensors it is handed carry their own methods, and torch is imported only to join them.
"""

from __future__ import annotations

from collections.abc import Iterable

LIVE_PREFIX = "live:"

# A rank's self-check outcome for one target, as it travels in the round's header (rows.py).
SELF_AGREE, SELF_OUTPUT, SELF_GRAD, SELF_UNCHECKED, SELF_NONE = 0, 1, 2, 3, 4
SELF_WHAT = {SELF_OUTPUT: "output", SELF_GRAD: "gradient"}


def self_check(labels: list[str], sigs, inv) -> int:
    """This rank's replay of its own capture (`labels`, their signatures `sigs`) against its own live signatures
    (`inv`: the capture's Invocation): SELF_AGREE, SELF_OUTPUT (an output differs), SELF_GRAD (the outputs agree,
    a gradient differs), SELF_UNCHECKED (no live output signature: nothing to compare). A gradient the replay did
    not compute (an empty tensor: no output gradient was captured) is not compared."""
    import torch

    if inv is None or inv.live is None:
        return SELF_UNCHECKED
    outs = [j for j, lab in enumerate(labels) if lab.startswith("output[")]
    n = int(inv.live.shape[0])
    if n > len(outs) or not torch.equal(sigs[outs[:n]].long(), inv.live[:n].long()):
        return SELF_OUTPUT
    at = {lab: j for j, lab in enumerate(labels)}
    empty = None
    for lab, sig in inv.live_grads.items():
        j = at.get(lab)
        if j is None:
            continue
        if empty is None:
            from scout_ckpt.consensus.signatures import replica_signatures

            empty = replica_signatures([torch.zeros(0)])[0].long()
        if torch.equal(sigs[j].long(), empty):
            continue
        if not torch.equal(sigs[j].long(), sig.long()):
            return SELF_GRAD
    return SELF_AGREE


def self_detail(codes: dict[int, int]) -> dict:
    """What a row records of the peers' self-checks (`codes`: rank -> outcome): whose live step was checked and
    whose disagreed with its own replay (and in what), empty when no peer ran one."""
    checked = sorted(r for r, c in codes.items() if c in (SELF_AGREE, SELF_OUTPUT, SELF_GRAD))
    unchecked = sorted(r for r, c in codes.items() if c == SELF_UNCHECKED)
    if not checked and not unchecked:
        return {}
    failed = {str(r): SELF_WHAT[c] for r, c in sorted(codes.items()) if c in SELF_WHAT}
    return {"self_check": {"checked": checked, "unchecked": unchecked, "failed": failed}}


def self_failed(detail: dict) -> list[int]:
    """The ranks whose live step disagreed with their own replay, from a row's detail."""
    return sorted(int(r) for r in ((detail.get("self_check") or {}).get("failed") or {}))


def excluded(modules: Iterable[str], live_check: bool, compiled: Iterable[str]) -> dict[str, str]:
    """The module targets whose live output is not compared with a replay, and why: all of them when
    `live_check` is off, else those whose live forward runs compiled."""
    if not live_check:
        return {n: "replay.live_check is off" for n in modules}
    compiled = set(compiled)
    return {n: "its live forward is compiled; the replay runs eagerly" for n in modules if n in compiled}


def votes(labels: list[str], live, mine: bool) -> tuple[bool, object]:
    """The live check's votes for `live:output[i]`: the source (mine=True) votes its live output's signatures
    (`live`), every other peer its replay's signatures of output[i], the first signatures of its replay. A replay
    with fewer outputs than the live call votes for none of them: the peers' counts then differ, and the row is
    inconclusive."""
    n = int(live.shape[0])
    if n > sum(lab.startswith("output[") for lab in labels):
        n = 0
    return mine, live[:n].long()


def vote_labels(labels: list[str], vote: tuple[bool, object]) -> list[str]:
    """The replay's signature names followed by the live votes' (`live:output[i]`)."""
    return labels + [f"{LIVE_PREFIX}output[{j}]" for j in range(len(vote[1]))]


def signed(sigs, vote: tuple[bool, object]):
    """A peer's signatures with its live votes appended, once the replay's are known: the source's live values,
    or (every other peer) the first signatures of its replay again."""
    import torch

    mine, live = vote
    return torch.cat([sigs, live if mine else sigs[: len(live)]])


def row_detail(labels: list[str], disagreeing: Iterable[int], src: int) -> dict:
    """What a replay row records of the cross live check: whose live step it checked (`live_checked`), and whether
    the live step alone disagreed (`live_disagree`: the replays agree with each other, not with what the source's
    step made). Empty when the row compared no live output."""
    if not any(lab.startswith(LIVE_PREFIX) for lab in labels):
        return {}
    bad = [labels[j] for j in disagreeing]
    return {
        "live_checked": src,
        "live_disagree": (
            any(n.startswith(LIVE_PREFIX) for n in bad) and not any(n.startswith("output[") for n in bad)
        ),
    }


def grads_detail(notes: list[str]) -> dict:
    """What a row says of the live gradients its self-check did not sign (the same on every peer: configuration)."""
    return {"live_grads": {"not_signed": notes}} if notes else {}


def sweep_source(forecast, done_step: int | None, peers: list[int]) -> int:
    """The peer whose live step the sweep of the next step to be saved checks: peers[k % len(peers)], k the saves
    so far (a save still due whose sweep has not run counted), so consecutive saves take consecutive peers and
    every peer's live step is checked within len(peers) saves of one incarnation. The same on every rank (a
    function of the save history, as the arming is). `forecast`: the runner's schedule.SaveForecast; `done_step`:
    the step whose sweep capture is complete and not yet swept, if any."""
    k = len(forecast.saves)
    if (
        done_step is not None
        and forecast.due(done_step, True)
        and (not forecast.saves or done_step > forecast.saves[-1])
    ):
        k += 1  # armed for step S+1 before the save of S ran (a save every step)
    return peers[k % len(peers)]


def reason_flag(row: dict) -> dict:
    """`live_step: true` for a coverage reason that comes from a row whose source's live step disagreed."""
    return {"live_step": True} if (row.get("detail") or {}).get("live_disagree") else {}


def coverage_detail(rows_at_step: Iterable[dict]) -> dict:
    """For the coverage of a saved step, from the replay rows at that step: whose live step they checked
    (`live_checked_ranks`: the sources of the rows that compared a live output, and every rank that self-checked
    some target) and how often each rank's is (`live_rotation`); the targets some rank could not self-check
    (`live_unchecked`: target -> ranks) and the live gradients not signed (`live_grads_not_signed`)."""
    rows_at_step = list(rows_at_step)
    at = [r for r in rows_at_step if "live_checked" in (r.get("detail") or {})]
    selfc = [r for r in rows_at_step if "self_check" in (r.get("detail") or {})]
    ringed = [r for r in rows_at_step if "ring" in (r.get("detail") or {})]
    ranks = {r["detail"]["live_checked"] for r in at}
    for r in selfc:
        ranks.update(r["detail"]["self_check"]["checked"])
    for r in ringed:
        ranks.update(r["detail"]["ring"]["checked"])
    detail: dict = {"live_checked_ranks": sorted(ranks)}
    if ringed:
        detail["live_rotation"] = (
            "every rank's live step at every save (each rank's capture replayed by the next rank in a ring)"
        )
        unchecked = {r["target"]: r["detail"]["ring"]["unchecked"] for r in ringed if r["detail"]["ring"]["unchecked"]}
        if unchecked:
            detail["live_unchecked"] = unchecked
        grads = {
            r["target"]: r["detail"]["live_grads"]["not_signed"]
            for r in ringed
            if (r["detail"].get("live_grads") or {}).get("not_signed")
        }
        if grads:
            detail["live_grads_not_signed"] = grads
        return detail
    peers = max((len(r["detail"].get("peers") or []) for r in at + selfc), default=0)
    if selfc:
        detail["live_rotation"] = (
            "every rank's live step at every save (each rank replays its own capture); "
            f"the source's live step against the others' replays: every rank's within "
            f"{peers} saves"
        )
        unchecked = {
            r["target"]: r["detail"]["self_check"]["unchecked"] for r in selfc if r["detail"]["self_check"]["unchecked"]
        }
        if unchecked:
            detail["live_unchecked"] = unchecked
        grads = {
            r["target"]: r["detail"]["live_grads"]["not_signed"]
            for r in selfc
            if (r["detail"].get("live_grads") or {}).get("not_signed")
        }
        if grads:
            detail["live_grads_not_signed"] = grads
    elif peers:
        detail["live_rotation"] = f"every rank's live step within {peers} saves"
    return detail


__all__ = [
    "SELF_AGREE",
    "SELF_GRAD",
    "SELF_NONE",
    "SELF_OUTPUT",
    "SELF_UNCHECKED",
    "coverage_detail",
    "excluded",
    "grads_detail",
    "reason_flag",
    "row_detail",
    "self_check",
    "self_detail",
    "self_failed",
    "signed",
    "sweep_source",
    "vote_labels",
    "votes",
]
