"""tests/scripts/fast_tier_job.py during a storage outage: every file under ROOT's step folders and under this
node's local directory (SCOUT_TEST_LOCAL_DIR) answers EIO, as a failing disk or a hung network mount would, for
the whole life of the worker (tests/test_one_truth_torchrun.py). The same arguments as fast_tier_job.py."""

import errno
import os
import sys
from pathlib import Path

import fast_tier_job  # noqa: E402 (beside this script: torchrun puts its folder on sys.path)


def _outage(root: str, local_dir: str) -> None:
    roots = (os.path.realpath(root) + "/step-", os.path.realpath(local_dir) + "/")
    real_open, real_read = os.open, Path.read_bytes

    def flaky_open(path, flags, *args, **kwargs):
        if not isinstance(path, int) and os.path.realpath(os.fspath(path)).startswith(roots):
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    def flaky_read(self):  # the local tier reads its files whole, through io.open (not os.open)
        if os.path.realpath(self).startswith(roots):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(self))
        return real_read(self)

    os.open, Path.read_bytes = flaky_open, flaky_read


if __name__ == "__main__":
    _outage(sys.argv[1], os.environ["SCOUT_TEST_LOCAL_DIR"])
    fast_tier_job.main()
