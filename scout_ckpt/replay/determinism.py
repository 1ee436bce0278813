"""What replay's bit-for-bit comparison rests on, per device, and the settings that make it hold on CUDA.

Replay never compares within a tolerance: every row compares exact signatures (a replay against the other peers'
replays, and against the live step). That is sound only where the same computation on the same inputs gives the
same bits every time, so this module decides the settings replays run under and names what the comparison rested
on; each replay row and the save's replay evidence carry that name (`comparison`):

- `bitwise (cpu)`: CPU kernels give the same bits for the same inputs at a fixed thread count, which a process
  keeps between its live step and its replays.
- `bitwise (cuda, deterministic settings)`: the job runs torch's deterministic algorithms strictly
  (`warn_only=False`), with a fixed cuBLAS workspace and cuDNN's deterministic, non-benchmarked choice
  (`enable(warn_only=False)`, before the first CUDA matmul: the workspace size is read once per process). The live
  step, every peer's replay and the self-check run the same deterministic kernels: outputs and gradients compared.
- `bitwise (cuda, deterministic replays; live gradients not signed)`: any other CUDA job. Replays run under strict
  deterministic algorithms (`replay_warn_only`), so peers' replays of one capture agree bit for bit, gradients
  included (the rotation compares them); the live outputs are compared with replays bit for bit (the save's ring
  check, the self-check); the live gradients are not signed (capture.py),
  because a backward outside strict mode adds with atomics: attention's backward (memory-efficient and flash
  kernels split the keys and accumulate) differs from run to run even under `warn_only=True`.

Why strict in replays: with `warn_only=True` torch keeps those attention backwards non-deterministic (it warns
once), and two healthy peers' replays of one block would disagree; strict mode makes them deterministic, and an
operation with no deterministic implementation raises instead, so that target's replay fails: not checked, never
a false SDC. Why no bound: a tolerance wide enough for a different summation order (about 1e-6 relative for fp32
matmuls, far more in bf16) would also pass the small corruptions replay exists to catch (a flipped low mantissa
bit is well inside it). Why the live step is not made strict for the user: torch refuses strict mode for some
common training operations on CUDA (NLLLoss, so cross_entropy), so `enable()` defaults to `warn_only=True`, which
still fixes the cuBLAS workspace and cuDNN's choice for the live forward.

`replay.repeat.repeat_check` is the oracle for "never a false SDC on a healthy device": one live step captured, then
replayed N times, every replay compared with the live signatures and with the first replay (scripts/gpu_check.py
runs it 100 times on the device, under each setting).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

CPU = "bitwise (cpu)"
CUDA_DETERMINISTIC = "bitwise (cuda, deterministic settings)"
CUDA_DEFAULT = "bitwise (cuda, deterministic replays; live gradients not signed)"

# The cuBLAS workspace that makes its kernels deterministic across streams (torch's reproducibility notes name
# ":4096:8" and ":16:8"; the first costs 32 MiB of device memory per stream and keeps the faster kernels).
CUBLAS_WORKSPACE = ":4096:8"
_VALID_WORKSPACES = (":4096:8", ":16:8")


@dataclass(frozen=True)
class Settings:
    """The process-wide flags the comparison depends on, as read now (torch's own getters, nothing changed)."""

    device: str  # "cpu" or "cuda"
    deterministic_algorithms: bool  # torch.use_deterministic_algorithms
    warn_only: bool
    cublas_workspace: str | None  # CUBLAS_WORKSPACE_CONFIG in this process's environment
    cudnn_deterministic: bool
    cudnn_benchmark: bool

    @property
    def deterministic(self) -> bool:
        """Every setting `enable(warn_only=False)` makes is in effect (on CPU: nothing is needed)."""
        return self.device == "cpu" or (
            self.deterministic_algorithms
            and not self.warn_only
            and self.cublas_workspace in _VALID_WORKSPACES
            and self.cudnn_deterministic
            and not self.cudnn_benchmark
        )

    @property
    def comparison(self) -> str:
        """The name a replay row and the save's evidence carry (module docstring)."""
        if self.device == "cpu":
            return CPU
        return CUDA_DETERMINISTIC if self.deterministic else CUDA_DEFAULT

    def as_dict(self) -> dict:
        return {**asdict(self), "deterministic": self.deterministic, "comparison": self.comparison}


def settings(device=None) -> Settings:
    """The settings for `device` ("cpu", "cuda", "cuda:1", a torch.device). Without one: "cuda" when this process
    has initialised CUDA (a job that trains on a GPU has), else "cpu" -- which never initialises CUDA itself."""
    import torch

    if device is None:
        kind = "cuda" if torch.cuda.is_initialized() else "cpu"
    else:
        kind = torch.device(device).type
    kind = "cpu" if kind == "cpu" else "cuda"
    return Settings(
        device=kind,
        deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
        warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
        cublas_workspace=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
        cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
    )


def comparison(device=None) -> str:
    """settings(device).comparison: what a replay row records (rows.replay_row)."""
    return settings(device).comparison


def replay_warn_only(device) -> bool:
    """`warn_only` of the deterministic algorithms a replay on `device` runs under (execute.replay_mode): strict on
    CUDA, where warn-only mode leaves attention's backward non-deterministic (module docstring); as before on the
    host, whose kernels need nothing more."""
    import torch

    return torch.device(device).type != "cuda"


def live_grads_reproducible() -> bool:
    """Whether a live CUDA backward gives the bits its replay will (capture.py signs the live gradients only then):
    the job runs the strict deterministic settings (`Settings.deterministic`)."""
    return settings("cuda").deterministic


def enable(warn_only: bool = True) -> Settings:
    """Turn on the settings that make a CUDA job's live kernels its replays' kernels: CUBLAS_WORKSPACE_CONFIG (kept
    when already set to a valid value), deterministic algorithms, cuDNN deterministic and not benchmarked. Call it
    at the top of the training script, before the first CUDA matmul (the workspace size is read once per process).
    `warn_only=True` (the default) lets an operation without a deterministic implementation run with a warning
    instead of raising -- torch has none for NLLLoss on CUDA, so cross_entropy needs it -- and then the live
    gradients are not signed (the comparison says so); `warn_only=False` makes the whole step deterministic and
    the live gradients are compared too. Harmless on CPU. Returns the settings now in effect."""
    import torch

    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in _VALID_WORKSPACES:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return settings("cuda" if torch.cuda.is_available() else "cpu")


__all__ = [
    "CPU",
    "CUBLAS_WORKSPACE",
    "CUDA_DEFAULT",
    "CUDA_DETERMINISTIC",
    "Settings",
    "comparison",
    "enable",
    "live_grads_reproducible",
    "replay_warn_only",
    "settings",
]
