"""A Megatron-Core job that knows nothing of scout-ckpt (2 CPU/gloo ranks under torchrun), for
tests/test_adopt_megatron.py: it saves `SAVE_DIR/iter_NNNNNNN` with plain `dist_checkpointing.save` (torch_dist),
then, as Megatron-LM's training loop does, rank 0 writes `SAVE_DIR/latest_checkpointed_iteration.txt`.

With --integrity, rank 0 also writes the folder's `integrity.json` after the save, as Megatron-Core r0.18+ does with
`dist_checkpointing.save(..., verify_integrity=True)`. megatron-core 0.16.1 (the newest that installs on Python
3.11) has no such option, so the function below follows Megatron-LM main's `save_integrity_manifest`
(megatron/core/dist_checkpointing/validation.py, added by commit 970c2540aa8d7576e0e3ecde2a26f4bba6bffe10,
"checkpoint integrity verification (#4305)", first released in core_v0.18.0): every regular file directly in the
folder but integrity.json itself, sorted by path, hashed with SHA-256 in 1 MiB chunks, written as
`{"algorithm": "sha256", "files": {name: hex}}` with json.dump(indent=2). It is written here, independently of
scout-ckpt, so that the test's oracle does not come from the code under test.

Its own oracle: sha256 of every rank's tensors at each save, written to --events (one JSON line per save). With
--load ITER_DIR it saves nothing: it loads that folder with `dist_checkpointing.load` and writes the digest of what
it loaded (event "loaded"), to compare with the one written when it was saved.

The state is a sharded state dict as Megatron's modules build it: `w` split over the tensor-parallel ranks
(axis 0), `b` replicated (`replica_id` = (0, TP rank, DP rank), as Megatron's layer norms), `iteration` in
common.pt. Test-only: the CUDA shim (megatron-core 0.16.1 calls torch.cuda.synchronize()/current_device()
unconditionally in its torch_dist writer; see docs/pytorch-facts.md, "Megatron-Core 0.16.1")."""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist

torch.cuda.synchronize = lambda *a, **k: None  # test-only CUDA shim (see the module docstring)
torch.cuda.current_device = lambda: "cpu"

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402

INTEGRITY = "integrity.json"


def save_integrity_manifest(checkpoint_dir: str) -> None:
    """Megatron-LM main's validation.save_integrity_manifest (commit 970c2540), without its storage shim."""
    files = {}
    for entry in sorted(os.scandir(checkpoint_dir), key=lambda e: e.path):
        if entry.is_file() and entry.name != INTEGRITY:
            h = hashlib.sha256()
            with open(entry.path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            files[entry.name] = h.hexdigest()
    with open(os.path.join(checkpoint_dir, INTEGRITY), "w") as f:
        json.dump({"algorithm": "sha256", "files": files}, f, indent=2)


def digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, h.hexdigest())
    return ":".join(x[:16] for x in every)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("save_dir")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--integrity", action="store_true", help="write integrity.json as Megatron-Core r0.18+ does")
    ap.add_argument("--load", default=None, help="load this iter_NNNNNNN folder and record its digest; no saves")
    ap.add_argument("--events", required=True)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    rank = dist.get_rank()
    tp, tp_rank = args.tp, parallel_state.get_tensor_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    torch.manual_seed(0)
    state = {"w": torch.randn(8, 16).chunk(tp, dim=0)[tp_rank].clone(), "b": torch.zeros(16)}

    def sharded(it):
        return {
            "w": ShardedTensor.from_rank_offsets("w", state["w"], (0, tp_rank, tp), replica_id=dp_rank),
            "b": ShardedTensor.from_rank_offsets("b", state["b"], replica_id=(0, tp_rank, dp_rank)),
            "iteration": it,
        }

    if args.load:
        loaded = dist_checkpointing.load(sharded(0), args.load)
        state = {"w": loaded["w"], "b": loaded["b"]}
        d = digest(state)
        if rank == 0:
            with open(args.events, "a") as f:
                f.write(json.dumps({"event": "loaded", "step": loaded["iteration"], "digest": d}) + "\n")
        dist.destroy_process_group()
        return
    for it in range(1, args.iters + 1):
        state["w"].mul_(0.9).add_(torch.randn(state["w"].shape, generator=torch.Generator().manual_seed(it)) * 0.1)
        state["b"].add_(torch.randn(16, generator=torch.Generator().manual_seed(-it)) * 0.01)
        if it % args.save_every:
            continue
        iter_dir = os.path.join(args.save_dir, f"iter_{it:07d}")
        if rank == 0:
            os.makedirs(iter_dir, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(sharded(it), iter_dir)
        if rank == 0:
            if args.integrity:
                save_integrity_manifest(iter_dir)
            with open(os.path.join(args.save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(it))  # Megatron-LM's tracker (checkpointing.py: iter_finalize_fn)
        dist.barrier()
        d = digest(state)
        if rank == 0:
            with open(args.events, "a") as f:
                f.write(json.dumps({"event": "saved", "step": it, "digest": d}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
