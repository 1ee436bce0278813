"""What a Checkpointer records about its run at start-up: the replica topology and the software versions.

Kept out of the facade (checkpointer.py) because neither depends on its state: both are pure functions of the
arguments, identical on every rank.
"""

from __future__ import annotations

import platform

import torch

import scout_ckpt
from scout_ckpt.consensus.mesh import describe_topology
from scout_ckpt.errors import ScoutError


def topology(model, mesh, world_size: int) -> dict:
    """Replica layout (consensus.mesh): from the mesh and the model's DTensor placements. Local, identical on
    every rank; ConsensusGroups.from_topology checks that it is."""
    try:
        return describe_topology(model, mesh=mesh, world_size=world_size)
    except ValueError as e:
        raise ScoutError(f"topology: {e}") from None


def versions() -> dict:
    return {"scout_ckpt": scout_ckpt.__version__, "torch": torch.__version__, "python": platform.python_version()}
