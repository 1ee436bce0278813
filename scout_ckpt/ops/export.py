"""Export a certified checkpoint's model weights to safetensors, with provenance in the file's metadata.

Order matters: the step must be certified (unless forced), every file's digest must match the ledger, and every
file the DCP metadata points at must be among those verified; only then are tensors read, and `read_tensors`
checks every declared size against the bytes on disk before it allocates (a hostile `.metadata` is refused with
BadInput, never a MemoryError). A sharded export
(`model-00001-of-0000N.safetensors` + `model.safetensors.index.json`) commits by writing the index last.
For an object-store run (ROOT is its ledger_dir) the objects are first copied beside the output, hashed as they
are written, and only a copy that matches the ledger is read (`_export_from_store`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from scout_ckpt.errors import BadInput, NotClean, NotFound
from scout_ckpt.format import layout, node_manifest

# Top-level components (and suffixes) that hold training state rather than model weights.
_NOT_MODEL = {
    "optim",
    "optimizer",
    "optimizers",
    "opt",
    "lr_scheduler",
    "lr_schedulers",
    "scheduler",
    "dataloader",
    "train_state",
    "rng",
    "rng_state",
    "param_groups",
}
_OPT_LEAVES = {"exp_avg", "exp_avg_sq", "momentum_buffer", "max_exp_avg_sq", "sum", "square_avg"}


def _is_param(key: str) -> bool:
    parts = key.split(".")
    return not any(p in _NOT_MODEL or p.startswith("optim") for p in parts) and parts[-1] not in _OPT_LEAVES


def detect_prefix(keys: list[str]) -> str:
    """The dotted prefix of the model weights: the common prefix of the parameter-looking keys, cut after its
    last "model" component ("model.", "app.model."), else its first component when training state sits beside
    the model, else "" (a bare model state dict)."""
    params = [k.split(".") for k in keys if _is_param(k)]
    if not params:
        raise BadInput("no model weights found in the checkpoint (pass a prefix)")
    # A component literally named "model" is the strongest hint (DCP recipe: {"app": {"model": ..., "optim": ...}}).
    named = Counter(".".join(p[: p.index("model") + 1]) for p in (k.split(".") for k in keys) if "model" in p[:-1])
    if named:
        return named.most_common(1)[0][0] + "."
    common = params[0][:-1]
    for parts in params[1:]:
        n = 0
        while n < min(len(common), len(parts) - 1) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    if "model" in common:
        common = common[: len(common) - common[::-1].index("model")]
    elif len(params) < len(keys):
        common = common[:1]
    else:
        common = []
    return ".".join(common) + "." if common else ""


def _verify(step_dir: Path, files: list[dict]) -> None:
    """Refuse to read tensors from files that do not match the ledger (verify_files, the check certify uses)."""
    from scout_ckpt.format.verify import could_not_check, verify_files

    if not files:
        raise NotClean(f"{step_dir}: the ledger lists no files for this step; nothing to verify against")
    ev = verify_files(step_dir, files, expect_complete=False)
    if could_not_check(ev):  # an I/O error: not a verdict on the checkpoint, and nothing is exported
        r = ev["reasons"][0]
        raise BadInput(
            f"{step_dir}: could not read {r.get('file') or 'a file'} now ({r.get('detail')}); nothing exported"
        )
    if ev["reasons"]:
        r = ev["reasons"][0]
        what = "is missing" if r["code"] == "missing_file" else "does not match its recorded digest"
        raise NotClean(f"{step_dir}: {r['file']} {what} ({r['code']})")


def _atomic_save(tensors: dict, path: Path, metadata: dict) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _check_out(out_path: Path) -> None:
    """BadInput before anything is read or written: the output must be a file in an existing directory (an
    existing directory as --out made the final rename fail after the whole export, with a traceback)."""
    if out_path.is_dir():
        raise BadInput(f"{out_path}: is a directory; --out names the .safetensors file to write")
    if not out_path.parent.is_dir():
        raise BadInput(f"{out_path.parent}: no such directory")


def export(
    root: str | os.PathLike,
    step: int | None,
    out_path: str | os.PathLike,
    *,
    force: bool = False,
    ledger=None,
    prefix: str | None = None,
    max_shard_bytes: int | None = None,
) -> dict:
    """Consolidate step's model weights (step None: the newest certified) into out_path (.safetensors)."""
    from scout_ckpt.ledger import Ledger

    root = Path(root)
    _check_out(Path(out_path))
    own = ledger is None
    if own:
        ledger = Ledger.open(root, readonly=True)
    try:
        row = ledger.checkpoint(step) if step is not None else ledger.latest("certified")
        if row is None:
            raise NotFound(
                f"{root}: no checkpoint for step {step}" if step is not None else f"{root}: no certified checkpoint"
            )
        step = row["step"]
        if row["state"] != "certified" and not force:
            codes = ", ".join(r.get("code", "?") for r in row.get("reasons") or []) or "no reasons recorded"
            raise NotClean(f"step {step} is {row['state']} ({codes}); pass force to export it anyway")
        files = ledger.files(step)
    finally:
        if own:
            ledger.close()
    from scout_ckpt import object_store

    store = object_store.bound_store(root)  # ROOT is the ledger_dir of an object-store run
    if store is not None:
        return _export_from_store(store, row, files, Path(out_path), prefix=prefix, max_shard_bytes=max_shard_bytes)
    from scout_ckpt.format.verify import checkpoint_dir

    step_dir = checkpoint_dir(root, row["path"] or layout.step_dirname(step))  # BadInput if it escapes ROOT
    if not step_dir.is_dir():
        raise NotClean(f"{step_dir}: checkpoint directory is missing")
    return _export_dir(step_dir, row, files, Path(out_path), prefix=prefix, max_shard_bytes=max_shard_bytes)


