"""The journal: operator decisions and verdicts, durable beside the data (ROOT/scout-journal.jsonl).

The ledger is one SQLite file; if it is lost, `ledger rebuild` recreates its rows from the manifests. A manifest
can say what its save found, but not what happened later (an operator's quarantine, a load that did not match,
certify's verdict), and a manifest can be edited. The journal keeps those: one JSON object a line, appended,
flushed and fsynced, never rewritten. Rebuild replays it: quarantines stand, rejections stand, and a step is
certified again only if a certified verdict for that very manifest digest is on record.

Record kinds: "verdict" {step, attempt, manifest_digest, state, reasons, source}, "quarantine" {step, attempt,
manifest_digest, reason}, "release" {step, attempt, manifest_digest, state, reason}; each with "time" and "seq".
A torn last line (a crash mid-append) is skipped on reading.

Chain. Each record carries "prev": the link (`link`, a SHA-256 of its canonical JSON) of the record before it,
"" for the first; `append` computes it under the same flock as the seq. `verify` walks the records in seq order:
a line edited or removed anywhere but at the end breaks the chain at the next record. A rebuild takes
certificates from the journal only where the chain is intact (a removed record could have been a rejection of
any step); rejections and quarantines it takes from every record, intact or not, since they only lower trust.
Records written before the chain existed carry no "prev" and are not checked. The chain is no signature: whoever
can write the file can rewrite it whole; it catches a damaged, hand-edited or partly lost journal.

Order. "time" is the writer's clock, and hosts disagree (an hour, after a bad NTP day), so no reader orders by it.
"seq" is the root's own sequence number: assigned by `append` while it holds an exclusive flock on the journal
(the last record's seq + 1; the number of records before it for a journal of records without one), so appenders
on one root (a job's coordinator, the CLI, on any host whose locks reach the file) get increasing numbers in the
order they wrote. The object store's copy is named by time (object_store/bucket_journal.py); read back without
the local file, its records are put in seq order again (`ordered`). Records from before seq existed keep their
place (file order) ahead of the numbered ones. `standing`, through which every reader judges a step, reads in
that order.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

from scout_ckpt import policy
from scout_ckpt.format.layout import fsync_dir
from scout_ckpt.ledger import tiers
from scout_ckpt.object_store import bucket_journal  # imports no fsspec: a store is opened only for a bound root

JOURNAL_NAME = "scout-journal.jsonl"


def path(root: str | os.PathLike) -> Path:
    return Path(root) / JOURNAL_NAME


def append(root: str | os.PathLike, record: dict) -> dict:
    """Append one record (a "kind" and its fields; "time" is added): one write of one line, then fsync, so a
    crash leaves the journal with or without the line, at worst a torn last line that `read` skips."""
    record = {"time": time.time(), **record}
    if "kind" not in record:
        raise ValueError("a journal record needs a 'kind'")
    p = path(root)
    created = not p.exists()
    fd = os.open(p, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the seq, the link and the line are one step for every appender
        record["seq"], last = _next_seq(fd)
        record["prev"] = link(last) if last is not None else ""
        data = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # a torn last line (power loss): end it, keep ours whole
            data = b"\n" + data
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)  # releases the flock
    if created:
        fsync_dir(p.parent)
    # An object-store run's ledger_dir may be lost with its node: the record is copied beside the checkpoints too
    # (object_store/bucket_journal.py), so that `ledger rebuild` finds it there. A copy that fails raises: a
    # quarantine or rejection missing from the bucket would let a rebuilt ledger certify the step again.
    bucket_journal.mirror(root, record)
    return record


_TAIL = 1 << 16


def _parse(line: bytes) -> dict | None:
    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) else None


def link(record: dict) -> str:
    """What the next record's "prev" names: the SHA-256 of this record's canonical JSON (the line `append`
    wrote, without its newline)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()


