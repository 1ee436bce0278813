"""SDC replay for MegatronCheckpointer: which of a Megatron-Core model's modules are replayed, and where replay
cannot run.

Replay (on by default where data-parallel replicas hold whole parameters: DP >= 2 at TP = PP = 1, given
`model=`): the core's replay (save/evidence/replay.py) on the model's embedding, transformer layers and output
layer, in a ring over the data-parallel ranks, as for a DDP job; the job calls `ckpt.step(iteration)` after each
optimizer step (the rotation, and the arming of the next step's capture), and every save sweeps every target on the
save step's capture, started before any byte is written and run beside the write in a thread of its own (finished
before `save` returns). A rank whose forward or backward computes wrongly -- which
Megatron's gradient all-reduce hands to every replica, so that consensus agrees on the poisoned state -- is named
(`replay_sdc`, a live fault: LiveStateCorrupt). Off, with one WARNING at start, where it cannot run: no `model=`,
one rank, tensor or pipeline parallelism (Megatron's own parallel layers take and return shards), virtual pipeline
chunks. The optimizer's update is not replayed (Megatron's optimizers step `main_grad` buffers or, distributed,
flattened ranges one rank owns): a wrong update on one replica is left to consensus.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from scout_ckpt.errors import ScoutError
from scout_ckpt.options import ReplayOptions, as_replay

log = logging.getLogger("scout_ckpt.megatron")

__all__ = ["start", "default_targets", "parallel_sizes"]


def start(run, replay, model, timeout_s: float):
    """Every rank: (the core's replay on the model, the data-parallel ConsensusGroups it runs on) where the
    data-parallel ranks are whole replicas of it, or (None, None) with one WARNING naming why (an explicit
    `replay=True` that cannot run is an error).

    Args:
        run: the checkpointer's IntegrationRun (world size, rank).
        replay: MegatronCheckpointer's `replay=` (options.as_replay's forms).
        model: its `model=` (a module, or Megatron-LM's list of model chunks), or None.
        timeout_s: the timeout of the groups made here.
    """
    from scout_ckpt.save.evidence.replay import ReplayEvidence

    replay = as_replay(replay)  # None: on where it can run; ReplayOptions: asked for
    if replay is False:
        return None, None
    if isinstance(model, (list, tuple)):
        model = model[0] if len(model) == 1 else None
        off_chunks = "virtual pipeline model chunks" if model is None else None
    else:
        off_chunks = None
    sizes = parallel_sizes()
    off = (
        ReplayEvidence.off_by_default(run.world, "ddp")
        or off_chunks
        or ("no model= given to MegatronCheckpointer" if model is None else None)
        or (
            f"tensor/pipeline parallelism (TP={sizes.get('tensor_parallel')}, "
            f"PP={sizes.get('pipeline_parallel')}): Megatron's parallel layers take and return shards"
            if sizes.get("tensor_parallel", 1) != 1 or sizes.get("pipeline_parallel", 1) != 1
            else None
        )
        or (
            f"the data-parallel size {sizes.get('data_parallel')} is not the world {run.world}"
            if sizes.get("data_parallel", run.world) != run.world
            else None
        )
    )
    if off is not None:
        if isinstance(replay, ReplayOptions):
            raise ScoutError(f"replay was asked for but cannot run here: {off}")
        if run.rank == 0:
            log.warning("scout-ckpt: replay is off (%s): a rank computing wrongly (SDC) is not detected", off)
        return None, None
    from scout_ckpt.consensus.groups import ConsensusGroups
    from scout_ckpt.consensus.mesh import legacy_topology

    groups = ConsensusGroups.from_topology(legacy_topology("ddp", run.world), timeout_s=timeout_s)
    # Megatron's own layers are not nn.Embedding / nn.Linear: name them (a model without them: the core's
    # discovery, which turns replay off with a WARNING where it finds nothing and nothing was asked for)
    named = default_targets(model)
    if isinstance(replay, ReplayOptions):
        if replay.targets is None and named:
            replay = dataclasses.replace(replay, targets=named)
    elif named:
        replay = ReplayOptions(targets=named)
    return ReplayEvidence.start(replay, model=model, optimizer=None, groups=groups, auto_on=True), groups


def default_targets(model: torch.nn.Module) -> tuple[str, ...]:
    """Replay's targets in a Megatron-Core model, by what Megatron builds: the embedding (LanguageModelEmbedding:
    word and position embeddings together), every TransformerLayer of the decoder, its final layer norm and the
    output layer. The core's discovery looks for nn.Embedding / nn.Linear heads, which Megatron's parallel layers
    are not (VocabParallelEmbedding, ColumnParallelLinear), so it would cover the position embedding and the
    layers alone; named here, every module the forward runs is covered. Paths are as `model.named_modules()`
    gives them (a wrapper's `module.` prefix included)."""
    kinds = {"LanguageModelEmbedding", "TransformerLayer"}
    found: list[str] = []
    for path, module in model.named_modules():
        name = type(module).__name__
        if name in kinds or path.endswith(("decoder.final_layernorm", "output_layer")):
            if not any(path.startswith(f + ".") for f in found):
                found.append(path)
    return tuple(found)


def parallel_sizes() -> dict:
    """Tensor/pipeline/data-parallel sizes from parallel_state when it is initialized (for the manifest)."""
    try:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return {}
        return {
            "tensor_parallel": ps.get_tensor_model_parallel_world_size(),
            "pipeline_parallel": ps.get_pipeline_model_parallel_world_size(),
            "data_parallel": ps.get_data_parallel_world_size(),
        }
    except Exception:  # noqa: BLE001 - sizes are descriptive only
        return {}
