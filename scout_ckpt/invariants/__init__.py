"""Model-intrinsic invariants: properties a healthy state has whether or not a replica exists to compare with.

A check is configured as a JSON-able spec (stored in the run's policy and in each manifest, so `certify` can
re-run it offline from the saved bytes):

    {"check": "frobenius_sphere", "params": "blocks.*.weight", "radius": 1.0, "rtol": 1e-3}
    "frobenius_sphere:radius=1.0:params=blocks.*.weight"          (string shorthand)

`params` (alias `path`) is an fnmatch glob over flat DCP keys; it also matches after any dotted prefix, so
"blocks.*.weight" finds "model.blocks.0.weight" on disk and "blocks.0.weight" in memory.

run_local works on each rank's own shard. Properties that are local (finite, a row norm of a row-sharded matrix,
a replicated counter) are checked where the data is; the rest (the Frobenius norm of a sharded DTensor, the
spectral norm via the Gram matrix of a row- or column-sharded matrix, row sums split across ranks) are combined
with ONE all_reduce of a small float64 vector, in which every rank also writes its own failure bitmap, so every
rank ends with the same evidence naming the failing ranks. A 4 x int64 all_reduce runs before it to prove that
all ranks planned the same layout (otherwise the data all_reduce could mismatch and hang).
"""

from scout_ckpt.invariants.checks import SPECTRAL_GRAM_MAX, View
from scout_ckpt.invariants.run import flatten, run_local, run_offline
from scout_ckpt.invariants.specs import KINDS, VOUCHES, Check, Param, parse_specs

__all__ = [
    "KINDS",
    "SPECTRAL_GRAM_MAX",
    "VOUCHES",
    "Check",
    "Param",
    "View",
    "flatten",
    "parse_specs",
    "run_local",
    "run_offline",
]
