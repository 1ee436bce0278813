"""Settling `writing` rows: the one function that decides what became of a save nobody finished recording.

A `writing` row is written before any rank writes data, with its owner (host, pid, process start time). Three
places meet such rows: the Checkpointer's start-up, `certify`, and `gc`. All three call `settle_writing`, so they
cannot reach different verdicts on one row, and it acts only on a save whose owner is provably dead (a save still
running in another process is never settled under it):

  owner alive, or unknown (another host, no record) -> left as it is: a save may be in flight
  owner dead, step dir with a manifest of the same attempt whose bytes verify
                                                      -> committed / certified / rejected, by the run's policy
                                                         on the manifest's evidence (record_commit, CAS)
  owner dead, anything else                          -> rejected [save_interrupted] (transition, CAS)

"Provably dead": the save's lease is free (or the save predates leases), and the owner record says same host, and
the pid is gone, a zombie, or a different process (its start time differs). The lease is what makes this
namespace-proof: two containers on one host share the host name but not the pids, so the second one finds no
process with the first one's pid and would call a live save dead. The coordinator of a save holds an flock
(LOCK_EX) on ROOT/.leases/<attempt>.lock (`take_lease`) from before its `writing` row until the commit is recorded;
a kernel drops the lock when the holder dies, however it dies, and every process that sees the file sees the
lock. A held lease is alive whatever the pid says; a free one is necessary for death, never sufficient alone (the
pid check stays an extra "alive" signal); a lease that cannot be checked (EACCES, EIO) means "cannot tell".

On an object store (a ledger_dir bound to a URI, scout_ckpt.object_store) the row's path is the attempt prefix;
its manifest is read and its bytes verified there by ranged reads. A ROOT bound to a URI is detected here, so
every caller (certify included) settles against the right storage without knowing about it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from pathlib import Path

from scout_ckpt import policy
from scout_ckpt.errors import BadInput
from scout_ckpt.format import layout, manifest, node_manifest
from scout_ckpt.format.verify import could_not_check, verify_files
from scout_ckpt.ledger import journal


def _proc_stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (after the parenthesised command name), or None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    return data[data.rfind(")") + 2 :].split()


def process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), "" where unknown. With
    the pid it names one process for good: a recycled pid has a different start time."""
    fields = _proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else ""


def this_process_owner() -> dict:
    """{"host", "pid", "start"} of the calling process: the owner to record with a `writing` row or temp dir."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": process_start(pid)}


def owner_alive(owner: dict | None) -> bool | None:
    """True: the owner runs. False: provably dead (same host, and the pid is gone, a zombie, or another process
    since its start time differs). None: cannot tell (another host, or no owner recorded)."""
    if not owner or not owner.get("host") or not owner.get("pid"):
        return None
    if owner["host"] != socket.gethostname():
        return None
    pid = int(owner["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    fields = _proc_stat(pid)
    if fields is None:  # no /proc to compare start times: the pid exists, so assume the save is in flight
        return True
    if fields[0] == "Z":  # killed, not yet reaped: it writes nothing more
        return False
    recycled = bool(owner.get("start")) and len(fields) > 19 and fields[19] != str(owner["start"])
    return not recycled


# ---- leases ------------------------------------------------------------------------------------------------

HELD, FREE, UNKNOWN = "held", "free", "unknown"


class Lease:
    """A save's lease, held (flock LOCK_EX on an open descriptor) until `release`: unlinked first, so that a
    checker never finds a free lock on a file that still names a save in flight. Idempotent."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd  # type: Path, int | None

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass  # already gone, or a read-only ROOT: the lock goes with the descriptor all the same
        os.close(self.fd)
        self.fd = None


def take_lease(root: str | os.PathLike, attempt: str) -> Lease:
    """Coordinator, before the `writing` row of `attempt` exists: create ROOT/.leases/<attempt>.lock and hold an
    exclusive flock on it (blocking: a checker holds it only for an instant). The file holds the owner record,
    for a person reading it; only the lock counts."""
    path = layout.lease_path(root, attempt)
    if path is None:
        raise BadInput(f"attempt id {attempt!r} is not a plain name")
    path.parent.mkdir(exist_ok=True)
    return Lease(path, hold_with_record(path, {"attempt": attempt}))


def hold_with_record(path: Path, record: dict) -> int:
    """Open (creating) `path`, hold an exclusive flock on it (blocking) and write `record` with this process as
    its owner: the descriptor, which holds the lock until it is closed. Nothing stays open if any step fails."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps({**record, **this_process_owner()}) + "\n").encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


def try_exclusive(fd: int) -> bool:
    """Take an exclusive flock on `fd` without waiting: True taken, False another descriptor holds it. Any other
    error is raised: the caller decides what "could not check" means for its lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def lease_state(root: str | os.PathLike, attempt: str | None) -> str | None:
    """HELD (a live process holds the lease), FREE (its holder is gone: the lock could be taken), UNKNOWN (the
    file is there but could not be checked), or None (no lease: the save predates leases, or finished)."""
    path = layout.lease_path(root, attempt)
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError:
        return UNKNOWN
    try:
        return FREE if try_exclusive(fd) else HELD
    except OSError:
        return UNKNOWN
    finally:
        os.close(fd)  # closing drops the lock if it was taken


