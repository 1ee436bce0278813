"""The fast tier's files on a node's disk: one rank's bytes written and read whole, and which files of a step's
directory a rank looks after (its own and the peer copies the ring placed with it).

Why apart: the tier's save path (local_tier.py) and its restore path (local_restore.py) both touch these files,
and neither should import the other. A write is temp name + rename, without fsync: node-local state is the fast
tier's whole point, and a file torn by a power loss fails its digest at load and is walked past (never trusted).
"""

from __future__ import annotations

import os
from pathlib import Path


def write_file(path: Path, blob: bytes) -> None:
    """Temp name + rename; a write that fails removes its temp file (a full disk keeps no half file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def try_write(path: Path, blob: bytes) -> str | None:
    """write_file; None when written, else one line for why not (ENOSPC, EIO, EACCES: the node's disk, not the
    state)."""
    try:
        write_file(path, blob)
    except OSError as e:
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return None


def read_file(path: Path) -> bytes | None:
    """The file's bytes; None where it cannot be read (missing, an I/O error): could not check, not damage."""
    try:
        return path.read_bytes()
    except OSError:
        return None


def rank_files(step_dir: Path, rank: int, local_world: int) -> list[tuple[int, Path]]:
    """(owner rank, path) of the files in this node's `step_dir` that `rank` looks after: those of the ranks with
    its local rank (its own, and the copies the ring placed here), whatever node numbers the rendezvous gives the
    nodes this time; its own file first, then owners' files before peer copies."""
    out: list = []
    try:
        names = os.listdir(step_dir)
    except OSError:
        return out
    for name in names:
        head, _, tail = name.rpartition("rank-")
        if head not in ("", "peer-") or not tail.endswith(".pt") or not tail[:-3].isdigit():
            continue
        owner = int(tail[:-3])
        if owner % local_world == rank % local_world:
            out.append((owner, step_dir / name))
    return sorted(out, key=lambda x: (x[0] != rank, x[1].name.startswith("peer-"), x[0]))