def _next_seq(fd: int) -> tuple[int, dict | None]:
    """(seq, last record) for the record about to be appended to the journal open at `fd` (its lock held): the
    last numbered record's seq + 1, read from the file's tail; for a journal whose tail holds no numbered
    record, from the whole file (the number of records when none has a seq). The last record is the one the new
    record's "prev" links to (None for an empty journal)."""
    size = os.fstat(fd).st_size
    tail = os.pread(fd, min(size, _TAIL), max(0, size - _TAIL))
    lines = tail.splitlines()[1 if size > _TAIL else 0 :]  # the first line of a tail may be cut
    for line in reversed(lines):
        rec = _parse(line)
        if rec is not None and isinstance(rec.get("seq"), int):
            return rec["seq"] + 1, rec
    best, count, last = None, 0, None
    for line in (os.pread(fd, size, 0) if size > _TAIL else tail).splitlines():
        rec = _parse(line)
        if rec is None:
            continue
        count, last = count + 1, rec
        if isinstance(rec.get("seq"), int):
            best = max(best or 0, rec["seq"])
    return (best + 1 if best is not None else count), last


def verify(records: list[dict]) -> dict:
    """Whether the chain over `records` (every record, `read` or a store's copy merged) holds:
    {"intact": bool, "records": n, "chained": how many carry a "prev", "broken_at": the seq of the first record
    whose "prev" does not name the record before it in seq order (None when intact), "detail": one line}.
    Two records claiming one predecessor (two writers that numbered apart) break it too: neither can say what
    the other wrote."""
    recs = ordered(records)
    chained, before = 0, None
    for rec in recs:
        prev = rec.get("prev")
        if isinstance(prev, str):
            chained += 1
            if prev != (link(before) if before is not None else ""):
                where = rec.get("seq")
                return {
                    "intact": False,
                    "records": len(recs),
                    "chained": chained,
                    "broken_at": where,
                    "detail": f"record seq {where} (step {rec.get('step')}, {rec.get('kind')}) does not name "
                    "the record before it: a record was edited or removed there",
                }
        before = rec
    return {"intact": True, "records": len(recs), "chained": chained, "broken_at": None, "detail": ""}


def ordered(records: list[dict]) -> list[dict]:
    """Records in the root's order: those without a seq (written before it existed) first, in the order given
    (file order); then the numbered ones by seq (a stable sort: a seq seen twice keeps the order given)."""
    keyed = sorted(
        enumerate(records), key=lambda e: (1, e[1]["seq"], e[0]) if isinstance(e[1].get("seq"), int) else (0, 0, e[0])
    )
    return [r for _, r in keyed]


def restore(root: str | os.PathLike, records: list[dict]) -> bool:
    """Write `records` (a store's copy, read back when the ledger_dir was lost with its journal) as ROOT's
    journal, in seq order, each as the line `append` wrote, so that the next record continues their seq and their
    chain. Only where ROOT has no journal or an empty one (a journal is never rewritten); whether it wrote. A temp
    file renamed into place: a crash leaves no journal or the whole one. Nothing is copied to the store again."""
    p = path(root)
    if not records or (p.exists() and p.stat().st_size > 0):
        return False
    tmp = p.with_name(f".{JOURNAL_NAME}.restore-{os.getpid()}")
    data = "".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in ordered(records)).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, p)
    fsync_dir(p.parent)
    return True


