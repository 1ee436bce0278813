"""What replay's bit-for-bit comparison rests on, per device, and how a CUDA job makes it hold.

Replay never compares within a tolerance: every row compares exact signatures (a replay against the other peers'
replays, and against the live step). That is sound only where the same computation on the same inputs gives the
same bits every time, so this module names the settings the comparison ran under, and each replay row and the
save's replay evidence carry that name (`comparison`):

- `bitwise (cpu)`: CPU kernels give the same bits for the same inputs at a fixed thread count, which a process
  keeps between its live step and its replays.
- `bitwise (cuda, deterministic settings)`: the job turned on torch's deterministic algorithms with a fixed cuBLAS
  workspace and cuDNN's deterministic, non-benchmarked choice (`enable()` does all of it, and must run before the
  first CUDA matmul: the cuBLAS workspace size is read once per process). The live step, the replays on every peer
  and the self-check then run the same kernels, atomics-free: outputs and gradients are compared bit for bit.
- `bitwise (cuda, default settings: live gradients not signed)`: the job did not. Replays still run under
  deterministic algorithms (execute.replay_mode), so peers' replays agree with each other, and the live outputs are
  compared bit for bit; live gradients are not signed (capture.py: backward kernels use atomics, so a healthy
  backward differs from its replay). Forward kernels without atomics (matmuls, norms, attention's forward,
  elementwise ops, embedding lookups) give the same bits either way; a model whose forward adds with atomics
  (`index_add_`, `scatter_add_`, ...) or whose convolutions cuDNN benchmarks needs `enable()`, or its healthy live
  outputs would differ from their replays.

Why no bound: a tolerance would have to be wide enough for a different summation order (relative 1e-6 for fp32
matmuls, far more in bf16) and so would pass the small corruptions replay exists to catch (a flipped low mantissa
bit is well inside it); fixing the kernels keeps the comparison exact. `repeat_check` is the oracle for "never a
false SDC on a healthy device": one live step captured, then replayed N times, every replay compared with the live
signatures and with the first replay (scripts/gpu_check.py runs it 100 times on the device).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

CPU = "bitwise (cpu)"
CUDA_DETERMINISTIC = "bitwise (cuda, deterministic settings)"
CUDA_DEFAULT = "bitwise (cuda, default settings: live gradients not signed)"

# The cuBLAS workspace that makes its kernels deterministic across streams (torch's reproducibility notes name
# ":4096:8" and ":16:8"; the first costs 32 MiB of device memory per stream and keeps the faster kernels).
CUBLAS_WORKSPACE = ":4096:8"
_VALID_WORKSPACES = (":4096:8", ":16:8")


@dataclass(frozen=True)
class Settings:
    """The process-wide flags the comparison depends on, as read now (torch's own getters, nothing changed)."""

    device: str                     # "cpu" or "cuda"
    deterministic_algorithms: bool  # torch.use_deterministic_algorithms
    warn_only: bool
    cublas_workspace: str | None    # CUBLAS_WORKSPACE_CONFIG in this process's environment
    cudnn_deterministic: bool
    cudnn_benchmark: bool

    @property
    def deterministic(self) -> bool:
        """Every setting `enable()` makes is in effect (on CPU: nothing is needed)."""
        return self.device == "cpu" or (self.deterministic_algorithms and self.cublas_workspace in _VALID_WORKSPACES
                                        and self.cudnn_deterministic and not self.cudnn_benchmark)

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
    return Settings(device=kind,
                    deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
                    warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
                    cublas_workspace=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                    cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
                    cudnn_benchmark=bool(torch.backends.cudnn.benchmark))


def comparison(device=None) -> str:
    """settings(device).comparison: what a replay row records (rows.replay_row)."""
    return settings(device).comparison


def enable(warn_only: bool = True) -> Settings:
    """Turn on the settings under which a CUDA job's live step and its replays are bit for bit reproducible:
    CUBLAS_WORKSPACE_CONFIG (kept when already set to a valid value), deterministic algorithms, cuDNN deterministic
    and not benchmarked. Call it at the top of the training script, before the first CUDA matmul (the workspace
    size is read once per process). `warn_only=True` (the default) lets an operation without a deterministic
    implementation run with a warning naming it rather than raise; such an operation makes the live step differ
    from its replays. Harmless on CPU. Returns the settings now in effect."""
    import torch

    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in _VALID_WORKSPACES:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return settings("cuda" if torch.cuda.is_available() else "cpu")


def repeat_check(module, args: tuple, n: int, grads: bool = True) -> dict:
    """The healthy-device oracle: one live forward and backward of `module` on `args` captured as a save step's
    would be (capture.ModuleCapture, live signatures on), then `n` replays of that capture on copies, each compared
    with the live signatures (live.self_check) and with the first replay's signatures. On a healthy device every
    count but `replays` is 0. Returns {"replays", "self_check_failed": {outcome name: count}, "replays_differ",
    "signatures", "grad_note", "comparison", "settings"}."""
    import torch

    from scout_ckpt.consensus.signatures import replica_signatures
    from scout_ckpt.replay import live
    from scout_ckpt.replay.capture import ModuleCapture, device_of
    from scout_ckpt.replay.execute import replay_module

    names = frozenset(n_ for n_, _ in module.named_parameters())
    cap = ModuleCapture(module, live=True, refs=False, grads=grads, grad_params=names if grads else None)
    cap.arm()
    try:
        out = module(*args)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.float().square().mean().backward()
    finally:
        cap.disarm()
    inv = cap.invocation
    outcome = {live.SELF_AGREE: "agree", live.SELF_OUTPUT: "output", live.SELF_GRAD: "gradient",
               live.SELF_UNCHECKED: "unchecked"}
    failed: dict[str, int] = {}
    first = None
    differ = 0
    sigs = None
    for _ in range(n):
        labels, tensors = replay_module(module, inv, hook_ids=cap.hook_ids)
        sigs = replica_signatures(tensors)
        code = live.self_check(labels, sigs, inv)
        if code != live.SELF_AGREE:
            name = outcome.get(code, str(code))
            failed[name] = failed.get(name, 0) + 1
        if first is None:
            first = sigs
        elif not torch.equal(first, sigs):
            differ += 1
    dev = device_of(module)
    return {"replays": n, "self_check_failed": failed, "replays_differ": differ,
            "signatures": 0 if sigs is None else int(sigs.shape[0]), "live_signed": sorted(inv.live_grads or {}),
            "grad_note": inv.grad_note, "comparison": comparison(dev), "settings": settings(dev).as_dict()}


__all__ = ["CPU", "CUBLAS_WORKSPACE", "CUDA_DEFAULT", "CUDA_DETERMINISTIC", "Settings", "comparison", "enable",
           "repeat_check", "settings"]
