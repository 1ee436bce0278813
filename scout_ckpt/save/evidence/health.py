"""What the observer saw, as evidence about a checkpoint: `health`.

A hardware fault (uncorrectable ECC, a lost GPU, a failed row remap, NVLink CRC/replay errors, an Xid) or a
collective desync on a rank during the interval a checkpoint covers may have corrupted the state that rank owns.
That interval runs from the evidence of the run's newest certified checkpoint (or the run's start) up to the moment
this save's evidence is taken (HealthWindow), both measured in the ledger's receipt order (event ids as the
coordinator's ledger assigned them), never by the `time` an event carries: that is the clock of the host whose
observer wrote it, and a host 120 s behind would otherwise date an Xid before the window and let the next save be
certified: state corrupted at step 15 is still corrupted at step 30 unless
something compared it, so a fault uncleared at one save keeps failing the later saves of the same run (a restart
from the last certified checkpoint starts a new run and a new window). Such a checkpoint's `health` evidence fails
for that rank's state unless something independent cleared it after the event:

- consensus compared the rank's state with its replicas at this save and agreed (DDP; HSDP within a replica
  group), or
- invariants that vouch for single-owner shards (sphere, spectral bound, ...) passed on it (pure FSDP).

A hang or a clean crash alone does not taint state: the process stopped, it did not compute wrongly. Warnings that
say nothing of data (temperature, a pending row remap) do not taint either. Pure function: the checkpointer passes
the events from the ledger and the save's own consensus and invariants evidence.
"""

from __future__ import annotations

from scout_ckpt.policy import FAIL, PASS, evidence

# NVML metrics (scout_ckpt/observer/health.py) whose change means data may be wrong.
DATA_FAULT_METRICS = frozenset(
    {
        "ecc_uncorrected_volatile",
        "ecc_uncorrected_aggregate",
        "gpu_lost",
        "remap_failure",
        "xid",
        "dl_crc_flit",
        "dl_crc_data",
        "dl_replay",
        "dl_recovery",
    }
)


def taints(event: dict) -> bool:
    """Does this ledger event put the state of its ranks in doubt?"""
    if event.get("kind") == "desync":
        return True
    if event.get("kind") != "health":
        return False
    detail = event.get("detail") or {}
    return detail.get("metric") in DATA_FAULT_METRICS or "xid" in detail


def health_evidence(
    events: list[dict],
    *,
    since: int | None,
    until: int,
    mode: str,
    consensus: dict | None,
    invariants: dict | None,
    vouching: bool,
) -> dict:
    """`health` evidence of a checkpoint whose evidence was taken when the ledger's newest event id was `until`,
    covering events received after id `since` (None: the run's start). `mode` is the run's topology ("ddp",
    "hsdp", "fsdp", ...): where state has replicas, a passing consensus at this save clears it; where it has
    none, only passing vouching invariants do."""
    window = [
        e
        for e in events
        if taints(e) and (since is None or int(e.get("id") or 0) > since) and int(e.get("id") or 0) <= until
    ]
    if not window:
        return evidence(PASS, events_seen=0)
    refs = [
        {
            "event": e.get("id"),
            "kind": e["kind"],
            "ranks": e.get("ranks") or [],
            "step": e.get("step"),
            "metric": (e.get("detail") or {}).get("metric"),
        }
        for e in window
    ]
    replicated = mode.startswith(("ddp", "hsdp"))
    if replicated and (consensus or {}).get("status") == PASS:
        return evidence(PASS, events_seen=len(window), cleared_by="consensus", events=refs)
    if vouching and (invariants or {}).get("status") == PASS:
        return evidence(PASS, events_seen=len(window), cleared_by="invariants", events=refs)
    reasons = []
    for ref in refs:
        reasons.append(
            {
                "code": "health_fault" if ref["kind"] == "health" else "desync",
                "ranks": ref["ranks"],
                "event": ref["event"],
                "metric": ref["metric"],
                "step": ref["step"],
            }
        )
    return evidence(FAIL, reasons, events_seen=len(window), events=refs)


class HealthWindow:
    """Which events a save's `health` evidence weighs: those received after the evidence of the run's newest
    certified checkpoint, up to this save's evidence (positions in the ledger's receipt order, event ids). The end
    is when the save's live evidence (consensus) was taken, not its commit: consensus can only clear what was
    received before it compared, so an event received between the evidence and the commit counts against the next
    save. Coordinator-only bookkeeping, no I/O."""

    def __init__(self) -> None:
        self.since: int | None = None

    def evidence(self, events: list[dict], *, until: int, **kw) -> dict:
        return health_evidence(events, since=self.since, until=until, **kw)

    def settled(self, state: str, until: int) -> None:
        """The save whose evidence was taken at receipt position `until` got `state`: a certified one vouches for
        everything received up to then, so the window moves on."""
        if state == "certified" and (self.since is None or until > self.since):
            self.since = until