def check_appendable(root: str | os.PathLike) -> None:
    """Raise the OSError an append would meet opening the journal (a directory in its place, a read-only mount),
    before a caller changes the ledger: a change that must be journaled after its commit (a release) is then not
    made at all. Creates the journal if it is missing, as the append would."""
    fd = os.open(path(root), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.close(fd)


def read(root: str | os.PathLike) -> list[dict]:
    """Every record, in the order written; [] when there is no journal. Lines that do not parse as a JSON
    object (a torn last line) are skipped."""
    p = path(root)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(rec, dict) and "kind" in rec and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def journal_verdict(
    root: str | os.PathLike,
    step: int,
    attempt: str | None,
    manifest_digest: str | None,
    state: str,
    reasons: list[dict],
    source: str,
) -> dict:
    """Record a verdict applied in the ledger (a commit, certify, a failed re-verification, a load mismatch).
    Call it after the ledger write succeeded: a verdict the ledger refused is not a verdict."""
    return append(
        root,
        {
            "kind": "verdict",
            "step": step,
            "attempt": attempt,
            "manifest_digest": manifest_digest,
            "state": state,
            "reasons": reasons,
            "source": source,
        },
    )


def standing(records: list[dict], step: int, digest: str | None) -> dict:
    """What the journal says of one step with this manifest digest, in a way no clock can reorder:
    {"state", "reasons", "certified", "quarantine"}. "state" is the last verdict (or release) recorded for that
    digest, except that a rejection of the digest outlives every certification of it, whichever was written
    first: records are read in seq order (`ordered`), but a journal copied from a store may hold records of
    writers that numbered apart, and a host whose clock is an hour slow must not sort a load mismatch before
    the certification it overturns. A quarantine and its release are paired in seq order.
    "certified": a certified verdict for this digest is on record (what a rebuild needs to vouch for evidence it
    cannot re-run). "quarantine": the step's last quarantine not released since, or None."""
    state, reasons, certified, rejection, quarantine = None, [], False, None, None
    for rec in ordered(records):
        if rec.get("step") != step:
            continue
        kind = rec.get("kind")
        if kind == "quarantine":
            quarantine = rec
        elif kind == "release":
            quarantine = None
        if kind in ("verdict", "release") and rec.get("manifest_digest") == digest:
            state, reasons = rec.get("state"), list(rec.get("reasons") or [])
            certified = certified or state == "certified"
            if state == "rejected" and rejection is None:
                rejection = rec
    if rejection is not None:
        state, reasons = "rejected", list(rejection.get("reasons") or [])
    return {"state": state, "reasons": reasons, "certified": certified, "quarantine": quarantine}


def record_transition(
    ledger,
    root: str | os.PathLike,
    step: int,
    to: str,
    reasons: list[dict],
    *,
    source: str,
    expect: str | tuple[str, ...],
    attempt: str | None = None,
) -> bool:
    """`ledger.transition` and its verdict in the journal (with the row's attempt and manifest digest). The one
    call for a verdict change outside a commit.

    A rejection is journaled *before* the ledger changes: if the append fails (a full disk) the ledger is left as
    it was and the error is raised, and if the process dies between the two, the journal already holds the
    rejection (which `standing` lets outlive any certification), so a ledger lost afterwards cannot come back
    certifying the step. A transition that raises trust is journaled after the ledger took it, as before: a
    certification the ledger refused is not one."""
    if to == "rejected":
        row = ledger.checkpoint(step)
        allowed = (expect,) if isinstance(expect, str) else tuple(expect)
        if row is None or row["state"] not in allowed or (attempt is not None and row["attempt"] != attempt):
            return False
        journal_verdict(root, step, row["attempt"], row["manifest_digest"], to, reasons, source)
        with ledger.write():  # the step's verdict and its fast-tier copy's, in one transaction
            applied = ledger.transition(step, to, reasons, source=source, expect=expect, attempt=attempt)
            if applied:
                reach_copies(ledger, step, reasons, source)
        return applied
    applied = ledger.transition(step, to, reasons, source=source, expect=expect, attempt=attempt)
    if applied:
        row = ledger.checkpoint(step)
        journal_verdict(root, step, row["attempt"], row["manifest_digest"], to, reasons, source)
    return applied


def reach_copies(ledger, step: int, reasons: list[dict], source: str) -> bool:
    """A rejection of the step itself (policy.step_distrusted: anything but one copy's bytes) holds for every
    copy of it: the fast tier's row of the same step (node-local files, peer copies) is rejected with the same
    reasons, inside the caller's write transaction. Without it, a copy row outlived the verdict wherever the
    durable row could not speak for it: a rebuild from manifests that no longer finds the durable folder, or a
    durable folder gc removed. A rejection for one copy's bytes stays with that copy. Whether a row changed."""
    if not policy.step_distrusted("rejected", reasons):
        return False
    copy = tiers.row(ledger, step)
    if copy is None or copy["state"] not in ("certified", "committed", "writing"):
        return False
    changed = tiers.set_state(ledger, step, "rejected", reasons, expect=copy["state"])
    if changed:
        ledger.add_event("local_rejected", step=step, detail={"reasons": reasons[:8], "source": source})
    return changed
