"""The ledger a job starts on: never a fresh one over existing checkpoints (docs/design.md, "Faults of the world").

Why: an empty ledger created over a lost one would find nothing to resume, the job would train from step 0, and
its next save at an existing step would replace a certified checkpoint. So the coordinator opens ROOT's ledger
with `open_run_ledger`, never with `create=True`:

  ledger readable                          -> opened (an older schema migrated)
  missing, empty or not SQLite, or SQLite  -> rebuilt from the manifests and the journal first (ops/rebuild.py,
  recording no checkpoint, beside            the same fail-closed rules as `scout-ckpt ledger rebuild`: nothing
  checkpoints with manifests                 certified that the record does not vouch for), with a WARNING; the
                                             unreadable file is kept as scout-ledger.db.bak-<time>
  unreadable for any other reason          -> StartRefused naming `scout-ckpt ledger rebuild` (locked beyond the
  (locked, corrupt SQLite, newer schema),    busy timeout, a malformed database): a person decides; the job does
  or a rebuild that could not read a step    not train over checkpoints it cannot account for
  now (an I/O error)

One job per ROOT. Two jobs saving into one ROOT (a second launch pointed at a live run's directory, a copy of a
launch script left running) would overwrite each other's `step-N` directories and ledger rows. The coordinator
therefore holds the ROOT's run lease for the life of its ledger: an exclusive flock on ROOT/.leases/run.owner,
taken before anything is read or written, the holder's identity written into the file once the start succeeded (torchrun's
TORCHELASTIC_RUN_ID, host, pid). A flock is released by the kernel when its holder dies, whatever PID namespace it
ran in, so a dead job never blocks a restart. When the lease is held:

  by the same job (the same TORCHELASTIC_RUN_ID:   -> waited for, up to RUN_LEASE_WAIT_S (the previous
  torchrun's next generation, while the previous      generation's coordinator, or a child it forked, is still
  one is still exiting)                               exiting); then RootInUse
  by anything else                                 -> the job starts (it may load, as an evaluation job
                                                      does), but every save is refused on every rank
                                                      (SaveRefused, the cause RootInUse naming the holder)
                                                      unless the lease is free by then; a lost ledger is not
                                                      rebuilt under a live job (RootInUse at start)

A Checkpointer opened twice on one ROOT in one process shares the lease. Where locks cannot be taken on the
filesystem (ENOLCK), the job starts with a WARNING and no lease: could not check is not a refusal. Limits: a flock
reaches other hosts only where the filesystem's locks do (ledger/fsdetect.py says when they do not); on an
object-store ROOT the lease is on the ledger_dir, so two ledger_dirs on one URI are not detected by it.

Only the coordinator calls it; the Checkpointer broadcasts the outcome, so every rank starts or every rank raises.
No torch here.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from scout_ckpt.errors import (
    LedgerError,
    RootInUse,
    ScoutError,
    StartRefused,
)
from scout_ckpt.format.layout import LEASES_DIR, LEDGER_NAME, MANIFEST_NAME, list_checkpoint_dirs
from scout_ckpt.ledger import Ledger
from scout_ckpt.ledger.connection import header_journal
from scout_ckpt.ops.settle import try_exclusive

logger = logging.getLogger("scout_ckpt")


RUN_LEASE_NAME = "run.owner"  # not *.lock: the saves' own leases beside it are
RUN_LEASE_WAIT_S = 60.0  # how long a restart of the same job waits for its previous generation to let go


def run_lease_path(root: str | Path) -> Path:
    return Path(root) / LEASES_DIR / RUN_LEASE_NAME


def _job_id() -> str | None:
    return os.environ.get("TORCHELASTIC_RUN_ID") or None


class RunLease:
    """This process's hold on a ROOT's run lease (shared by the Checkpointers of one process on one ROOT), or
    the record that another job holds it (`holder`; `check` then tries again and raises RootInUse)."""

    def __init__(self, root: Path, key: str, fd: int | None, held: bool, holder: dict | None = None):
        self.root, self.key, self.fd, self.held, self.holder, self.users = root, key, fd, held, holder, 1

    def check(self) -> None:
        """Before a save (coordinator): the lease is ours, taken now if its holder has gone; else RootInUse."""
        if self.held:
            return
        if self.fd is not None and try_exclusive(self.fd):
            self.held, self.holder = True, None
            self.record()
            return
        raise _in_use(self.root, self.holder or (_holder(self.fd) if self.fd is not None else {}))

    def record(self) -> None:
        """Write this process's identity into the held lease (after the start succeeded: a refused start
        leaves ROOT as it was)."""
        if not self.held or self.fd is None:
            return
        rec = json.dumps({"job": _job_id(), "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()})
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, rec.encode(), 0)
        except OSError:
            pass  # the identity is for the refusal's message and the same-job wait: the lock is what counts

    def release(self) -> None:
        with _LEASES_LOCK:
            self.users -= 1
            if self.users > 0:
                return
            if _LEASES.get(self.key) is self:
                _LEASES.pop(self.key)
            if self.fd is not None:
                os.close(self.fd)  # releases the flock
                self.fd = None


_LEASES: dict[str, RunLease] = {}
_LEASES_LOCK = threading.Lock()


def _holder(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        rec = json.loads(data) if data.strip() else {}
        return rec if isinstance(rec, dict) else {}
    except (OSError, ValueError):
        return {}


def _in_use(root: Path, holder: dict) -> RootInUse:
    who = ", ".join(f"{k} {holder[k]}" for k in ("job", "host", "pid") if holder.get(k) is not None)
    return RootInUse(
        f"{root}: another job is saving checkpoints here ({who or 'holder unknown'}, holds "
        f"{run_lease_path(root)}); two jobs on one ROOT would overwrite each other's checkpoints: give "
        "this job its own ROOT, or stop the other one first"
    )


def take_run_lease(root: str | Path, *, wait_s: float = RUN_LEASE_WAIT_S) -> RunLease:
    """Coordinator, at start-up: ROOT's run lease (see the module docstring). Held by another job: returned
    not held (`check` refuses the saves); held by this job's previous generation: waited for first."""
    root = Path(root)
    path = run_lease_path(root)
    key = os.path.realpath(path)
    with _LEASES_LOCK:
        have = _LEASES.get(key)
        if have is not None:
            have.users += 1
            return have
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        raise StartRefused(f"{root}: cannot open the run lease {path} ({e})") from None
    me, deadline = _job_id(), time.monotonic() + wait_s
    try:
        while not try_exclusive(fd):
            holder = _holder(fd)
            if me is None or holder.get("job") != me or time.monotonic() >= deadline:
                lease = RunLease(root, key, fd, False, holder)
                break
            time.sleep(0.2)  # this job's previous generation is still exiting
        else:
            lease = RunLease(root, key, fd, True)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            logger.warning(
                "%s: file locks are not available here (%s): the run lease is not held, so a second "
                "job on this ROOT would not be refused",
                root,
                e,
            )
            return RunLease(root, key, None, True)
        raise StartRefused(f"{root}: cannot take the run lease {path} ({e})") from None
    with _LEASES_LOCK:
        _LEASES[key] = lease
    return lease


