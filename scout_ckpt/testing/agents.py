"""Several torchrun agents on one host, as on several nodes: used by the multi-node and fast-tier tests and the
node-loss campaign.

Each agent is a real `torch.distributed.run` with its own `--node-rank`, all meeting at one c10d rendezvous on
127.0.0.1 (docs/pytorch-facts.md, "torchrun restarts and exit"). `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` is set because
torchrun's restarts hang without it when the agent's store is shared with the workers. A test that kills a whole
"node" starts agent 0 first (`first_hosts=True`), so that the agent hosting the rendezvous store is never the one
killed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_agents(
    script: Path,
    args: list[str],
    *,
    nnodes: int,
    nproc: int,
    repo: Path,
    max_restarts: int = 2,
    node_env: dict[int, dict[str, str]] | None = None,
    first_hosts: bool = False,
    timeout: float = 600.0,
    timed_out_rc: int | None = None,
) -> list[subprocess.CompletedProcess]:
    """Run `script args` under `nnodes` agents of `nproc` workers each and wait for all; one CompletedProcess per
    node, in node order. `node_env[node]` adds to that agent's environment. An agent past `timeout` raises
    subprocess.TimeoutExpired, or, with `timed_out_rc`, is recorded with that return code and "timed out" as its
    stderr (a campaign counts it and goes on). Agents still running at the end are SIGKILLed."""
    port = free_port()
    procs = []
    try:
        for node in range(nnodes):
            env = {
                **os.environ,
                "PYTHONPATH": str(repo),
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                "OMP_NUM_THREADS": "1",
                **(node_env or {}).get(node, {}),
            }
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(nnodes),
                "--node-rank",
                str(node),
                "--nproc-per-node",
                str(nproc),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                f"job-{port}",
                "--max-restarts",
                str(max_restarts),
                "--monitor-interval",
                "0.5",
                str(script),
                *map(str, args),
            ]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
            if first_hosts and node == 0:
                time.sleep(1.0)
        out = []
        for p in procs:
            try:
                so, se = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                if timed_out_rc is None:
                    raise
                p.kill()
                so, se = p.communicate()
                out.append(subprocess.CompletedProcess(p.args, timed_out_rc, so, (se or "") + "\ntimed out"))
                continue
            out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
