"""tests/scripts/fast_tier_job.py with a local verdict racing the durable save of the same step
(tests/test_one_truth_torchrun.py): once per job (marker file ROOT/race.json), the local save at
SCOUT_TEST_RACE_STEP is staged while rank 1 holds a NaN in one weight, the NaN is gone again before the durable
save of that step, and every rank's local commit is slowed by 2 s, so that the durable save is assessed before the
local verdict would land if it did not wait for it. The same arguments as fast_tier_job.py."""

import json
import os
import time
from pathlib import Path

import fast_tier_job  # noqa: E402 (beside this script: torchrun puts its folder on sys.path)
import torch
import torch.distributed as dist

from scout_ckpt import Checkpointer

STEP = int(os.environ.get("SCOUT_TEST_RACE_STEP", "6"))


class RacingCheckpointer(Checkpointer):
    def __init__(self, root, **kw):
        self._marker = Path(kw.get("ledger_dir") or root) / "race.json"
        self._racing = not self._marker.exists()  # decided before any rank can write it (at STEP, much later)
        from scout_ckpt.save.fault_points import current
        from scout_ckpt.testing.faults import fault_points

        inner = current()  # a hook the caller set around this construction, kept

        def hook(point: str, step: int) -> None:
            if self._racing and point == "local_written" and step == STEP:
                time.sleep(2.0)
            if inner is not None:
                inner(point, step)

        with fault_points(hook):
            super().__init__(root, **kw)

    def step(self, step: int, state: dict | None = None) -> None:
        if not (self._racing and step == STEP):
            return super().step(step, state)
        rank = dist.get_rank()
        p = next(self.model.parameters())
        keep = p.detach().view(-1)[0].item()
        if rank == 0:
            self._marker.write_text(json.dumps({"kind": "race", "step": step, "rank": 1}))
        if rank == 1:
            with torch.no_grad():
                p.view(-1)[0] = float("nan")
        try:
            super().step(step, state)  # the local save stages the NaN and commits in the background
        finally:
            if rank == 1:
                with torch.no_grad():
                    p.view(-1)[0] = keep


if __name__ == "__main__":
    fast_tier_job.Checkpointer = RacingCheckpointer
    fast_tier_job.main()
