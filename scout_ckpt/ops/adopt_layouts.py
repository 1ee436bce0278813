"""Folder layouts `scout-ckpt adopt` takes in besides DCP `step-N`: registered by the integration that knows the
framework (integrations/mg_folders.py registers Megatron-Core's `iter_NNNNNNN`), so that ops/ never imports an
integration (the same pattern as format/layout.register_folder_layout, which makes `ls`/`resume` list them).

A registered layout is a DCP checkpoint under another folder name, with what its framework adds: files its own
load needs besides `.metadata` and `__R_I.distcp` (Megatron: `common.pt`, `metadata.json`), a further structure
check, and optionally a file of the framework's own per-file SHA-256 digests written at save (Megatron-Core
r0.18+: `integrity.json`), which adopt checks every file against (ops/adopt_integrity.py). Torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from scout_ckpt.errors import BadInput
from scout_ckpt.format import layout


@dataclass(frozen=True)
class AdoptLayout:
    """One adoptable folder layout."""

    name: str
    """The layout's name, recorded as the manifest's and the adopt run's "layout"."""
    label: str
    """How a person names the folders, for messages ("Megatron iter_NNNNNNN")."""
    parse: Callable[[str], int | None]
    """Folder name -> its step (the iteration), or None when the name is not of this layout."""
    required: tuple[str, ...] = ()
    """Files the framework's own load needs besides DCP's; one absent is `missing_file` (structure)."""
    check: Callable[[Path], list[dict]] | None = None
    """Further structure problems of a folder, as reasons ({"code", "file", "detail"}); [] when none."""
    integrity: str | None = None
    """The framework's own digest file in the folder (its shape: ops/adopt_integrity.py), or None."""
    extra: Callable[[int], dict] | None = None
    """Manifest fields of the framework's own for a step (Megatron: {"iteration": N})."""


_LAYOUTS: dict[str, AdoptLayout] = {}


def register(spec: AdoptLayout) -> None:
    """Declare a folder layout adopt takes in (idempotent: a second registration of a name replaces the first)."""
    _LAYOUTS[spec.name] = spec


def registered() -> list[AdoptLayout]:
    return list(_LAYOUTS.values())


def folders(root: str | os.PathLike) -> dict[int, tuple[Path, AdoptLayout | None]]:
    """{step: (folder, its layout, None for DCP step-N)} of every adoptable folder under root. Two folders for one
    step (`step-10` and `iter_0000010`) are refused (BadInput): which one is the step cannot be told."""
    out: dict[int, tuple[Path, AdoptLayout | None]] = {s: (d, None) for s, d in layout.list_step_dirs(root).items()}
    for spec in _LAYOUTS.values():
        for step, d in layout.scan_dirs(root, spec.parse).items():
            if step in out:
                raise BadInput(
                    f"{root}: two folders for step {step} ({out[step][0].name}, {d.name}); adopt one at a time"
                )
            out[step] = (d, spec)
    return dict(sorted(out.items()))


def missing_required(step_dir: Path, spec: AdoptLayout | None) -> list[dict]:
    """The structure reasons of a registered layout's own: required files absent, then its check's problems."""
    if spec is None:
        return []
    reasons = [
        {"code": "missing_file", "file": f, "detail": f"{spec.label} folders need it to load"}
        for f in spec.required
        if not (step_dir / f).is_file()
    ]
    if spec.check is not None and not reasons:
        reasons += spec.check(step_dir)
    return reasons