def _export_dir(
    step_dir: Path, row: dict, files: list[dict], out_path: Path, *, prefix: str | None, max_shard_bytes: int | None
) -> dict:
    """A local checkpoint directory: verified against `files`, then read (DCP, or a Trainer folder)."""
    _verify(step_dir, files)
    if layout.is_folder_dir(step_dir):
        return _export_folder(step_dir, row, files, out_path, prefix=prefix, max_shard_bytes=max_shard_bytes)

    from scout_ckpt.format.dcp_files import load_metadata, read_tensors

    md = load_metadata(step_dir)
    # a save of several nodes records one row per node: its shards are the rows of the node manifests just verified
    verified = {f["path"] for f in node_manifest.expand(step_dir, files)[0]}
    used = {info.relative_path for info in md.storage_data.values()}
    if layout.DCP_METADATA not in verified or not used <= verified:
        raise NotClean(
            f"{step_dir}: files not covered by the recorded digests: "
            f"{sorted((used | {layout.DCP_METADATA}) - verified)}"
        )
    from scout_ckpt.format.dcp_meta import TensorStorageMetadata

    keys = [k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
    prefix = detect_prefix(keys) if prefix is None else prefix
    tensors = {k[len(prefix) :]: v for k, v in read_tensors(step_dir, prefix or None, metadata=md).items()}
    if prefix == "":
        tensors = {k: v for k, v in tensors.items() if _is_param(k)}
    if not tensors:
        raise BadInput(f"{step_dir}: no tensors under prefix {prefix!r}")
    return _write(tensors, row, files, out_path, prefix, max_shard_bytes)


def _export_from_store(
    store, row: dict, files: list[dict], out_path: Path, *, prefix: str | None, max_shard_bytes: int | None
) -> dict:
    """An object-store checkpoint (an attempt prefix): its manifest must be the one the ledger recorded (as
    `resume` checks), then the recorded files are copied into a temp dir beside the output, every byte hashed
    as it is written, and only a copy whose sizes and digests all match the ledger is read, by the same code as
    a local step dir. Reading the local copy means the bytes exported are the bytes verified (a ranged read
    after verification could return an object replaced meanwhile). The copy is removed afterwards; it needs
    the checkpoint's size in free space beside the output (optimizer state included: DCP rank files mix it with
    the weights)."""
    import shutil
    import tempfile

    from scout_ckpt.format.safepaths import relpath_problem

    name = row["path"]
    if not name or relpath_problem(name) is not None or "/" in name:
        raise BadInput(f"the ledger records a checkpoint path that is not an attempt prefix ({name!r})")
    where = store.uri_of(name)
    if not files:
        raise NotClean(f"{where}: the ledger lists no files for this step; nothing to verify against")
    if not out_path.parent.is_dir():
        raise BadInput(f"{out_path.parent}: no such directory")
    _, reasons = store.trusted_manifest(row)
    if reasons:
        raise NotClean(f"{where}: its manifest is not the one the ledger recorded ({reasons[0]['code']})")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.fetch-", dir=out_path.parent))
    try:
        local = tmp / name
        reasons = store.fetch(name, files, local)
        if reasons:
            r = reasons[0]
            what = {"missing_file": "is missing", "digest_mismatch": "does not match its recorded digest"}.get(
                r["code"], "does not match the record"
            )
            raise NotClean(
                f"{where}: {r.get('file') or 'an object'} {what} ({r['code']}); `scout-ckpt certify` records it"
            )
        result = _export_dir(local, row, files, out_path, prefix=prefix, max_shard_bytes=max_shard_bytes)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**result, "source": where}


