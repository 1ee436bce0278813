"""DCP's save planner with its plan cache, one cache per Checkpointer.

Why: every `dcp.save` plans afresh. Each rank builds its local plan (a `WriteItem` per tensor chunk and per
object), pickles it to the coordinator (a gather), the coordinator de-duplicates the replicated items, builds and
validates the global plan and `.metadata`, and scatters each rank its final plan. A training job saves the same
state layout every time, so all of that is recomputed to the same answer at every save. torch 2.13's
`DefaultSavePlanner(enable_plan_caching=True)` keeps the last plans: a rank whose local plan is unchanged sends an
empty one, and when no rank's changed the coordinator reuses the global plan and metadata without rebuilding or
validating them, and scatters empty plans (the two collectives remain, with a few bytes each).

What the cache may reuse, and why that is safe here:

- The plan names *where* each item goes (FQN, chunk offsets and sizes, the rank that writes a replicated item,
  the data file's prefix), never the bytes: the write resolves every item from the state passed to this save
  (`resolve_data`), and the writer writes into this save's directory (the plan holds no path). `.metadata` is
  the cached metadata with this save's storage records filled in by the writer's `finish`.
- torch compares a new local plan with the cached one by FQN, chunk offsets and sizes only, not by dtype: a
  state whose tensor changed dtype at the same shape would reuse `.metadata` naming the old dtype. The planner
  here compares every field of every item (dtype, layout, sizes, type) and the flattening map, so any change
  of the state's layout sends the full local plan and the coordinator re-plans (torch's "Case 2.2": the changed
  ranks' plans replace the cached ones, the global plan and metadata are rebuilt and validated).
- The cache lives in class-level dictionaries of torch's `SavePlanner`, keyed by the planner's
  `_cached_plans_key` (by default the class name: two Checkpointers in one process would share it). Each
  Checkpointer takes its own key (`PlanCache`), so their plans never mix, and drops its entries at close.
- Ranks stay consistent: the coordinator caches the global plan only after it was built and validated, and a
  rank promotes its local plan to the cache only in `finish_plan`, after the coordinator's scatter reached it.
  A save that fails after planning leaves plans that describe the state it tried to write, which is still the
  state's layout; a save that fails in planning caches nothing. Every process of a restarted generation starts
  with an empty cache.

A fresh planner object is made for each save (`PlanCache.planner()`): the planner holds the state it planned for,
and a Checkpointer must not keep a state alive between saves; only the key, and so the cache, is kept.
"""

from __future__ import annotations

import dataclasses
import itertools

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

_KEYS = itertools.count()

# SavePlanner's class-level caches, by key (torch 2.13, torch/distributed/checkpoint/planner.py)
_CACHES = (
    "_cached_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
    "_cached_final_save_plan",
)


class ScoutSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner with plan caching, whose local plan counts as unchanged only when every field of every
    item and the flattening map are equal to the cached plan's (see the module docstring)."""

    def __init__(self, key: str) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = key

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if plan.usable or plan.items:
            return plan  # planned afresh (no cached plan, or torch saw a change): sent whole
        # torch found the plan unchanged by FQN and chunk; hold it to the stricter comparison
        cached = SavePlanner._cached_save_plan[self._cached_plans_key]
        if self.plan.items == cached.items and self.plan.planner_data == cached.planner_data:
            return plan
        self._pending_local_plan = self.plan  # promoted to the cache in finish_plan, as torch does
        return self.plan


@dataclasses.dataclass
class PlanCache:
    """One Checkpointer's DCP plan cache: `planner()` for each save, `clear()` at close."""

    key: str = dataclasses.field(default_factory=lambda: f"scout-ckpt-plans-{next(_KEYS)}")

    def planner(self) -> ScoutSavePlanner:
        return ScoutSavePlanner(self.key)

    def clear(self) -> None:
        """Drop this Checkpointer's cached plans and metadata from torch's class-level caches."""
        for name in _CACHES:
            getattr(SavePlanner, name, {}).pop(self.key, None)
