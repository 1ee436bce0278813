"""Orphaned fast-tier step folders: the files of a local save that was killed before its commit was recorded.

A local save writes DIR/RUN_ID/step-S/rank-R.pt (and the peer copies it holds) before the coordinator records the
step; a rank or node killed in between leaves the folder with no ledger row, and retention, which plans over the
rows, never sees it. At start-up (LocalTier's constructor) local rank 0 of each node removes, under its node's
DIR, the step folders that are provably nobody's:

  * the folder's run is an EARLIER incarnation of this ROOT (a run id in this ROOT's ledger, not this run's; a
    run id the ledger does not know is another job's, or from before a ledger rebuild: not ours to judge), and
    this run's coordinator holds ROOT's run lease (ops/startup.py: so no earlier coordinator can still record a
    row); the coordinator reads the ledger and broadcasts (run ids, live dirs);
  * no ledger row names the folder, or only a `deleted` one (retention's removal interrupted);
  * nobody on this node is writing into that run's directory. Every rank holds a writer lease from before it
    writes anything under DIR/RUN_ID until the tier closes (LocalTier.close) or its process exits, however it
    exits (the kernel drops a flock with its holder): an exclusive flock on DIR/RUN_ID/.writers/rank-R.lock,
    whose file stays (free) afterwards. The sweep takes every lease file of the run without waiting and holds
    them while it removes; a lease held by someone, one that cannot be checked, a record naming a process not
    provably gone (one that still runs, one on another host: a DIR shared between hosts), or a run directory
    with no lease file at all (written by an older scout-ckpt, or restored there by a load) is "could not
    check": that run's folders stay.

Only the tier's own names are removed (rank-R.pt, peer-rank-R.pt and their temp files); a folder holding anything
else keeps it and the folder. A dead run's directory left with no step folder loses its lease files and goes.
No torch here.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from scout_ckpt.ops.settle import hold_with_record, owner_alive, try_exclusive

WRITERS = ".writers"
STEP_RE = re.compile(r"^step-\d{8}$")
FILE_RE = re.compile(r"^(peer-)?rank-\d+\.pt(\.tmp-\d+)?$")


class WriterLease:
    """This rank's writer lease on DIR/RUN_ID (module docstring). `release` closes the descriptor (the kernel
    drops the lock) and leaves the file: a free lease file is the record that its writer has gone."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, run_dir: Path, rank: int) -> "WriterLease":
        path = run_dir / WRITERS / f"rank-{rank}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        # blocking: a sweep holds it only while it removes
        return cls(path, hold_with_record(path, {"rank": rank}))

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _hold_writers(run_dir: Path) -> list[int] | None:
    """The descriptors of every writer lease of `run_dir`, each locked here; None (nothing held) when one is held
    by another descriptor, cannot be checked, names a process not provably gone (alive, another host's, or no
    readable record), or there is no lease file at all."""
    try:
        names = sorted(n for n in os.listdir(run_dir / WRITERS) if n.endswith(".lock"))
    except OSError:
        return None
    if not names:
        return None
    fds: list[int] = []
    try:
        for name in names:
            fd = os.open(run_dir / WRITERS / name, os.O_RDWR)
            fds.append(fd)
            if not try_exclusive(fd):
                raise BlockingIOError
            try:
                owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except ValueError:
                owner = {}
            if owner_alive(owner) is not False:  # a free lock is not enough: its process must be provably gone
                raise BlockingIOError  # (same host, pid gone or reused); another host's: cannot tell
    except OSError:
        for fd in fds:
            os.close(fd)
        return None
    return fds


def _remove_step(step_dir: Path) -> bool:
    """Remove the tier's files in `step_dir`, then the folder if that emptied it; whether it is gone."""
    try:
        names = os.listdir(step_dir)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    for name in names:
        if FILE_RE.match(name):
            try:
                (step_dir / name).unlink()
            except FileNotFoundError:
                pass
            except OSError:
                return False
    try:
        step_dir.rmdir()
        return True
    except OSError:
        return False


def sweep(base: Path, own_run: str, earlier_runs: set[str], live_dirs: set[str]) -> list[str]:
    """Local rank 0 of a node: remove the orphaned step folders of this ROOT's `earlier_runs` under `base` (the
    node's DIR) that no live row names (`live_dirs`: "RUN_ID/step-NNNNNNNN" of every row not `deleted`), in
    run directories with no live writer (module docstring). Returns the removed folders, relative to `base`."""
    removed: list[str] = []
    try:
        runs = sorted(os.listdir(base))
    except OSError:
        return removed
    for run in runs:
        if run == own_run or run not in earlier_runs:
            continue
        run_dir = base / run
        fds = _hold_writers(run_dir)
        if fds is None:
            continue
        try:
            left = 0
            for name in sorted(os.listdir(run_dir)):
                if not STEP_RE.match(name):
                    continue
                rel = f"{run}/{name}"
                if rel in live_dirs:
                    left += 1
                elif _remove_step(run_dir / name):
                    removed.append(rel)
                else:
                    left += 1
            if left == 0:  # a dead run with nothing left: its lease files and the directory go too
                for name in os.listdir(run_dir / WRITERS):
                    (run_dir / WRITERS / name).unlink(missing_ok=True)
                (run_dir / WRITERS).rmdir()
                run_dir.rmdir()
        except OSError:
            pass  # something else is there (not ours), or it went meanwhile: the rest stays
        finally:
            for fd in fds:
                os.close(fd)
    return removed