def attempt_alive(root: str | os.PathLike, attempt: str | None, owner: dict | None) -> bool | None:
    """Whether the save `attempt` by `owner` may still run: True alive, False provably dead, None cannot tell.
    A held lease is alive; a lease that cannot be checked is "cannot tell"; otherwise the owner record decides
    (owner_alive), so a free lease alone never proves death and an old record without a lease keeps its rules."""
    lease = lease_state(root, attempt)
    if lease == HELD:
        return True
    if lease == UNKNOWN:
        return None
    return owner_alive(owner)


def save_alive(root: str | os.PathLike, row: dict) -> bool | None:
    """Whether the save that wrote a `writing` row may still run (attempt_alive on the row's attempt and owner).
    The one liveness test of a row, for settle_writing and retention."""
    return attempt_alive(root, row.get("attempt"), _owner_of(row))


def tmp_dir_alive(root: str | os.PathLike, tmp: Path) -> bool | None:
    """attempt_alive for a temp dir: the attempt from its owner record (or its name), the owner record."""
    owner = layout.read_owner(tmp)
    attempt = (owner or {}).get("attempt")
    if not attempt:
        m = layout.TMP_RE.match(Path(tmp).name)
        attempt = m.group(2) if m else None
    return attempt_alive(root, attempt, owner)


def _owner_of(row: dict) -> dict:
    return {"host": row.get("owner_host"), "pid": row.get("owner_pid"), "start": row.get("owner_start")}


def _run_policy(ledger, row: dict, fallback: dict) -> dict:
    run = ledger.run(row["run_id"]) if row.get("run_id") else None
    return (run or {}).get("policy") or fallback


def _read_manifest(root: Path, row: dict, store):
    """(manifest, digest) of the row's step dir or attempt prefix; (None, None) when absent or malformed.
    ManifestUnreadable (an I/O error: could not check now) is raised to the caller."""
    if not row.get("path"):
        return None, None
    try:
        if store is not None:
            return store.read_manifest(row["path"]) if store.has_manifest(row["path"]) else (None, None)
        return manifest.read(root / row["path"])  # no step dir: BadInput (no manifest); EIO: ManifestUnreadable
    except manifest.ManifestUnreadable:
        raise
    except BadInput:
        return None, None


_COULD_NOT_CHECK = object()  # settle_writing: the manifest or the bytes could not be read now


def settle_writing(ledger, root: str | os.PathLike, *, source: str, store=None) -> list[dict]:
    """Settle every `writing` row whose owner is provably dead; return what was done, one dict per row:
    {"step", "attempt", "before": "writing", "after", "why"} ("after" is "writing" for a row left alone).
    `source` names the caller in the history ("startup", "certify", "gc"). Every change is compare-and-set on
    (writing, attempt), so two settlers, or a settler and the save itself, cannot both apply a verdict."""
    root = Path(root)
    out = []
    rows = ledger.checkpoints(states=("writing",))
    if store is None and rows:
        from scout_ckpt.object_store import bound_store

        store = bound_store(root)
    for row in rows:
        step, attempt = row["step"], row["attempt"]
        alive = save_alive(root, row)
        if alive is not False:
            out.append(
                {
                    "step": step,
                    "attempt": attempt,
                    "before": "writing",
                    "after": "writing",
                    "why": "owner_alive" if alive else "owner_unknown",
                }
            )
            continue
        try:
            m, digest = _read_manifest(root, row, store)
        except manifest.ManifestUnreadable:
            m, digest = _COULD_NOT_CHECK, None
        interrupted = [{"code": "save_interrupted", "attempt": attempt}]
        if m is not _COULD_NOT_CHECK and m is not None and m.get("attempt") == attempt:
            ev = dict(m["evidence"])
            ev["bytes"] = (
                store.verify(row["path"], m["files"])
                if store is not None
                else verify_files(root / row["path"], m["files"])
            )
            if could_not_check(ev["bytes"]):
                m = _COULD_NOT_CHECK
        if m is _COULD_NOT_CHECK:  # an I/O error is not evidence: the row waits for a settler that can read
            out.append(
                {"step": step, "attempt": attempt, "before": "writing", "after": "writing", "why": "could_not_check"}
            )
            continue
        if m is not None and m.get("attempt") == attempt:
            if ev["bytes"]["status"] == policy.PASS:
                # The run's policy as the ledger holds it (the manifest's only if the run is unknown).
                v = policy.evaluate(_run_policy(ledger, row, m["policy"]), ev)
                applied = ledger.record_commit(
                    step,
                    run_id=m.get("run_id") or row["run_id"],
                    path=row["path"],
                    nbytes=(
                        node_manifest.stored_bytes(m["files"])
                        if store is not None
                        else layout.dir_bytes(root / row["path"])
                    ),
                    manifest_digest=digest,
                    files=m["files"],
                    evidence=ev,
                    state=v.state,
                    reasons=v.reasons,
                    source=source,
                    attempt=attempt,
                )
                if applied:
                    journal.journal_verdict(root, step, attempt, digest, v.state, v.reasons, source)
                out.append(
                    {
                        "step": step,
                        "attempt": attempt,
                        "before": "writing",
                        "after": v.state if applied else ledger.checkpoint(step)["state"],
                        "why": "completed_from_manifest" if applied else "superseded",
                    }
                )
                continue
            interrupted += ev["bytes"]["reasons"]
        applied = journal.record_transition(
            ledger, root, step, "rejected", interrupted, source=source, expect="writing", attempt=attempt
        )
        out.append(
            {
                "step": step,
                "attempt": attempt,
                "before": "writing",
                "after": "rejected" if applied else ledger.checkpoint(step)["state"],
                "why": "save_interrupted" if applied else "superseded",
            }
        )
    return out
