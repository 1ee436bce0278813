"""`scout-ckpt ledger rebuild --local-dir DIR`: the fast tier's rows (table `tier_checkpoints`) rebuilt beside the
durable ones, from what the local tier leaves in the node-local directories this host can read.

What the local tier leaves on disk is DIR/RUN_ID/step-NNNNNNNN/rank-R.pt and the peer copies peer-rank-R.pt
(save/local_tier.py): bytes, and nothing that describes them. The digests every rank took before writing, the
save's evidence (consensus, invariants, finite, replay), its verdict, the layout a restore needs and the
load-verification signatures are recorded in the ledger only. So, never more trusted than it can establish:

- a step the old ledger (readable, kept as .bak) records keeps that record, re-checked against the bytes: every
  file found under the step's directory in each given DIR (own files and peer copies alike) is hashed now and
  compared with the recorded digest of its rank. Every rank with a matching file: the recorded state stands
  (certified only if the old ledger had certified it). A rank whose every recorded copy was found and none
  matches: `rejected` (digest_mismatch). A rank with no matching file but some copy not found (another host's
  directory): `committed` with reason `could_not_check` naming the ranks and `before` (the state on record), and
  the rebuild exits 1; a later rebuild that can see every rank's file restores `before`. Rejected and deleted
  rows are carried as they are.
- a step found on disk that no readable ledger records: `committed`, reason `unverified_after_rebuild`, its files
  listed without digests (digests taken now would vouch for whatever the bytes have become). No restart loads it
  (only certified local steps are candidates, and its layout is unknown); the next local commit's retention
  removes it once a newer local step is certified, as it removes any committed step older than the newest
  certified one.
- a DIR that cannot be read, or that is not a directory, is bad input (exit 2) before anything is written.
  Without --local-dir, the directories are those the old ledger's rows name on this host, if any.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from scout_ckpt.errors import BadInput
from scout_ckpt.format.digests import file_digest
from scout_ckpt.format.layout import LEDGER_NAME
from scout_ckpt.ledger import Ledger, tiers

UNVERIFIED = "unverified_after_rebuild"
NOT_CHECKED = "could_not_check"
STEP_DIR = re.compile(r"^step-(\d{8,})$")
RANK_FILE = re.compile(r"^(peer-)?rank-(\d+)\.pt$")
NO_RECORD = (
    "no record of this local save's digests, evidence or verdict survives: the local tier writes none beside its files"
)


def check_dirs(dirs: list[str | os.PathLike]) -> list[Path]:
    """The --local-dir arguments, each an existing readable directory (else BadInput, before anything is
    written)."""
    out = []
    for d in dirs:
        p = Path(d)
        if not p.is_dir():
            raise BadInput(f"--local-dir {p}: {'not a directory' if p.exists() else 'no such directory'}")
        if not os.access(p, os.R_OK | os.X_OK):
            raise BadInput(f"--local-dir {p}: not readable")
        out.append(p)
    return out


def old_rows(root: Path) -> tuple[dict[int, dict], str | None]:
    """The old ledger's local rows by step ({} and why, when there is no readable old ledger or no local row)."""
    if not (root / LEDGER_NAME).exists():
        return {}, "no old ledger"
    try:
        with Ledger.open(root, readonly=True) as old:
            return {r["step"]: r for r in tiers.rows(old)}, None
    except Exception as e:  # noqa: BLE001 - a damaged old ledger is why one rebuilds; its local rows are lost
        return {}, f"old ledger unreadable ({type(e).__name__}: {e})"


def _recorded_bases(rows: dict[int, dict]) -> list[Path]:
    """The node-local directories the old rows name on this host (a file's `where` is BASE/RUN/step-N/FILE)."""
    host, out = socket.gethostname(), []
    for r in rows.values():
        for f in r.get("files") or []:
            where = f.get("where")
            if f.get("host") == host and where:
                base = Path(where).parent.parent.parent
                if base not in out and base.is_dir():
                    out.append(base)
    return out


def scan(bases: list[Path]) -> dict[str, dict[int, list[Path]]]:
    """{RUN_ID/step-N: {rank: [paths of its files (own and peer copies)]}} in every base."""
    found: dict[str, dict[int, list[Path]]] = {}
    for base in bases:
        try:
            runs = sorted(p for p in base.iterdir() if p.is_dir())
        except OSError:
            continue
        for run in runs:
            try:
                steps = sorted(p for p in run.iterdir() if p.is_dir() and STEP_DIR.match(p.name))
            except OSError:
                continue
            for sd in steps:
                try:
                    names = sorted(os.listdir(sd))
                except OSError:
                    continue
                for name in names:
                    m = RANK_FILE.match(name)
                    if m:
                        found.setdefault(f"{run.name}/{sd.name}", {}).setdefault(int(m.group(2)), []).append(sd / name)
    return found


def _hash(path: Path) -> tuple[int, str] | None:
    try:
        return file_digest(path)
    except (OSError, BadInput):
        return None