def _export_folder(
    step_dir: Path, row: dict, files: list[dict], out_path: Path, *, prefix: str | None, max_shard_bytes: int | None
) -> dict:
    """A Trainer `checkpoint-N` folder: its model safetensors files, once verified, are the weights."""
    from scout_ckpt.format.folder_tensors import model_files, read_model_tensors

    used = set(model_files(step_dir))
    if not used <= {f["path"] for f in files}:
        raise NotClean(
            f"{step_dir}: files not covered by the recorded digests: {sorted(used - {f['path'] for f in files})}"
        )
    tensors = read_model_tensors(step_dir)
    if prefix:
        tensors = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    if not tensors:
        raise BadInput(f"{step_dir}: no tensors under prefix {prefix!r}")
    return _write(tensors, row, files, out_path, prefix or "", max_shard_bytes)


def _write(
    tensors: dict, row: dict, files: list[dict], out_path: Path, prefix: str, max_shard_bytes: int | None
) -> dict:
    step = row["step"]
    meta = {
        "format": "pt",
        "scout.step": str(step),
        "scout.run_id": str(row.get("run_id")),
        "scout.state": str(row["state"]),
        "scout.manifest_digest": str(row.get("manifest_digest")),
        "scout.prefix": prefix,
        "scout.files": json.dumps({f["path"]: f["digest"] for f in files}, sort_keys=True),
    }
    out_path = Path(out_path)
    if not out_path.parent.is_dir():
        raise BadInput(f"{out_path.parent}: no such directory")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    written: list[str] = []
    if max_shard_bytes is None or total <= max_shard_bytes:
        _atomic_save(tensors, out_path, meta)
        written.append(str(out_path))
    else:
        shards: list[dict] = [{}]
        size = 0
        for name in sorted(tensors):
            nb = tensors[name].numel() * tensors[name].element_size()
            if shards[-1] and size + nb > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = tensors[name]
            size += nb
        stem = out_path.name[: -len(".safetensors")] if out_path.name.endswith(".safetensors") else out_path.name
        n = len(shards)
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"{stem}-{i:05d}-of-{n:05d}.safetensors"
            _atomic_save(shard, out_path.parent / name, {**meta, "scout.shard": f"{i}/{n}"})
            written.append(str(out_path.parent / name))
            weight_map.update({k: name for k in shard})
        index = out_path.parent / f"{stem}.safetensors.index.json"
        layout.atomic_write_json(index, {"metadata": {"total_size": total, **meta}, "weight_map": weight_map})
        written.append(str(index))
    layout.fsync_dir(out_path.parent)
    return {
        "step": step,
        "state": row["state"],
        "run_id": row.get("run_id"),
        "prefix": prefix,
        "tensors": len(tensors),
        "bytes": total,
        "files": written,
        "forced": row["state"] != "certified",
    }
