"""Where each global rank runs: host, torchrun's node (agent) rank, local rank, pid.

In a multi-node job a global rank alone does not tell an operator which machine to drain. torchrun gives every
worker GROUP_RANK (the rank of its agent in the rendezvous: the node rank actually assigned, which with the c10d
backend need not equal the `--node-rank` flag), LOCAL_RANK, LOCAL_WORLD_SIZE, ROLE_RANK and
TORCHELASTIC_RESTART_COUNT (which counts per agent: only the failing node's count grows). The coordinator records
them once per run (ledger table run_ranks), and the ledger adds the node of every rank an event names.
"""

from __future__ import annotations

import os
import socket

_ENV = {
    "node_rank": "GROUP_RANK",
    "local_rank": "LOCAL_RANK",
    "local_world_size": "LOCAL_WORLD_SIZE",
    "role_rank": "ROLE_RANK",
    "restart_count": "TORCHELASTIC_RESTART_COUNT",
    "max_restarts": "TORCHELASTIC_MAX_RESTARTS",
    "nnodes_world": "GROUP_WORLD_SIZE",
}


def _int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def this_rank(rank: int) -> dict:
    """This process's place: {"rank", "host", "pid", "node_rank", "local_rank", ..., "device"} (None where not
    launched by torchrun); "device" is the hardware identity the fleet record uses (fleet/identity.py)."""
    from scout_ckpt.fleet.identity import this_device

    env = {k: _int(v) for k, v in _ENV.items()}
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        **env,
        "device": this_device(env["local_rank"]),
    }


def record(ledger, run_id: str, rank: int, group, coordinator: int = 0) -> list[dict] | None:
    """Collective on `group` (every rank, at start-up, after the run id is known): gathers every rank's place to
    the coordinator, which records them in its `ledger` (None elsewhere). A ledger error is logged, not raised:
    placement is a label, and every rank has already passed the gather."""
    import torch.distributed as dist

    mine = this_rank(rank)
    out: list | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == coordinator else None
    dist.gather_object(mine, out, dst=coordinator, group=group)
    if out is not None and ledger is not None:
        try:
            ledger.record_ranks(run_id, out)
        except Exception as e:  # noqa: BLE001 - see the docstring
            from scout_ckpt.save import log

            log.logger.warning("rank placement not recorded: %s", e)
    return out