def _ledger_file(root: Path) -> str:
    """ "missing", "empty", "not_sqlite" or "sqlite" (by the header, without opening it)."""
    path = root / LEDGER_NAME
    if not path.exists():
        return "missing"
    if path.is_file() and path.stat().st_size == 0:
        return "empty"
    if path.is_file() and header_journal(path) is None:
        return "not_sqlite"
    return "sqlite"


def _manifest_steps(root: Path, store) -> list[int]:
    """Steps that carry a manifest: step dirs under a POSIX ROOT, committed attempts on a bound object store."""
    if store is not None:
        return sorted(store.committed())
    return sorted(s for s, d in list_checkpoint_dirs(root).items() if (d / MANIFEST_NAME).is_file())


def _records_nothing(root: Path) -> bool:
    """A readable ledger with no checkpoint row (e.g. created empty by a start that did not know better)."""
    try:
        with Ledger.open(root, readonly=True) as led:
            return not led.checkpoints()
    except (ScoutError, OSError):
        return False  # unreadable or to be migrated: Ledger.open below decides


def open_run_ledger(root: str | Path, *, journal: str | None = None, store=None) -> Ledger:
    """Coordinator, at start-up: ROOT's ledger opened read-write (created for a new run), rebuilt first when it
    was lost beside checkpoints with manifests; StartRefused when it cannot be used (see the module docstring)."""
    root = Path(root)
    lease = take_run_lease(root)  # before anything is written: another job's rebuild or save must not race ours
    try:
        if not lease.held and (_ledger_file(root) != "sqlite" or _records_nothing(root)):
            lease.check()  # never rebuild the ledger of a job that is alive
        ledger = _open_run_ledger(root, journal=journal, store=store)
    except BaseException:
        lease.release()
        raise
    ledger.on_close.append(lease.release)
    lease.record()
    ledger.run_lease = lease  # the committer checks it before every save (save/commit.py, begin)
    return ledger


