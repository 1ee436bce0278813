"""Faults of the world for a job under torchrun, injected by real means from outside the job: a transient EIO on
one file (every process of the job, whichever rank reads it) and a lost ledger. Shared by the framework drop-ins' Murphy
tests (tests/test_integration_lightning.py, tests/test_integration_accelerate.py) and the core's
(tests/test_murphy_trust.py).

Why an EIO and not `chmod 000`: the tests run as root here, and root reads a file whatever its mode."""

from __future__ import annotations

import os
from pathlib import Path

from scout_ckpt.format.layout import LEDGER_NAME
from tests.conftest import REPO

EIO_SITECUSTOMIZE = """
import errno, os
_target = os.environ.get("SCOUT_TEST_EIO_FILE")
if _target:
    _real, _done = os.open, []

    def _open(path, flags, *args, **kwargs):   # the first open of the target fails with EIO, as a flaky disk does
        if not _done and not isinstance(path, int) and os.path.realpath(os.fspath(path)) == _target:
            _done.append(path)
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
        return _real(path, flags, *args, **kwargs)

    os.open = _open
"""


def eio_once_env(site: Path, target: Path) -> dict:
    """Environment for a torchrun whose every process fails its first os.open of `target` with EIO (the call the
    byte verification reads through); later opens succeed, as after a transient fault."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(EIO_SITECUSTOMIZE)
    return {"PYTHONPATH": f"{site}{os.pathsep}{REPO}", "SCOUT_TEST_EIO_FILE": os.path.realpath(target)}


def largest_shard(step_dir: Path) -> Path:
    return max(step_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)


def delete_ledger(root: Path) -> None:
    """The ledger and its SQLite side files gone (the journal and the step directories stay)."""
    for name in (LEDGER_NAME, LEDGER_NAME + "-wal", LEDGER_NAME + "-shm"):
        p = root / name
        if p.exists():
            p.unlink()
    assert not (root / LEDGER_NAME).exists()


def trust(root: Path, step: int) -> tuple:
    """What the ledger holds of a step that a could-not-check must leave alone: state, reasons, attempt, evidence
    statuses, number of verdicts."""
    from scout_ckpt.ledger import Ledger

    with Ledger.open(root, readonly=True) as led:
        row = led.checkpoint(step)
        return (
            row["state"],
            row["reasons"],
            row["attempt"],
            {k: v["status"] for k, v in led.evidence(step).items()},
            len(led.certifications(step)),
        )
