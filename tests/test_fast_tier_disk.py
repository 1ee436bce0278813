"""A full node-local disk under the fast tier: the local save fails there, and nothing else does.

The job (tests/workers_fast_tier_disk.py): a user's DDP job on 2 real gloo ranks, each its own "node" with its
own local directory; node 1's is a real 1 MiB tmpfs that fills up before the first local save and is freed after
it. The promise: a full local disk is a save that could not be made, never evidence about the state and never
a reason to stop training. The rank that cannot write must not leave its peers waiting in the tier's
collectives (they hung there until the group's timeout, then the job died of the latched error); the step is
rejected (`commit_failed`, naming the cause and the rank), what was written of it is removed from every node,
training goes on (the next local commit's retention removes the rejected row's step, which keeps its
reasons), and the next local saves, once there is room, are certified and are what a restart loads.

Oracles independent of the code under test: the sha256 each rank computed of its own state at each save, the
tmpfs this test mounted and the files left on it, the real CLI's `ls --json` on the real ledger."""

from __future__ import annotations

import json

from tests.conftest import run_cli, tmpfs


def test_a_full_local_disk_rejects_that_local_step_and_training_and_the_next_local_saves_go_on(tmp_path):
    from scout_ckpt.testing.launch import run_ranks
    from tests import workers_fast_tier_disk as w

    base = tmp_path / "local"
    (base / "node-0").mkdir(parents=True)
    with tmpfs("1M") as disk:
        (base / "node-1").symlink_to(disk, target_is_directory=True)
        out = run_ranks(
            w.full_local_disk_job, 2, str(tmp_path / "run"), str(base), env={"LOCAL_WORLD_SIZE": "1"}, timeout=180
        )
        seen = {o.rank: o.result for o in out}
        left_on_node_1 = sorted(str(p.relative_to(disk)) for p in disk.rglob("*") if p.is_file())
    run_id = seen[0]["run_id"]
    assert seen[1]["filled"] > 0
    assert [r["raised"] for r in seen.values()] == [None, None], seen  # training went on, on every rank
    for r in seen.values():
        assert r["verdicts"][2]["state"] == "rejected" and "live_fault" not in r["verdicts"][2], r["verdicts"]
        assert (r["verdicts"][4]["state"], r["verdicts"][6]["state"]) == ("certified", "certified"), r["verdicts"]
    # the restart loads the newest local step, exactly the state each rank had when it saved it
    for rank, r in seen.items():
        assert (r["loaded"], r["tier"]) == (6, "local"), r
        assert r["loaded_digest"] == r["saved"][6], rank
    rc, stdout, err = run_cli("ls", tmp_path / "run", "--json")
    assert rc == 0, err
    local = {r["step"]: r for r in json.loads(stdout)["local"]}
    # step 2 rejected, then removed by the next commit's retention: the row still says why it was rejected
    assert {s: r["state"] for s, r in local.items()} == {2: "deleted", 4: "certified", 6: "certified"}
    assert [r["code"] for r in local[2]["reasons"]] == ["retention", "commit_failed"], local[2]
    reason = local[2]["reasons"][1]
    assert reason["code"] == "commit_failed" and reason["ranks"] == [1], reason
    assert "No space left on device" in reason["detail"], reason
    # nothing of step 2 is left on either node, no temp file either; steps 4 and 6 are there with their copies
    assert not list(base.glob(f"node-0/{run_id}/step-00000002")), list(base.rglob("*"))
    assert not [p for p in left_on_node_1 if "step-00000002" in p or ".tmp-" in p], left_on_node_1
    for step in (4, 6):
        assert f"{run_id}/step-{step:08d}/rank-1.pt" in left_on_node_1
        assert f"{run_id}/step-{step:08d}/peer-rank-0.pt" in left_on_node_1
