"""The step/copy view (ops/steps.py) as a pure decision: a step's verdict from its rows in both tiers, and each
copy's own bytes evidence. Rows as the ledger returns them; no ledger, no processes."""

from __future__ import annotations

import pytest

from scout_ckpt.ops.steps import step_state, step_view


def _durable(state, *codes):
    return {"step": 6, "state": state, "path": "step-00000006", "reasons": [{"code": c} for c in codes]}


def _local(state, *reasons):
    return {
        "step": 6,
        "state": state,
        "reasons": list(reasons),
        "files": [
            {"rank": 0, "host": "a", "node": 0, "where": "/n0/r/step-00000006/rank-0.pt", "digest": "d0"},
            {"rank": 1, "host": "b", "node": 1, "where": "/n1/r/step-00000006/rank-1.pt", "digest": "d1"},
        ],
        "copies": [
            {"rank": 0, "holder": 1, "host": "b", "path": "/n1/r/step-00000006/peer-rank-0.pt", "verified": True},
            {"rank": 1, "holder": 0, "host": "a", "path": "/n0/r/step-00000006/peer-rank-1.pt", "verified": False},
        ],
    }


@pytest.mark.parametrize(
    ("durable", "local", "state"),
    [
        (_durable("certified"), _local("certified"), "certified"),
        # one copy's bytes: the step stays certified through the other copy
        (_durable("rejected", "digest_mismatch"), _local("certified"), "certified"),
        # the state itself, found on either row, holds for the step
        (_durable("rejected", "replay_sdc"), _local("certified"), "rejected"),
        (_durable("certified"), _local("rejected", {"code": "consensus_attributed", "ranks": [1]}), "rejected"),
        (_durable("certified"), _local("quarantined", {"code": "quarantined"}), "quarantined"),
        (None, _local("quarantined", {"code": "quarantined"}), "quarantined"),
        (_durable("committed"), None, "committed"),
        (_durable("deleted", "retention"), _local("certified"), "certified"),
        (_durable("deleted", "retention"), _local("deleted", {"code": "retention"}), "deleted"),
    ],
)
def test_a_steps_verdict_from_its_rows(durable, local, state):
    assert step_state(durable, local)[0] == state


def test_each_copy_carries_its_own_bytes_evidence():
    view = step_view(
        _durable("rejected", "digest_mismatch"),
        _local("rejected", {"code": "digest_mismatch", "rank": 1, "tier": "local"}),
        "pass",
    )
    got = [(c["kind"], c["rank"], c["bytes"]["status"]) for c in view["copies"]]
    assert got == [
        ("durable_folder", None, "fail"),
        ("node_local", 0, "pass"),
        ("node_local", 1, "fail"),
        ("peer", 0, "pass"),
        ("peer", 1, "fail"),
    ]
    assert view["tiers"] == {"durable": "rejected", "local": "rejected"}


def test_an_object_store_copy_names_its_prefix_and_a_deleted_copy_says_so():
    view = step_view(_durable("deleted", "retention"), None, "pass", uri="s3://b/run")
    (c,) = view["copies"]
    assert (c["kind"], c["where"], c["bytes"]["status"]) == ("object_store", "s3://b/run/step-00000006", "deleted")
    assert view["usable_copies"] == 0