def _open_run_ledger(root: Path, *, journal: str | None, store) -> Ledger:
    kind = _ledger_file(root)
    steps = _manifest_steps(root, store) if kind != "sqlite" or _records_nothing(root) else []
    if steps:
        why = {
            "missing": "missing",
            "empty": "empty",
            "not_sqlite": "not an SQLite file",
            "sqlite": "records no checkpoint",
        }[kind]
        logger.warning(
            "%s: the ledger is %s beside %d checkpoint(s) with manifests (steps %s): rebuilding it from "
            "the manifests and the journal, as `scout-ckpt ledger rebuild` does, instead of starting "
            "from step 0",
            root / LEDGER_NAME,
            why,
            len(steps),
            ", ".join(map(str, steps[-8:])),
        )
        from scout_ckpt.ops.rebuild import rebuild

        try:
            result = rebuild(root)
        except (ScoutError, OSError) as e:
            raise StartRefused(
                f"{root}: the ledger is {why} beside checkpoints and rebuilding it failed ({e}); "
                f"run `scout-ckpt ledger rebuild {root}` and restart"
            ) from None
        unread = [s for s in result["skipped"] if s.get("could_not_check")]
        if unread:
            raise StartRefused(
                f"{root}: rebuilt the lost ledger, but step {unread[0]['step']} could not be read "
                f"now ({unread[0]['reason']}); the job does not start without it: run "
                f"`scout-ckpt ledger rebuild {root}` once the storage answers, then restart"
            )
        for s in result["skipped"]:
            logger.warning("%s: ledger rebuild left step %d out: %s", root, s["step"], s["reason"])
        chain = result.get("journal_chain") or {}
        if not chain.get("intact", True):
            logger.warning(
                "%s: the journal's chain is broken (%s): the rebuild restored none of its certificates",
                root,
                chain.get("detail"),
            )
        states = {r["step"]: r["state"] for r in result["checkpoints"]}
        logger.warning(
            "%s: ledger rebuilt: %s%s",
            root,
            ", ".join(f"{s} {st}" for s, st in sorted(states.items())) or "no checkpoint",
            f"; the unreadable ledger is kept as {result['backup']}" if result["backup"] else "",
        )
    try:
        return Ledger.open(root, create=True, journal=journal)
    except LedgerError as e:
        raise StartRefused(
            f"{root}: the ledger cannot be opened ({e}); the job does not start over checkpoints "
            f"it cannot account for: run `scout-ckpt ledger rebuild {root}` (the old ledger is kept "
            "as .bak), then restart"
        ) from None
