"""Tensor-parallel meshes are covered with the defaults: a user's TP model on a TP-only mesh (2 ranks) and on
FSDP2 x TP (2 x 2), no option changed.

* a healthy run certifies every save and restarts from the last one, holding what the job digested at that save;
* a fault of rank 1 from step 3 on (in a column-parallel forward, in the gradient that projection sends back, in
  the optimizer's update of its TP shard) is never in a certified step: the restart loads step 2, holding what the
  job digested at step 2. At 4 ranks the ledger's SDC events name rank 1 alone for the forward and the update, and
  rank 1's TP group for the backward: the TP all-reduce of the input gradient hands rank 1's wrong sum to its TP
  peer, so the two disagree with their data-parallel replicas together (consensus, inconclusive between them).

The oracle is the job's own digest of every full tensor at each save (tests/workers_replay_tp.py) and the fault's
placement; scout-ckpt's report is read only for the rank it names.
"""

from __future__ import annotations

import pytest

from scout_ckpt.ledger import Ledger
from scout_ckpt.testing.launch import run_ranks
from tests import workers_replay_tp as W

STEPS, SAVE_EVERY, FAULT_STEP = 6, 2, 3


def _run(tmp_path, world, fault):
    out = run_ranks(W.w_tp_job, world, str(tmp_path), STEPS, SAVE_EVERY, fault, timeout=600)
    assert all(o.exitcode == 0 for o in out), [o.error for o in out if o.exitcode]
    return [o.result for o in out]


@pytest.mark.scenario
@pytest.mark.parametrize("world", [2, 4])
def test_healthy_tp_job_certifies_every_save(tmp_path, world):
    results = _run(tmp_path, world, None)
    for r in results:
        assert r["verdicts"] == {s: "certified" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)}
        assert r["loaded_step"] == STEPS
        assert r["loaded"] == r["saved"][STEPS]


@pytest.mark.scenario
@pytest.mark.parametrize("kind", ["forward", "backward", "optimizer"])
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.scenario_ci), 4])
def test_persistent_fault_on_a_tp_rank_is_never_certified(tmp_path, world, kind):
    results = _run(tmp_path, world, (1, kind, FAULT_STEP))
    for r in results:
        assert r["verdicts"][2] == "certified"
        late = {s: v for s, v in r["verdicts"].items() if s >= FAULT_STEP}
        assert "certified" not in late.values()
        assert r["loaded_step"] == 2
        assert r["loaded"] == r["saved"][2]
    if world == 4:
        with Ledger.open(tmp_path, readonly=True) as ledger:
            named = {tuple(e["ranks"]) for e in ledger.events(("sdc",))}
        assert named == ({(0, 1)} if kind == "backward" else {(1,)})
