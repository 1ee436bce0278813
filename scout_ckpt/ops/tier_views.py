"""How the fast tier's steps are shown by `ls` and `explain`: their JSON rows and their sentences.

Why apart from ops/views.py: the durable tier's rows and texts there are read by acceptance checks and by the
demo's summary, unchanged; the local tier's rows (ledger/tiers.py) have another shape (one file per rank in each
node's own directory, peer copies held by other ranks) and add keys beside the durable ones, never in place of
them. What is shown is what the ledger recorded when the local save committed (or when a restart re-verified it,
or a rebuild re-checked it): the CLI on one host cannot read other nodes' local directories, so nothing here
re-reads the bytes. No torch, no rich (the CLI passes rich's `escape`).
"""

from __future__ import annotations

from typing import Callable

from scout_ckpt.ledger import tiers
from scout_ckpt.ops.views import duration_text, reason_text, time_text

SHOWN_RANKS = 8  # sentences name at most this many ranks' files; --json lists them all


def _sum_sizes(files: list[dict]) -> int | None:
    sizes = [f.get("size") for f in files]
    return sum(sizes) if sizes and all(isinstance(s, int) for s in sizes) else None


def local_row(r: dict) -> dict:
    """One local step as `ls --json` lists it (key "local"): its state, evidence {kind: status}, reasons, and
    where each rank's file and each peer copy lives (host, node, path; a copy's `verified`: it hashed to the
    owner's digest when it was received)."""
    files = r.get("files") or []
    ev = r.get("evidence") if isinstance(r.get("evidence"), dict) else {}
    return {
        "tier": tiers.LOCAL,
        "step": r["step"],
        "state": r["state"],
        "run_id": r.get("run_id"),
        "dir": r.get("dir"),
        "world_size": r.get("world_size"),
        "layout": r.get("layout"),
        "committed": r.get("committed"),
        "updated": r.get("updated"),
        "bytes": _sum_sizes(files),
        "evidence": {k: v.get("status") for k, v in ev.items() if isinstance(v, dict)},
        "reasons": r.get("reasons") or [],
        "files": [
            {
                "rank": f.get("rank"),
                "host": f.get("host"),
                "node": f.get("node"),
                "path": f.get("where") or f.get("path"),
                "size": f.get("size"),
                "digest": f.get("digest"),
            }
            for f in files
        ],
        "copies": [
            {
                "rank": c.get("rank"),
                "holder": c.get("holder"),
                "host": c.get("host"),
                "node": c.get("node"),
                "path": c.get("path"),
                "verified": None if c.get("verified") is None else bool(c.get("verified")),
            }
            for c in r.get("copies") or []
        ],
    }


def local_rows(ledger) -> list[dict]:
    """Every local step of the ledger, newest first, as local_row gives it."""
    return [local_row(r) for r in tiers.rows(ledger)]


def where_text(row: dict) -> str:
    """The `ls` table's cell for a local step: the hosts its rank files lie on and its verified peer copies."""
    hosts = sorted({str(f["host"]) for f in row["files"] if f.get("host")})
    copies = row["copies"]
    ok = sum(1 for c in copies if c["verified"])
    unchecked = sum(1 for c in copies if c["verified"] is None)
    if unchecked:
        return f"{', '.join(hosts) or '?'}; {len(copies)} copies, {unchecked} unchecked"
    return f"{', '.join(hosts) or '?'}; " + (f"copies {ok}/{len(copies)} ok" if copies else "no peer copy")


def _copy_clause(c: dict) -> str:
    if c["verified"] is None:  # a row rebuilt from the files alone: no digest on record to check it with
        return f"a copy lies on host {c['host']} at {c['path']}, not checked (no digest on record)"
    state = (
        "verified against the owner's digest when it was received"
        if c["verified"]
        else "NOT verified: the bytes received did not hash to the owner's digest"
    )
    return f"rank {c['holder']} on host {c['host']} holds a copy at {c['path']}, {state}"


def _base(path: str | None, rel: str | None) -> str:
    """The node-local directory of a file recorded as BASE/RUN_ID/step-N/NAME (the path itself if not so)."""
    p = str(path or "?")
    head, _, _ = p.rpartition("/")
    if rel and head.endswith("/" + rel):
        return head[: -len(rel) - 1] or "/"
    return p


def copies_sentence(row: dict) -> str:
    """`ls`: one sentence per local step saying on which host and in which node-local directory each rank's file
    and each of its peer copies lie, and whether the copy verified at save."""
    rel = row.get("dir")
    by_rank: dict = {}
    for c in row["copies"]:
        by_rank.setdefault(c["rank"], []).append(c)
    files = sorted(row["files"], key=lambda f: (f["rank"] is None, f["rank"]))
    parts = []
    for f in files[:SHOWN_RANKS]:
        clause = f"rank {f['rank']} on {f['host']} in {_base(f['path'], rel)}"
        for c in by_rank.get(f["rank"]) or []:
            state = (
                "not checked: no digest on record"
                if c["verified"] is None
                else "verified at save"
                if c["verified"]
                else "NOT verified at save"
            )
            holder = f"rank {c['holder']}" if c.get("holder") is not None else "a peer"
            clause += f", its copy held by {holder} on {c['host']} in {_base(c['path'], rel)} ({state})"
        if not by_rank.get(f["rank"]):
            clause += ", no peer copy"
        parts.append(clause)
    more = f"; and {len(files) - SHOWN_RANKS} more ranks (`ls --json` lists them)" if len(files) > SHOWN_RANKS else ""
    return (
        f"Local step {row['step']} ({row['state']}, saved {time_text(row.get('committed'))}), {rel} in each "
        f"node's local directory: " + ("; ".join(parts) or "no file recorded") + more + "."
    )


