"""The one plain sentence each event of the fault timeline leads with: what happened, on which rank and host, what it
means for the checkpoints, and what to do. The recorded fields follow it (the terminal's detail column, the HTML
page's disclosure, `report --json`'s "detail"); the sentence is the event's "summary". Pure, torch-free."""

from __future__ import annotations

from scout_ckpt.ops.views import ranks_text

# what the fault means for the checkpoints, and what to do, by kind
_MEANING = {
    "crash": (
        "checkpoints already certified are untouched and a save it interrupted is never resumed from",
        "let torchrun restart the job (it resumes from the latest clean checkpoint); look at that rank's log",
    ),
    "hang": (
        "no checkpoint is written while it waits; the certified ones are untouched",
        "look at the stacks recorded for it; restart the job if the observer did not end it",
    ),
    "desync": (
        "the ranks stopped running the same collectives; certified checkpoints are untouched",
        "look at the code path that differs between ranks",
    ),
    "straggler": (
        "checkpoints are not affected; the whole job runs at that rank's pace",
        "check that host's load, thermals and network",
    ),
    "sdc": (
        "checkpoints saved from that state are rejected and never resumed from",
        "resume from the latest clean checkpoint (torchrun's restart does) and check the host's hardware",
    ),
    "divergence": (
        "checkpoints saved from that state are rejected",
        "resume from the latest clean checkpoint; every rank agreeing points at the training itself "
        "(learning rate, data), not at one device",
    ),
    "live_fault": (
        "the save's evidence showed the live state bad: the generation ended and that checkpoint is rejected",
        "torchrun's restart resumes from the latest clean checkpoint",
    ),
    "corrupt_file": (
        "the checkpoint's bytes on disk no longer match what was written: it is rejected and walked past",
        "nothing, unless it repeats: then check the storage",
    ),
    "health": ("checkpoints are not rejected for it by itself", "watch that device; drain the host if it repeats"),
}


def _who(ranks: list[int], hosts: dict[int, str]) -> str:
    if not ranks:
        return "no single rank"
    names = sorted({hosts[r] for r in ranks if hosts.get(r)})
    return f"rank {ranks_text(ranks)}" + (f" on {', '.join(names)}" if names else "")


def _what(e: dict, who: str) -> str:
    d, kind, step = e.get("detail") or {}, e["kind"], e.get("step")
    at = f" at step {step}" if step is not None else ""
    if kind == "crash":
        if d.get("save_interrupted"):
            return f"{who}: a save{at} was interrupted (the process died while writing it)"
        return f"{who}: the process died{at}"
    if kind == "hang":
        return f"{who}: stopped making progress{at}" + (
            " (the observer ended the job)" if d.get("action") == "abort" else ""
        )
    if kind == "desync":
        return f"{who}: ran different collectives than the others{at}"
    if kind == "straggler":
        return f"{who}: ran slower than the other ranks{at}"
    if kind == "sdc":
        if d.get("inconclusive") or d.get("reason") == "consensus_inconclusive":
            return f"replicas disagreed{at} ({who}), with no majority to say which one is wrong"
        return f"{who}: computed different numbers than its replicas{at} (silent data corruption)"
    if kind == "divergence":
        return f"every rank's state failed an invariant{at}"
    if kind == "live_fault":
        return f"{who}: the save{at} showed the live training state bad"
    if kind == "corrupt_file":
        f = d.get("file")
        return f"checkpoint {step}: a file changed on disk" + (f" ({f})" if f else "")
    if kind == "health":
        return f"{who}: " + str(d.get("message") or "a device health event") + at
    return f"{who}: {kind.replace('_', ' ')}{at}"


def event_sentence(e: dict, hosts: dict[int, str] | None = None) -> str:
    """One sentence for a timeline event (report/timeline.py's shape): what, which rank and host, what it means
    for the checkpoints, what to do. `hosts`: rank -> host of the event's run, where recorded."""
    hosts = hosts or {}
    what = _what(e, _who(list(e.get("ranks") or []), hosts))
    meaning, todo = _MEANING.get(e["kind"], ("", ""))
    out = what[0].upper() + what[1:]
    if meaning:
        out += f"; {meaning}"
    if todo:
        out += f". What to do: {todo}"
    return out + "."
