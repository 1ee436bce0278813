"""What the observer saw, as evidence about a checkpoint: `health`.

A hardware fault (uncorrectable ECC, a lost GPU, a failed row remap, NVLink CRC/replay errors, an Xid) or a
collective desync on a rank during the interval a checkpoint covers (after the previous save of the run, up to this
one) may have corrupted the state that rank owns. Such a checkpoint's `health` evidence fails for that rank's state
unless something independent cleared it after the event:

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
DATA_FAULT_METRICS = frozenset({
    "ecc_uncorrected_volatile", "ecc_uncorrected_aggregate", "gpu_lost", "remap_failure", "xid",
    "dl_crc_flit", "dl_crc_data", "dl_replay", "dl_recovery",
})


def taints(event: dict) -> bool:
    """Does this ledger event put the state of its ranks in doubt?"""
    if event.get("kind") == "desync":
        return True
    if event.get("kind") != "health":
        return False
    detail = event.get("detail") or {}
    return detail.get("metric") in DATA_FAULT_METRICS or "xid" in detail


def health_evidence(events: list[dict], *, since: float | None, until: float, mode: str,
                    consensus: dict | None, invariants: dict | None, vouching: bool) -> dict:
    """`health` evidence of a checkpoint committed at `until`, covering events after `since` (None: the run's
    start). `mode` is the run's topology ("ddp", "hsdp", "fsdp", ...): where state has replicas, a passing
    consensus at this save clears it; where it has none, only passing vouching invariants do."""
    window = [e for e in events if taints(e) and (since is None or (e.get("time") or 0) > since)
              and (e.get("time") or 0) <= until]
    if not window:
        return evidence(PASS, events_seen=0)
    refs = [{"event": e.get("id"), "kind": e["kind"], "ranks": e.get("ranks") or [], "step": e.get("step"),
             "metric": (e.get("detail") or {}).get("metric")} for e in window]
    replicated = mode in ("ddp", "hsdp") or mode.startswith("ddp") or mode.startswith("hsdp")
    if replicated and (consensus or {}).get("status") == PASS:
        return evidence(PASS, events_seen=len(window), cleared_by="consensus", events=refs)
    if vouching and (invariants or {}).get("status") == PASS:
        return evidence(PASS, events_seen=len(window), cleared_by="invariants", events=refs)
    reasons = []
    for ref in refs:
        reasons.append({"code": "health_fault" if ref["kind"] == "health" else "desync", "ranks": ref["ranks"],
                        "event": ref["event"], "metric": ref["metric"], "step": ref["step"]})
    return evidence(FAIL, reasons, events_seen=len(window), events=refs)
