import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "scout_ckpt.cli"]


def run_cli(*args, env=None, check_rc=None):
    """The real command line in a subprocess: (returncode, stdout, stderr)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    p = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, env=full_env, timeout=300)
    if check_rc is not None:
        assert p.returncode == check_rc, (p.returncode, p.stdout, p.stderr)
    return p.returncode, p.stdout, p.stderr


_HOLD_LOCK = """
import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("BEGIN IMMEDIATE")
c.execute("UPDATE checkpoints SET bytes=bytes")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
c.execute("ROLLBACK")
"""


@contextlib.contextmanager
def ledger_write_lock(db_path, seconds: float):
    """Another process holds the ledger's write lock (BEGIN IMMEDIATE) for `seconds`, from entry."""
    p = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(db_path), str(seconds)], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        yield p
    finally:
        p.kill()
        p.wait()


@pytest.fixture(scope="session")
def _template_root(tmp_path_factory):
    """A real 3-rank run with certified checkpoints at steps 3 and 4 (built once, copied per test)."""
    from scout_ckpt.testing.launch import run_ranks
    from tests import workers_ckpt

    root = tmp_path_factory.mktemp("template") / "run"
    run_ranks(workers_ckpt.save_and_reload, 3, str(root), False, timeout=120)
    return root


@pytest.fixture
def ckpt_root(_template_root, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(_template_root, root)
    return root
