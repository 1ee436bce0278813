"""A full disk in the middle of a sync save (ROOT on a real 3 MiB tmpfs, 2 gloo ranks, 4 MiB of state per rank).

DCP raises CheckpointException, a BaseException that a training loop's `except Exception` does not catch, and
left the `writing` row and the partial temp dir for the life of the process: the disk stayed full and the next
save was refused. The save must clean up as an async save does and raise the documented CommitError (an
Exception) on every rank, with the cause; the next save, which fits, must be certified."""

from __future__ import annotations

import json
import os

import pytest

from scout_ckpt.testing.launch import run_ranks
from tests.conftest import run_cli, tmpfs


@pytest.fixture
def tiny_fs():
    with tmpfs("3M") as d:
        yield str(d)


def _fill_the_disk(rank, world, root):
    import torch

    from scout_ckpt import Checkpointer
    from scout_ckpt.errors import CommitError

    ck = Checkpointer(root, model=torch.nn.Linear(4, 4))
    out = {}
    try:
        ck.save(1, {"w": torch.randn(1024, 1024, generator=torch.Generator().manual_seed(rank))})
        out["first"] = None
    except Exception as e:  # what a training loop catches
        out["first"] = (type(e).__name__, isinstance(e, CommitError), str(e))
    out["left"] = sorted(n for n in os.listdir(root) if n.startswith((".step-", "step-")))
    out["second"] = ck.save(2, {"w": torch.zeros(4)})["state"]
    ck.close()
    return out


def test_a_full_disk_mid_save_cleans_up_and_raises_commit_error_on_every_rank(tiny_fs):
    root = os.path.join(tiny_fs, "run")
    out = [o.result for o in run_ranks(_fill_the_disk, 2, root, timeout=120)]
    for r in out:
        name, is_commit_error, msg = r["first"]
        assert (name, is_commit_error) == ("CommitError", True), r
        assert msg.startswith("checkpoint 1 not saved: ") and "\n" not in msg, msg
        assert r["second"] == "certified"
    assert out[0]["left"] == []  # the coordinator removed the partial temp dir before raising
    rc, stdout, _ = run_cli("ls", root, "--json", check_rc=0)
    rows = {c["step"]: c for c in json.loads(stdout)["checkpoints"]}
    assert rows[1]["state"] == "rejected" and [x["code"] for x in rows[1]["reasons"]] == ["commit_failed"]
    assert rows[2]["state"] == "certified"
    assert sorted(n for n in os.listdir(root) if n.startswith((".step-", "step-"))) == ["step-00000002"]
