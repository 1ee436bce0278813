"""The frameworks' own checkpoint folder names, declared in one table: the Hugging Face Trainer's `checkpoint-N`,
DeepSpeed's `global_stepN`, Megatron-LM's `iter_NNNNNNN` (torch_dist: DCP under another name).

A ROOT may hold any of them, and reading one (`ls`, `resume`, `latest_clean`, `certify`, the walk-back) needs
their names known. The readers say so by calling `register_framework_layouts()` (the CLI at start, `latest_clean`,
each integration); nothing registers as a side effect of importing a framework's module. Torch-free, and free of
the frameworks themselves: a name is all it takes to recognise a folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from scout_ckpt.format.layout import register_folder_layout


@dataclass(frozen=True)
class FrameworkLayout:
    name: str  # the layout's name in manifests and the ledger
    pattern: re.Pattern  # a folder name of the layout; group 1 is the step
    dcp: bool  # its folders are DCP checkpoints (a `.metadata` and `__R_I.distcp` files), not plain files

    def parse(self, folder: str) -> int | None:
        m = self.pattern.match(folder)
        return int(m.group(1)) if m else None


HF_TRAINER = FrameworkLayout("hf-trainer", re.compile(r"^checkpoint-(\d+)$"), dcp=False)
DEEPSPEED = FrameworkLayout("deepspeed", re.compile(r"^global_step(\d+)$"), dcp=False)
MEGATRON = FrameworkLayout("megatron", re.compile(r"^iter_(\d{7,})$"), dcp=True)
FRAMEWORK_LAYOUTS = (HF_TRAINER, DEEPSPEED, MEGATRON)


def register_framework_layouts() -> None:
    """Make every framework folder layout known to the ROOT readers (format/layout.py). Idempotent."""
    for spec in FRAMEWORK_LAYOUTS:
        register_folder_layout(spec.name, spec.parse, dcp=spec.dcp)
