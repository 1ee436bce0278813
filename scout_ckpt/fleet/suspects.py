"""Which devices to drain: the fleet's verdicts ranked per device (pure functions over fleet store rows).

The rule (docs/fleet.md, "The score"):

- A verdict's weight is its kind's (sdc 3, crash 2, hang 2, health 2, desync 1, straggler 0.5) times its class's
  (persistent 2, not triaged 1, transient 0.25). `not_hardware` verdicts name no device and count for none.
- A device's score is the sum of its verdicts' weights, plus 2 for every job beyond the first that named it
  (the same device failing in different jobs is the signal a single job cannot give).
- A device's class: `persistent` if any of its verdicts was triaged persistent, or untriaged verdicts name it in
  two or more runs; else `transient`.
- Most suspect first: persistent before transient, then by score, then by the newest verdict.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

KIND_WEIGHT = {"sdc": 3.0, "crash": 2.0, "hang": 2.0, "health": 2.0, "desync": 1.0, "straggler": 0.5}
CLASS_WEIGHT = {"persistent": 2.0, None: 1.0, "transient": 0.25}
JOB_BONUS = 2.0


def weight(kind: str, cls: str | None) -> float:
    return KIND_WEIGHT.get(kind, 1.0) * CLASS_WEIGHT.get(cls, 1.0)


def rank(rows: list[dict], *, min_score: float = 0.0) -> list[dict]:
    """Fleet store rows -> [{"host", "local_rank", "device", "uuid", "serial", "class", "jobs", "verdicts",
    "score", "first_seen", "last_seen"}], most suspect first, those scoring below `min_score` left out.
    `verdicts`: {kind: {class or "untriaged": count}}."""
    by_device: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("class") == "not_hardware" or not r.get("device"):
            continue
        by_device[r["device"]].append(r)
    out: list[dict[str, Any]] = []
    for device, rs in by_device.items():
        jobs = sorted({str(r.get("job")) for r in rs})
        counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for r in rs:
            counts[r["kind"]][r.get("class") or "untriaged"] += 1
        untriaged_runs = {r.get("run_id") for r in rs if r.get("class") is None}
        persistent = any(r.get("class") == "persistent" for r in rs) or len(untriaged_runs) >= 2
        score = sum(weight(r["kind"], r.get("class")) for r in rs) + JOB_BONUS * (len(jobs) - 1)
        last = max(rs, key=lambda r: r.get("time") or 0)
        out.append(
            {
                "host": last.get("host"),
                "local_rank": last.get("local_rank"),
                "device": device,
                "uuid": last.get("uuid"),
                "serial": last.get("serial"),
                "class": "persistent" if persistent else "transient",
                "jobs": jobs,
                "verdicts": {k: dict(v) for k, v in sorted(counts.items())},
                "count": len(rs),
                "score": round(score, 3),
                "first_seen": min(r.get("time") or 0 for r in rs),
                "last_seen": last.get("time"),
            }
        )
    out = [s for s in out if s["score"] >= min_score]
    out.sort(key=lambda s: (s["class"] != "persistent", -s["score"], -(s["last_seen"] or 0), s["device"]))
    return out


def not_hardware(rows: list[dict]) -> list[dict]:
    """The verdicts triage cleared of hardware blame (another rank reproduced them): numerics or data."""
    return [
        {k: r.get(k) for k in ("kind", "source", "job", "root", "run_id", "step", "time")}
        for r in rows
        if r.get("class") == "not_hardware"
    ]


def explain(rows: list[dict], device: str) -> list[dict]:
    """The verdicts behind DEVICE (its name as listed, its GPU UUID or serial, or `host:local_rank`), oldest
    first, each with its ROOT and step."""

    def names(r):
        return {r.get("device"), r.get("uuid"), r.get("serial"), f"{r.get('host')}:{r.get('local_rank')}"}

    keep = (
        "time",
        "kind",
        "source",
        "class",
        "job",
        "root",
        "run_id",
        "step",
        "rank",
        "host",
        "local_rank",
        "device",
        "uuid",
        "serial",
        "detail",
    )
    return [{k: r.get(k) for k in keep} for r in rows if r.get("class") != "not_hardware" and device in names(r)]


# ---- drain commands (printed, never run) -----------------------------------------------------------------------

_SAFE = re.compile(r"[^A-Za-z0-9 ._:,/=+-]")


def _reason(hosted: list[dict]) -> str:
    parts = []
    for s in hosted:
        kinds = "+".join(sorted(s["verdicts"]))
        parts.append(
            f"{s['class']} {kinds} on {s['device']} (local {s['local_rank']}), {len(s['jobs'])} job(s), "
            f"score {s['score']:g}"
        )
    return _SAFE.sub("", "scout-ckpt: " + "; ".join(parts))


def _by_host(suspects: list[dict]) -> dict[str, list[dict]]:
    hosts: dict[str, list[dict]] = {}
    for s in suspects:
        if s["class"] == "persistent" and s.get("host"):
            hosts.setdefault(s["host"], []).append(s)
    return hosts


def _node(host: str) -> str:
    return _SAFE.sub("", host).replace(" ", "")


def slurm(suspects: list[dict]) -> list[str]:
    """One `scontrol update ... State=DRAIN` line per host holding a persistent suspect."""
    return [
        f'scontrol update NodeName={_node(h)} State=DRAIN Reason="{_reason(ss)}"'
        for h, ss in _by_host(suspects).items()
    ]


def k8s(suspects: list[dict]) -> list[str]:
    """`kubectl cordon` and a NoSchedule taint per host holding a persistent suspect."""
    out = []
    for h, ss in _by_host(suspects).items():
        devices = ",".join(s["device"] for s in ss)
        out.append(f"kubectl cordon {_node(h)}")
        out.append(f"kubectl taint nodes {_node(h)} scout-ckpt/suspect={_taint_value(devices)}:NoSchedule --overwrite")
    return out


def _taint_value(text: str) -> str:
    """A taint value: at most 63 characters of [A-Za-z0-9._-], starting and ending alphanumeric."""
    v = re.sub(r"[^A-Za-z0-9._-]", "_", text)[:63].strip("._-")
    return v or "device"
