"""A ROOT's attributed events as fleet records: one per (event, rank), with the hardware the rank ran on.

Read from the ROOT's ledger (its `events` rows and the `run_ranks` placement of each run): the same reading serves
a job's recorder (fleet/recorder.py, the events since its last round) and `scout-ckpt fleet import` (a ROOT's
whole history, ROOTs written before the fleet store existed included). A rank whose run recorded no device
identity (an older ledger) is named by its host and local rank.
"""

from __future__ import annotations

from pathlib import Path

from scout_ckpt.fleet.identity import cpu_device

# The attributed kinds: what an operator may act on. live_fault, save_interrupted and the bookkeeping kinds restate
# an sdc or name no hardware.
KINDS = ("sdc", "hang", "crash", "desync", "straggler", "health")
OBSERVER_KINDS = ("hang", "crash", "desync", "straggler", "health")
CLASSES = ("persistent", "transient", "not_hardware")


def root_key(root: str | Path) -> str:
    return str(Path(root).resolve())


def _class(detail: dict, rank: int) -> str | None:
    """The triage class of `rank` in an event's detail (replay/triage.py: per rank, else the row's)."""
    triage = detail.get("triage")
    if not isinstance(triage, dict):
        return None
    per = (triage.get("ranks") or {}).get(str(rank))
    c = per.get("class") if isinstance(per, dict) else triage.get("class")
    return c if c in CLASSES else None


def from_events(root: str, events: list[dict], places: dict[tuple[str | None, int], dict]) -> list[dict]:
    """Pure: ledger events (decoded: "ranks" a list, "detail" a dict) -> fleet records. `places`: (run_id, rank)
    -> the run_ranks row ({"host", "local_rank", "device": identity dict or None})."""
    out = []
    for e in events:
        if e.get("kind") not in KINDS:
            continue
        raw = e.get("detail")
        detail: dict = raw if isinstance(raw, dict) else {}
        devices: dict = detail["devices"] if isinstance(detail.get("devices"), dict) else {}
        # an inconclusive replay row names no rank; the rank its triage ran again stands in (replay/triage.py)
        triaged = (detail.get("triage") or {}).get("ranks") if isinstance(detail.get("triage"), dict) else None
        ranks = e.get("ranks") or sorted(int(r) for r in (triaged or {}))
        for rank in ranks:
            cls = _class(detail, rank)
            place = places.get((e.get("run_id"), rank)) or {}
            ident = devices.get(str(rank)) or place.get("device") or {}
            host = ident.get("host") or place.get("host")
            local = ident.get("local_rank", place.get("local_rank"))
            hw = {
                "host": host,
                "local_rank": local,
                "device": ident.get("device") or (cpu_device(host, local) if host else None),
                "uuid": ident.get("uuid"),
                "serial": ident.get("serial"),
            }
            rec = {
                "key": f"{root}|{e.get('run_id')}|{e.get('id')}|{rank}",
                "time": e.get("time"),
                "root": root,
                "job": ident.get("job") or root,
                "run_id": e.get("run_id"),
                "step": e.get("step"),
                "event_id": e.get("id"),
                "kind": e["kind"],
                "source": detail.get("source") or ("observer" if e["kind"] in OBSERVER_KINDS else None),
                "class": cls,
                "rank": rank,
                "detail": {
                    k: detail[k] for k in ("target", "recipe", "status", "triage", "reason", "metric") if k in detail
                },
            }
            if cls == "not_hardware":  # the other rank reproduced it: no device is to blame; where it ran, kept apart
                rec["detail"]["ran_on"] = hw
                rec.update(dict.fromkeys(hw))
            else:
                rec.update(hw)
            out.append(rec)
    return out


def read_root(root: str | Path, after: int = 0) -> tuple[list[dict], int]:
    """(records of the events with id > `after`, the newest event id read) from ROOT's ledger, opened read-only.
    Raises LedgerError / LedgerUnavailable (exit 2) where ROOT has no readable ledger."""
    from scout_ckpt.ledger import Ledger

    key = root_key(root)
    with Ledger.open(root, readonly=True) as led:
        if led.last_event_id() <= after:  # nothing new: the common round of a job's recorder, one small query
            return [], after
        events = [e for e in led.events(KINDS) if int(e["id"]) > after]
        last = max([after] + [int(e["id"]) for e in events])
        places: dict[tuple[str | None, int], dict] = {}
        for run in {e.get("run_id") for e in events if e.get("run_id")}:
            for p in led.rank_places(run):
                places[(run, p["rank"])] = p
    return from_events(key, events, places), last
