"""The live check: replays compared with what the source's live step produced, not only with each other.

Replays compared with each other catch a rank that computes differently whenever it computes. A fault that struck
the live step only -- the step the checkpoint carries -- is repeated by no replay, so the replays are also compared
with the live step: the source signs each target's live output as its forward returns it (capture.py, live=True),
and for those signatures the source's vote is its live value while every other peer's is its replay
(`live:output[i]` in a row's signatures). With 3+ peers a live step that disagrees with the replays is attributed
to the source; with 2 it is inconclusive. Either way the save's replay evidence fails, which policy.live_faults
reads as the live state being bad. The sweep's source rotates over the peers save by save (`sweep_source`), so
every peer's live step at a save is checked within len(peers) saves (`live_rotation` in the coverage detail,
`live_checked_ranks` the sources checked at the saved step); the rotation's source rotates too, step by step.

A target whose live forward is compiled (per-block torch.compile, module.compile()) gets no live check: the replay
runs it eagerly, which rounds differently (`excluded`); `ReplayOptions.live_check=False` turns the check off for
every target. Not checked live: the live gradients (only the replays' gradients are compared), and modules
outside every target (a final norm between the last block and the head).

Why apart from runner.py: the runner moves captures between peers and compares signatures; this module decides
which of those signatures speak for the live step and what the evidence says about it, on both sides of the
ledger (the runner's rows, schedule.coverage's detail). Importable without torch, as schedule.coverage must be
(read-only commands): the tensors it is handed carry their own methods, and torch is imported only to join them.
"""

from __future__ import annotations

from collections.abc import Iterable

LIVE_PREFIX = "live:"


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
    return torch.cat([sigs, live if mine else sigs[:len(live)]])


def row_detail(labels: list[str], disagreeing: Iterable[int], src: int) -> dict:
    """What a replay row records of the live check: whose live step it checked (`live_checked`), and whether the
    live step alone disagreed (`live_disagree`: the replays agree with each other, not with what the source's step
    made). Empty when the row compared no live output."""
    if not any(lab.startswith(LIVE_PREFIX) for lab in labels):
        return {}
    bad = [labels[j] for j in disagreeing]
    return {"live_checked": src,
            "live_disagree": (any(n.startswith(LIVE_PREFIX) for n in bad)
                              and not any(n.startswith("output[") for n in bad))}


def sweep_source(forecast, done_step: int | None, peers: list[int]) -> int:
    """The peer whose live step the sweep of the next step to be saved checks: peers[k % len(peers)], k the saves
    so far (a save still due whose sweep has not run counted), so consecutive saves take consecutive peers and
    every peer's live step is checked within len(peers) saves of one incarnation. The same on every rank (a
    function of the save history, as the arming is). `forecast`: the runner's schedule.SaveForecast; `done_step`:
    the step whose sweep capture is complete and not yet swept, if any."""
    k = len(forecast.saves)
    if done_step is not None and forecast.due(done_step, True) and \
            (not forecast.saves or done_step > forecast.saves[-1]):
        k += 1   # armed for step S+1 before the save of S ran (a save every step)
    return peers[k % len(peers)]


def reason_flag(row: dict) -> dict:
    """`live_step: true` for a coverage reason that comes from a row whose source's live step disagreed."""
    return {"live_step": True} if (row.get("detail") or {}).get("live_disagree") else {}


def coverage_detail(rows_at_step: Iterable[dict]) -> dict:
    """For the coverage of a saved step, from the replay rows at that step: whose live step they checked
    (`live_checked_ranks`, the sources of the rows that compared a live output) and how often each rank's is
    (`live_rotation`: the sweep's source rotates over the peers, one per save)."""
    at = [r for r in rows_at_step if "live_checked" in (r.get("detail") or {})]
    detail: dict = {"live_checked_ranks": sorted({r["detail"]["live_checked"] for r in at})}
    peers = max((len(r["detail"].get("peers") or []) for r in at), default=0)
    if peers:
        detail["live_rotation"] = f"every rank's live step within {peers} saves"
    return detail


__all__ = ["coverage_detail", "excluded", "reason_flag", "row_detail", "signed", "sweep_source", "vote_labels",
           "votes"]