# ---- explain --------------------------------------------------------------------------------------------------


def explain_local(ledger, step: int) -> dict | None:
    """`explain --json`'s "local" document for STEP (None when the local tier has no row for it): the row as
    recorded, its evidence in full, and the events that concern the step's local save (`local_rejected`)."""
    r = tiers.row(ledger, step)
    if r is None:
        return None
    out = local_row(r)
    out["evidence"] = {k: v for k, v in (r.get("evidence") or {}).items() if isinstance(v, dict)}
    have = {c["rank"] for c in out["copies"] if c["verified"]}
    ranks = [f["rank"] for f in out["files"]]
    out["peer_copies"] = {
        "ranks_with_verified_copy": sorted(x for x in ranks if x in have),
        "ranks_without_verified_copy": sorted(x for x in ranks if x not in have),
    }
    out["events"] = [e for e in ledger.events(kinds=("local_rejected",)) if e.get("step") == step]
    return out


def _evidence_sentence(kind: str, item: dict) -> str:
    status = item.get("status") or "?"
    reasons = item.get("reasons") or []
    if kind == "bytes":
        n, size = item.get("files"), item.get("bytes")
        body = (
            f"{n} file(s), {size} bytes, digested by {item.get('hashed_by') or 'the writers'} before they were written"
            if n is not None
            else ""
        )
    elif kind == "consensus":
        groups = item.get("groups") or []
        agree = sum(1 for g in groups if g.get("verdict") == "agree")
        body = (
            f"{item.get('tensors_compared', 0)} tensors compared in {len(groups)} replica group(s), "
            f"{agree} agreed bit for bit"
            if groups
            else (f"mode {item.get('mode')}" if item.get("mode") else "")
        )
    elif kind == "invariants":
        specs = item.get("specs") or []
        body = f"checked {', '.join(map(str, specs))}" if specs else ""
        if "finite" in specs and status == "pass":
            body += ": every rank's state was finite"
    else:
        body = ""
    if item.get("duration_s") is not None and kind != "consensus":
        body += (", " if body else "") + f"in {duration_text(float(item['duration_s']))}"
    text = f"{kind.capitalize()}: {status}" + (f" ({body})" if body else "")
    if reasons:
        text += f"; reasons: {reason_text(reasons)}"
    return text + "."


def explain_local_lines(doc: dict, escape: Callable[[str], str], *, both: bool) -> list[str]:
    """`explain`'s sentences for a local step (rich markup, one string a line). `both`: the durable tier holds
    the step too (its lines come first; the durable one wins at load)."""
    step, state = doc["step"], doc["state"]
    layout = doc.get("layout") or {}
    lines = []
    if both:
        lines.append(
            f"Both tiers hold step {step}: at load the durable one wins (the local copy is used only for "
            f"a step newer than every certified durable one)."
        )
    how = (
        f" ({layout.get('local_world_size')} rank(s) per node, {layout.get('mode')}, mesh {layout.get('mesh_shape')})"
        if layout
        else " (layout unknown: no restart restores it)"
    )
    lines.append(
        f"Local tier: step {step} is {state}. It was saved at {time_text(doc.get('committed'))} by run "
        f"{escape(str(doc.get('run_id')))} on {doc.get('world_size') or '?'} rank(s){how}; last changed "
        f"{time_text(doc.get('updated'))}."
    )
    files = sorted(doc["files"], key=lambda f: (f["rank"] is None, f["rank"]))
    if files:
        said = [
            f"rank {f['rank']} {f['digest'] or 'no digest on record'} ({f['size']} bytes) on host {f['host']} "
            f"at {escape(str(f['path']))}"
            for f in files[:SHOWN_RANKS]
        ]
        more = f"; and {len(files) - SHOWN_RANKS} more ranks" if len(files) > SHOWN_RANKS else ""
        lines.append(
            "Each rank's file, with the digest of its bytes taken before they were written: "
            + "; ".join(said)
            + more
            + "."
        )
    for kind, item in doc["evidence"].items():
        lines.append(escape(_evidence_sentence(kind, item)))
    if not doc["evidence"]:
        lines.append("No evidence of this save is on record (no consensus, invariants, finite check or verdict).")
    copies = doc["copies"]
    if copies:
        by_rank: dict = {}
        for c in copies:
            by_rank.setdefault(c["rank"], []).append(c)
        said = [
            f"rank {r}'s file: " + "; ".join(_copy_clause(c) for c in cs)
            for r, cs in sorted(by_rank.items(), key=lambda x: (x[0] is None, x[0]))[:SHOWN_RANKS]
        ]
        lines.append(escape("Peer copies: " + "; ".join(said) + "."))
        without = doc["peer_copies"]["ranks_without_verified_copy"]
        if without:
            lines.append(
                f"Rank(s) {', '.join(map(str, without))} have no verified peer copy: losing their node loses this step."
            )
    else:
        lines.append("No peer copy was made (one node, or replicas=0): losing the node loses this step.")
    if doc["reasons"]:
        lines.append(f"Reasons: {escape(reason_text(doc['reasons']))}.")
    for e in doc["events"]:
        lines.append(
            escape(
                f"At {time_text(e.get('time'))}, a restart re-verified the step and rejected it "
                f"(local_rejected): {reason_text((e.get('detail') or {}).get('reasons') or [])}."
            )
        )
    lines.append(
        "[dim]As recorded by the job; this command does not read other hosts' local directories. Every "
        "rank re-verifies its file by digest before a restart uses it.[/]"
    )
    return lines


__all__ = ["copies_sentence", "explain_local", "explain_local_lines", "local_row", "local_rows", "where_text"]
