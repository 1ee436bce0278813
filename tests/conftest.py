import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import placement

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "scout_ckpt.cli"]


def run_cli(*args, env=None, check_rc=None):
    """The real command line in a subprocess: (returncode, stdout, stderr)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    p = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, env=full_env, timeout=300)
    if check_rc is not None:
        assert p.returncode == check_rc, (p.returncode, p.stdout, p.stderr)
    return p.returncode, p.stdout, p.stderr


@contextlib.contextmanager
def tmpfs(size: str):
    """A real tmpfs of `size` (e.g. "3M") at a fresh directory, for a disk that fills up; skipped where mounting
    is not allowed, and a failure under CI (which runs as root on this machine class: a mount that fails there is
    a broken CI, not a reason to go quiet)."""
    import tempfile

    d = tempfile.mkdtemp(prefix="scout-tmpfs-")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d], capture_output=True, text=True)
    if p.returncode != 0:
        os.rmdir(d)
        why = f"cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): {p.stderr.strip()}"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    try:
        yield Path(d)
    finally:
        subprocess.run(["umount", "-l", d], check=False)
        os.rmdir(d)


def pytest_configure(config):
    """The fault placement seed of this session (tests/placement.py): SCOUT_TEST_SEED, or drawn once here."""
    try:
        placement.configure()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_report_header(config):
    return placement.header()


def pytest_terminal_summary(terminalreporter):
    """Also at the end, where `-q` (which drops the header) still prints it, next to any failure."""
    terminalreporter.write_line(placement.header())


_NO_CUDA: list = []  # [why] once known: None where a CUDA device is usable


def _no_cuda() -> str | None:
    """Why the `cuda` tests cannot run here (None where they can); torch is imported only when one is collected."""
    if not _NO_CUDA:
        import torch

        _NO_CUDA.append(
            None
            if torch.cuda.is_available()
            else f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"
        )
    return _NO_CUDA[0]


def _require_gpu() -> bool:
    return os.environ.get("SCOUT_REQUIRE_GPU") == "1"


def pytest_runtest_setup(item):
    """`cuda` tests: skipped without a device, with the reason; a failure instead under SCOUT_REQUIRE_GPU=1
    (pytest_pyfunc_call), so that a GPU run (make gpu-check) cannot pass by skipping them."""
    if item.get_closest_marker("cuda") is not None and not _require_gpu():
        why = _no_cuda()
        if why is not None:
            pytest.skip(why)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Under SCOUT_REQUIRE_GPU=1 a `cuda` test without a device fails in its call (a failed test, not an error)."""
    if pyfuncitem.get_closest_marker("cuda") is not None and _require_gpu():
        why = _no_cuda()
        if why is not None:
            pytest.fail(f"SCOUT_REQUIRE_GPU=1 but {why}", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that drew fault placements names them, with the seed to rerun them, in its report."""
    outcome = yield
    rep = outcome.get_result()
    drawn = placement.placements_of(item)
    if drawn and rep.failed:
        rep.sections.append(
            ("fault placement", "\n".join([str(p) for p in drawn] + [f"rerun with {placement.ENV}={drawn[0].seed}"]))
        )


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
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(db_path), str(seconds)], stdout=subprocess.PIPE, text=True
    )
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
