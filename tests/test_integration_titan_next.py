"""The checks TorchTitan main's checkpoint manager asks for (integrations.titan_next), on real checkpoints: one run
of the 0.3 ScoutCheckpointManager on 2 gloo ranks writes five certified DCP steps and their ledger; then each step
is put in the state under test by the product's own operations (a quarantine, a rejection, a flipped bit, a save
in flight, a save awaiting evidence, a save whose owner died) and the answers are judged against the state each
step was put in, not against the code's own reading of the ledger."""

import shutil
import subprocess

import pytest

from scout_ckpt.integrations import titan_next as tn
from scout_ckpt.ledger import Ledger, journal
from scout_ckpt.ops.operator import quarantine
from scout_ckpt.ops.settle import this_process_owner
from scout_ckpt.testing.launch import run_ranks
from tests import workers_torchtitan as w

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def five(tmp_path_factory):
    root = tmp_path_factory.mktemp("tt-next")
    out = run_ranks(w.train, 2, str(root), 5, keep=0, timeout=400)
    assert {s: v["state"] for s, v in out[0].result["verdicts"].items()} == dict.fromkeys(range(1, 6), "certified")
    return root / "ckpt"


def dead_owner() -> dict:
    """The owner record of a process that has exited (and been reaped): provably dead."""
    p = subprocess.Popen(["true"])
    p.wait()
    return {**this_process_owner(), "pid": p.pid, "start": None}


def staged(five, tmp_path):
    """A copy of the run with: 1 certified, 2 quarantined, 3 rejected, 4 certified with a flipped bit, 5 the newest
    certified, 6 a save in flight (`writing`, live owner), 7 committed (awaiting evidence), 8 `writing` whose owner
    died, 9 a step-N folder the ledger does not know (with DCP's .metadata), 10 one without."""
    root = tmp_path / "ckpt"
    shutil.copytree(five, root)
    quarantine(root, 2, "held for an investigation")
    with Ledger.open(root) as led:
        assert journal.record_transition(
            led,
            root,
            3,
            "rejected",
            [{"code": "load_mismatch"}],
            source="load",
            expect="certified",
            attempt=led.checkpoint(3)["attempt"],
        )
        f = root / "step-4" / "__1_0.distcp"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x04
        f.write_bytes(bytes(data))
        row5, files5 = led.checkpoint(5), led.files(5)
        for step, owner in ((6, this_process_owner()), (7, this_process_owner()), (8, dead_owner())):
            shutil.copytree(root / "step-5", root / f"step-{step}")
            led.record_writing(step, row5["run_id"], f"attempt-{step}", f"step-{step}", owner)
        assert led.record_commit(
            7,
            run_id=row5["run_id"],
            path="step-7",
            nbytes=row5["bytes"],
            manifest_digest=row5["manifest_digest"],
            files=files5,
            evidence={},
            state="committed",
            reasons=[{"code": "replay_missing"}],
            attempt="attempt-7",
        )
    shutil.copytree(root / "step-5", root / "step-9")
    shutil.copytree(root / "step-5", root / "step-10")
    (root / "step-10" / ".metadata").unlink()
    return root


def states(root) -> dict:
    with Ledger.open(root, readonly=True) as led:
        return {r["step"]: r["state"] for r in led.checkpoints()}


def test_valid_means_retention_must_not_delete_it_as_abandoned(five, tmp_path):
    root = staged(five, tmp_path)
    got = {s: tn.is_valid_checkpoint(root, root / f"step-{s}") for s in range(1, 11)}
    assert got == {1: True, 2: True, 3: False, 4: True, 5: True, 6: True, 7: True, 8: False, 9: True, 10: False}
    assert not tn.is_valid_checkpoint(root, root / "not-a-step")


def test_resumable_means_certified_and_the_bytes_verify(five, tmp_path):
    root = staged(five, tmp_path)
    got = {s: tn.is_resumable_checkpoint(root, str(root / f"step-{s}")) for s in range(1, 11)}
    assert got == {1: True, 2: False, 3: False, 4: False, 5: True, 6: False, 7: False, 8: False, 9: False, 10: False}
    assert states(root)[4] == "rejected"  # the flipped bit is recorded, as `resume` records it
    with Ledger.open(root, readonly=True) as led:
        assert any(r["code"] == "digest_mismatch" for r in led.checkpoint(4)["reasons"])


def test_find_load_step_walks_back_to_the_newest_resumable_at_or_below_max_step(five, tmp_path):
    root = staged(five, tmp_path)
    assert tn.find_load_step(root) == 5
    assert tn.find_load_step(root, max_step=9) == 5
    assert tn.find_load_step(root, max_step=4) == 1  # 4: bytes fail, 3: rejected, 2: quarantined
    assert states(root)[4] == "rejected"
    assert tn.find_load_step(root, max_step=0) == -1
    assert tn.find_load_step(tmp_path / "fresh") == -1  # no ledger: a fresh start


def test_purge_exempt_keeps_certified_pending_and_quarantined_and_records_what_it_releases(five, tmp_path):
    root = staged(five, tmp_path)
    exempt = tn.purge_exempt(root, keep=2)
    # keep=2 certified: 5 (newest) and 4; 6 in flight and 7 awaiting evidence are newer than 5; 2 is quarantined;
    # 9 and 10 are not the ledger's. 1 (an older certified one) and 3 (rejected) go.
    assert {s: exempt(s) for s in (2, 4, 5, 6, 7, 9, 10)} == dict.fromkeys((2, 4, 5, 6, 7, 9, 10), True)
    assert states(root)[1] == "certified"
    assert exempt(1) is False
    assert exempt(3) is False
    st = states(root)
    assert (st[1], st[3]) == ("deleted", "deleted")  # in the ledger before TorchTitan removes the folders
    assert {s: st[s] for s in (2, 4, 5, 6, 7, 8)} == {
        2: "quarantined",
        4: "certified",
        5: "certified",
        6: "writing",
        7: "committed",
        8: "writing",
    }
    # 8's owner is dead, but it is newer than the newest certified: retention leaves it to the start-up's settling
    # (is_valid_checkpoint is False for it: TorchTitan's purge removes it as abandoned, without asking).
    assert exempt(8) is True
    # a row recorded deleted has no folder left, whoever asked (TorchTitan's purge then finds nothing to remove)
    assert not (root / "step-1").exists() and not (root / "step-3").exists()
    assert (root / "step-4").is_dir() and (root / "step-2").is_dir()


def test_the_03_managers_retention_keeps_a_users_purge_exempt_steps(five, tmp_path):
    root = staged(five, tmp_path)
    with Ledger.open(root) as led:
        out = tn.apply_retention(led, root, 2, also_keep=lambda s: s == 1)  # e.g. a milestone step
    assert out["keep"][1] == "best model" and 1 not in out["delete"] and (root / "step-1").is_dir()
    assert 3 in out["delete"] and not (root / "step-3").exists()  # the rejected one goes
    assert states(root)[3] == "deleted"


def test_find_load_step_collective_gives_every_rank_rank0s_answer(five, tmp_path):
    root = staged(five, tmp_path)
    out = run_ranks(w.find_load_step_collective, 2, str(root), 4, timeout=200)
    assert [o.result for o in out] == [1, 1]  # 4: bytes fail (recorded once, by rank 0), 3 rejected, 2 quarantined
    with Ledger.open(root, readonly=True) as led:
        assert sum(h["state"] == "rejected" for h in led.certifications(4)) == 1