def _recheck(r: dict, on_disk: dict[int, list[Path]]) -> tuple[str, list[dict], str]:
    """(state, reasons, why) of an old row re-checked against the files found for it."""
    before = r["state"]
    vouched = before == "certified" or (
        before == "committed"
        and any(x.get("code") == NOT_CHECKED and x.get("before") == "certified" for x in r.get("reasons") or [])
    )
    want = {f["rank"]: f.get("digest") for f in r.get("files") or [] if f.get("rank") is not None}
    if not any(want.values()):  # a row an earlier rebuild made from the files alone: nothing to check against
        return before, list(r.get("reasons") or []), "as_recorded"
    expected = {
        rank: 1 + sum(1 for c in r.get("copies") or [] if c.get("rank") == rank and c.get("verified")) for rank in want
    }
    damaged, unseen = [], []
    for rank, digest in sorted(want.items()):
        paths = on_disk.get(rank) or []
        got = [_hash(p) for p in paths]
        if digest and any(g is not None and g[1] == digest for g in got):
            continue
        read = [g for g in got if g is not None]
        if digest and len(read) >= expected[rank]:
            damaged.append(rank)
        else:
            unseen.append(rank)
    if damaged:
        return (
            "rejected",
            [
                {
                    "code": "digest_mismatch",
                    "tier": "local",
                    "ranks": damaged,
                    "source": "rebuild",
                    "detail": "every copy of the rank's file fails its recorded digest",
                }
            ],
            "digest_mismatch",
        )
    if unseen:
        return (
            "committed",
            [
                {
                    "code": NOT_CHECKED,
                    "tier": "local",
                    "ranks": unseen,
                    "before": "certified" if vouched else before,
                    "detail": "no file of these ranks that matches its digest was found in the local "
                    "directories given (another host's: give it with --local-dir)",
                }
            ],
            NOT_CHECKED,
        )
    if vouched:
        return "certified", [], "vouched"
    return before, list(r.get("reasons") or []), "as_recorded"


def rebuild_rows(root: Path, local_dirs: list[Path], new_ledger) -> dict:
    """Write the local rows into `new_ledger` (open for writing). Returns {"dirs", "rows": [{"step", "state",
    "reasons", "why"}], "changes": [{"step", "before", "after", "why"}], "not_checked": [steps], "unrecorded":
    [dirs found that no row records], "old_ledger"}."""
    old, note = old_rows(root)
    bases = list(local_dirs) or _recorded_bases(old)
    found = scan(bases)
    out_rows, changes, not_checked = [], [], []
    used = set()
    for step, r in sorted(old.items()):
        if r["state"] in ("rejected", "deleted"):
            state, reasons, why = r["state"], list(r.get("reasons") or []), "as_recorded"
        else:
            state, reasons, why = _recheck(r, found.get(r.get("dir") or "", {}))
        used.add(r.get("dir"))
        tiers.insert(new_ledger, {**r, "state": state, "reasons": reasons})
        out_rows.append({"step": step, "state": state, "reasons": reasons, "why": why})
        if why == NOT_CHECKED:
            not_checked.append(step)
        if state != r["state"]:
            changes.append({"step": step, "before": r["state"], "after": state, "why": why})
    # steps on disk that no readable ledger records: the newest run's directory for each step
    by_step: dict[int, str] = {}
    for rel in sorted(found):
        step = int(rel.rsplit("step-", 1)[1])
        if step not in old:
            by_step[step] = rel  # sorted: a later run id (they begin with their start time) wins
    host = socket.gethostname()
    for step, rel in sorted(by_step.items()):
        used.add(rel)
        files: list[dict] = []
        copies: list = []
        mtimes = []
        for rank, paths in sorted(found[rel].items()):
            for p in paths:
                try:
                    st = p.stat()
                    size = st.st_size
                    mtimes.append(st.st_mtime)
                except OSError:
                    size = None
                if p.name.startswith("peer-"):  # verified None: not checked (no digest on record to check with)
                    copies.append(
                        {"rank": rank, "holder": None, "host": host, "node": None, "path": str(p), "verified": None}
                    )
                elif not any(f["rank"] == rank for f in files):
                    files.append(
                        {
                            "rank": rank,
                            "path": p.name,
                            "size": size,
                            "digest": None,
                            "host": host,
                            "node": None,
                            "where": str(p),
                        }
                    )
        reasons = [{"code": UNVERIFIED, "tier": "local", "detail": NO_RECORD}]
        tiers.insert(
            new_ledger,
            {
                "step": step,
                "run_id": rel.split("/", 1)[0],
                "state": "committed",
                "dir": rel,
                "world_size": None,
                "layout": None,
                "files": files,
                "copies": copies,
                "evidence": {},
                "signatures": {},
                "reasons": reasons,
                # when the files were written (the save's own time is on no record)
                "committed": max(mtimes) if mtimes else None,
            },
        )
        out_rows.append({"step": step, "state": "committed", "reasons": reasons, "why": UNVERIFIED})
        changes.append({"step": step, "before": None, "after": "committed", "why": UNVERIFIED})
    return {
        "dirs": [str(b) for b in bases],
        "rows": sorted(out_rows, key=lambda x: x["step"]),
        "changes": changes,
        "not_checked": not_checked,
        "unrecorded": sorted(set(found) - used),
        "old_ledger": note or "read",
    }


__all__ = ["check_dirs", "rebuild_rows", "scan"]
