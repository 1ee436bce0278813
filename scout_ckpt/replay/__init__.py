"""SDC replay: capture one layer's (or the optimizer's) live invocation per step -- and every target's at a save --
re-execute it on every peer, compare exact signatures with C3, and report coverage of the whole model."""

from scout_ckpt.replay.schedule import Schedule, coverage, discover_targets

__all__ = ["ReplayRunner", "Schedule", "coverage", "discover_targets", "replaying"]


def __getattr__(name):  # the runner imports torch.distributed; keep `coverage` importable without it
    if name == "ReplayRunner":
        from scout_ckpt.replay.runner import ReplayRunner

        return ReplayRunner
    if name == "replaying":
        from scout_ckpt.replay.execute import replaying

        return replaying
    raise AttributeError(name)
