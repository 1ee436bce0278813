"""Tensors of a Trainer `checkpoint-N` folder read from its files, for offline checks (`certify`'s invariants) and
`export`. Imports torch and safetensors: call only after the files' digests have verified.

Names match what ScoutTrainerCallback checks live: "model.<param>" from the model's safetensors files and
"optimizer.state.<i>.<exp_avg...>" from optimizer.pt, so an invariant spec means the same online and offline.
optimizer.pt is a pickle: it is read with torch.load(weights_only=True), the restricted unpickler.
"""

from __future__ import annotations

from pathlib import Path

from scout_ckpt.errors import BadInput


def model_files(step_dir: Path) -> list[str]:
    """The model weight files of the folder: model.safetensors or the shards its index names."""
    step_dir = Path(step_dir)
    index = step_dir / "model.safetensors.index.json"
    if index.is_file():
        import json

        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise BadInput(f"{index}: malformed index ({e})") from None
    if (step_dir / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise BadInput(f"{step_dir}: no model.safetensors (a Trainer checkpoint saved with safetensors is expected)")


def read_model_tensors(step_dir: Path) -> dict:
    """{param name: tensor} of the model weights (without the "model." prefix)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out = {}
    for name in model_files(step_dir):
        try:
            out.update(load_file(str(Path(step_dir) / name)))
        except (SafetensorError, OSError) as e:
            raise BadInput(f"{Path(step_dir) / name}: unreadable safetensors ({e})") from None
    return out


def read_tensors(step_dir: Path) -> dict:
    """{"model.<name>": tensor, "optimizer.<...>": tensor} for the offline invariants."""
    import torch

    from scout_ckpt.consensus.signatures import flatten_state

    state = {"model": read_model_tensors(step_dir)}
    opt = Path(step_dir) / "optimizer.pt"
    if opt.is_file():
        try:
            state["optimizer"] = torch.load(opt, map_location="cpu", weights_only=True)
        except Exception as e:  # a pickle the restricted unpickler refuses, or a torn file
            raise BadInput(f"{opt}: unreadable optimizer state ({type(e).__name__})") from None
    return {k: v for k, v in flatten_state(state).items() if isinstance(v, torch.Tensor)}
