"""Where one Checkpointer.save spends its time, per rank and phase (a profiling aid, not a bench: run_all skips
files that start with "_", and it prints no ratio).

    python bench/_save_phases.py full|bytes|async [ROUNDS]      (4 ranks, 200 MB, as bench/save_overhead.py)

Wraps the save path's functions (begin, ledger rows, temp dir, collectives, hashing thread, DCP write, finite
scan, manifest, rename, ledger commit) with timers and prints, for each, the median start, end and total seconds
from the start of save() over the rounds (the first round, which warms caches, is left out), and the time
save() spends outside dcp.save.
"""

import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PH = {}


def wrap(owner, name, label=None):
    fn = getattr(owner, name)
    label = label or name

    @functools.wraps(fn)
    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            PH.setdefault(label, []).append((t0, time.perf_counter()))

    setattr(owner, name, w)


def _worker(rank, world, root, mb, repeats, mode):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from scout_ckpt import checkpointer
    from scout_ckpt.consensus import save_time
    from scout_ckpt.format import layout, manifest
    from scout_ckpt.ledger import Ledger
    from scout_ckpt.save import commit, storage
    from scout_ckpt.save.evidence import boundary as save_evidence

    wrap(commit.Committer, "begin")
    wrap(commit.Committer, "finish")
    wrap(commit.Committer, "_publish")
    wrap(commit.Committer, "_record")
    wrap(commit.Committer, "_retain")
    wrap(commit.Committer, "flush")
    wrap(commit.PendingSave, "local_files")
    wrap(commit.PendingSave, "create", "tmpdir_create")
    wrap(commit.PendingSave, "finalize")
    wrap(commit, "_broadcast", "commit_broadcast")
    wrap(commit, "_gather", "commit_gather")
    wrap(Ledger, "record_writing")
    wrap(Ledger, "record_commit")
    wrap(Ledger, "events")
    wrap(manifest, "write", "manifest_write")
    wrap(layout, "commit_dir")
    wrap(checkpointer.Checkpointer, "_start_consensus")
    wrap(checkpointer.Checkpointer, "_live_evidence")
    wrap(checkpointer.Checkpointer, "_assess")
    wrap(checkpointer.Checkpointer, "_commit")
    wrap(checkpointer.Checkpointer, "_save")
    wrap(save_time.PendingConsensus, "finish", "consensus_finish")
    wrap(save_time, "_hash_groups", "consensus_hash(thread)")
    wrap(save_evidence, "full_signatures")
    wrap(storage.ScoutWriter, "write_data")
    wrap(storage, "is_finite")
    wrap(dcp, "save", "dcp.save")
    wrap(dcp, "async_save", "dcp.async_save")
    wrap(storage.ScoutWriter, "stage")
    from scout_ckpt.checkpointer import Checkpointer

    n_layers = 8
    width = int((mb * 2**20 / 4 / n_layers) ** 0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(n_layers)])
    state = {"model": model.state_dict()}
    asyn = mode == "async"
    kw = {} if mode != "bytes" else {"consensus": False, "verify_load": False}
    ck = Checkpointer(os.path.join(root, mode), model=model, async_save=asyn, **kw)
    pg = dist.new_group(backend="gloo")
    rounds = []
    for i in range(repeats + 1):
        PH.clear()
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        ck.save(i + 1, state)
        t1 = time.perf_counter()
        ck.wait()
        t2 = time.perf_counter()
        if i:
            r = {"save()": (0, t1 - t0), "wait": (t1 - t0, t2 - t0)}
            for k, v in PH.items():
                r[k] = (min(a for a, b in v) - t0, max(b for a, b in v) - t0, sum(b - a for a, b in v), len(v))
            rounds.append(r)
    ck.close()
    return rounds


def main():
    from scout_ckpt.testing.launch import run_ranks

    mode = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    root = tempfile.mkdtemp(prefix="scout-prof-")
    try:
        outs = run_ranks(_worker, 4, root, 200, reps, mode, timeout=900)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("load", os.getloadavg())
    for o in outs if mode != "async" else []:  # async: dcp.save runs in the commit thread, after save() returned
        over = [r["save()"][1] - r["dcp.save"][2] for r in o.result] if "dcp.save" in o.result[0] else []
        if over:
            print(
                f"rank {o.rank}: save() minus dcp.save, median {statistics.median(over) * 1e3:.1f} ms; save() median {statistics.median(r['save()'][1] for r in o.result) * 1e3:.1f} ms; dcp.save median {statistics.median(r['dcp.save'][2] for r in o.result) * 1e3:.1f} ms"
            )
    for o in outs[: int(os.environ.get("NR", "2"))]:
        print(f"== rank {o.rank} ({mode}) median over rounds: start end total(s) calls")
        keys = list(o.result[0])
        for k in sorted(keys, key=lambda k: statistics.median(r[k][0] for r in o.result if k in r)):
            vals = [r[k] for r in o.result if k in r]
            cols = [statistics.median(v[j] for v in vals) for j in range(len(vals[0]))]
            print(f"  {k:28s} " + " ".join(f"{c:8.4f}" for c in cols))


if __name__ == "__main__":
    main()
