"""scout-ckpt: certified checkpoints for torch.distributed.checkpoint.

Public names are imported lazily (PEP 562) so that read-only tools (`scout-ckpt ls/resume/explain/report`)
never pay for `import torch`.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Checkpointer": "scout_ckpt.checkpointer",
    "ModelOptimizerState": "scout_ckpt.save.app_state",
    "RNGState": "scout_ckpt.save.app_state",
    "RankLocal": "scout_ckpt.save.app_state",
    "Scalars": "scout_ckpt.save.app_state",
    "Ledger": "scout_ckpt.ledger",
    "STATES": "scout_ckpt.ledger",
    "Verdict": "scout_ckpt.policy",
    "evaluate": "scout_ckpt.policy",
    "latest_clean": "scout_ckpt.ops.recovery",
    "ScoutError": "scout_ckpt.errors",
    "BadOption": "scout_ckpt.errors",
    "LiveStateCorrupt": "scout_ckpt.errors",
    "StartRefused": "scout_ckpt.errors",
    "RootInUse": "scout_ckpt.errors",
    "CheckpointsUnreadable": "scout_ckpt.errors",
    "CheckpointsUnverified": "scout_ckpt.errors",
    "StateOverwritten": "scout_ckpt.errors",
    "CertifiedStep": "scout_ckpt.errors",
    "Quarantined": "scout_ckpt.errors",
    "SaveRefused": "scout_ckpt.errors",
    "CommitError": "scout_ckpt.errors",
    "LoadVerificationError": "scout_ckpt.errors",
    "NoCleanCheckpoint": "scout_ckpt.errors",
    "LedgerError": "scout_ckpt.errors",
    "LedgerUnavailable": "scout_ckpt.errors",
    "NoTargets": "scout_ckpt.errors",
    "ReplayOptions": "scout_ckpt.options",
    "ObserverOptions": "scout_ckpt.options",
    "StragglerRule": "scout_ckpt.options",
    "ShardEvidenceOptions": "scout_ckpt.options",
    "LocalTierOptions": "scout_ckpt.options",
    "FleetOptions": "scout_ckpt.options",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'scout_ckpt' has no attribute {name!r}")
