"""Where a rank runs, as an operator names hardware: host, local rank, and the device's stable identity.

A global rank is a job's name for a process; an operator drains hosts and replaces GPUs. Each rank gathers its
identity once at start-up (placement.this_rank carries it to the coordinator, which keeps it in the ledger's
run_ranks rows): the host (SCOUT_CKPT_HOST where the scheduler's node name differs from the hostname, e.g. a
Kubernetes pod's), the local rank, and on a GPU the board's UUID and serial through NVML, which stay with the
device when it moves between hosts or jobs. On CPU the device is the host and local rank. The job is
SCOUT_CKPT_JOB, else the scheduler's (SLURM_JOB_ID), else torchrun's rendezvous id.
"""

from __future__ import annotations

import os
import socket

JOB_ENV = ("SCOUT_CKPT_JOB", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")


def host_name() -> str:
    return os.environ.get("SCOUT_CKPT_HOST") or socket.gethostname()


def job_id() -> str | None:
    for name in JOB_ENV:
        if os.environ.get(name):
            return os.environ[name]
    return None


def cpu_device(host: str, local_rank: int | None) -> str:
    """The device name of a rank without a GPU: its host and local rank."""
    return f"{host}:cpu{local_rank if local_rank is not None else '?'}"


def _nvml(index: int) -> dict:
    """{"uuid", "serial", "name"} of GPU `index` (the CUDA device of this local rank), {} without NVML."""
    try:
        import pynvml as nv

        nv.nvmlInit()
        if index >= nv.nvmlDeviceGetCount():
            return {}
        h = nv.nvmlDeviceGetHandleByIndex(index)
        out: dict[str, str | None] = {"uuid": _text(nv.nvmlDeviceGetUUID(h)), "name": _text(nv.nvmlDeviceGetName(h))}
        try:
            out["serial"] = _text(nv.nvmlDeviceGetSerial(h))
        except Exception:  # noqa: BLE001 - consumer boards have no serial (NVMLError_NotSupported)
            out["serial"] = None
        return out
    except Exception:  # noqa: BLE001 - no pynvml, no driver (NVMLError_LibraryNotFound): a CPU identity
        return {}


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _gpu_index(local_rank: int | None) -> int | None:
    """The GPU this rank uses: the current CUDA device where torch is loaded and CUDA is up, else its local
    rank where any GPU is visible (the torchrun convention), else None."""
    import sys

    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
        if torch is not None and not torch.cuda.is_available():
            return None
    except Exception:  # noqa: BLE001 - a broken CUDA setup is a CPU identity, never a failed start
        return None
    return local_rank if local_rank is not None else 0


def this_device(local_rank: int | None) -> dict:
    """{"host", "local_rank", "device", "uuid", "serial", "gpu", "job"}: `device` is the GPU's UUID where NVML
    names one, else `host:cpuL`. Local, cheap (one NVML query), never raises."""
    host = host_name()
    gpu: dict = {}
    index = _gpu_index(local_rank)
    if index is not None:
        gpu = _nvml(index)
    uuid = gpu.get("uuid")
    return {
        "host": host,
        "local_rank": local_rank,
        "device": uuid or cpu_device(host, local_rank),
        "uuid": uuid,
        "serial": gpu.get("serial"),
        "gpu": gpu.get("name"),
        "job": job_id(),
    }
