"""What `scout-ckpt ledger rebuild` decides and writes, for every storage: the ledger's checkpoint rows recreated
from the manifests and the journal (ops/rebuild.py collects them on POSIX, ops/rebuild_bucket.py on an object store).

A manifest is written by the save and can be read, but it can also have been edited since; so a rebuild never
makes a checkpoint more trusted than it can establish itself:

- bytes are re-verified against the manifest's file list (`--no-verify`: bytes evidence `missing`);
- the policy is the strictest of the manifest's and DEFAULT_POLICY (union of `require`, intersection of
  `allow_not_applicable`), so a manifest edited to `require: []` certifies nothing;
- a step is certified only if its evidence passes that policy AND a certified verdict for that very manifest
  digest is on record: in the journal (ROOT/scout-journal.jsonl) or in the old ledger if it is readable. The old
  ledger, where it has the step with the same digest, caps the result: what it had not certified is not
  certified now. Evidence the rebuild cannot re-run (consensus, replay) counts only when so vouched for; else it
  is recorded as `missing` (reason `unverified_after_rebuild`), so a later `certify` cannot promote it either;
- the journal vouches only while its hash chain holds (ledger/journal.py, `verify`): a journal with a record
  edited or removed vouches for no certificate (result key "journal_chain" says where it breaks);
- quarantines (and releases) from the journal or the old ledger are restored, and so are rejections
  (e.g. `load_mismatch`) of that manifest;
- whatever cannot be re-established is `committed` with the reason `unverified_after_rebuild`.

The new ledger is built under a temp name and swapped in with a rename; the old one (if any) is kept beside it
as scout-ledger.db.bak-<time>, so a rebuild never destroys the history it cannot recreate (events, replays).
`changes` lists, per step, what differs from the old ledger: {"step", "before", "after", "why"}.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scout_ckpt import policy
from scout_ckpt.errors import LedgerError, ScoutError
from scout_ckpt.format.layout import LEDGER_NAME, fsync_dir
from scout_ckpt.format.verify import could_not_check
from scout_ckpt.ledger import Ledger, journal, tiers

# Replay may be not applicable where the run's own policy allowed it (a script that never called ckpt.step():
# replay_no_step_hook); the certified verdict on record for that manifest still has to vouch for it.
DEFAULT_POLICY = {"require": ["bytes", "invariants", "consensus"], "allow_not_applicable": ["replay"]}
UNVERIFIED = "unverified_after_rebuild"
# Evidence kinds a rebuild re-establishes itself; the others it can only take on the record's word.
REVERIFIED = ("bytes",)


# Invariant kinds that stand in for consensus on single-owner shards (invariants.VOUCHES; listed here so that the
# rebuild does not import torch).
VOUCHING_KINDS = ("frobenius_sphere", "spectral_sphere", "spectral_bound", "oblique", "simplex")


def default_policy(m: dict) -> dict:
    """The least a checkpoint of this manifest's kind must show: adopted folders have no replicas or replay by
    construction (policy.ADOPTED); pure FSDP may have consensus not applicable only when the manifest's own policy
    also required what vouches for single-owner shards (shard replay + at-rest, or a vouching invariant). Anything
    else: DEFAULT_POLICY."""
    topo = m.get("topology") if isinstance(m.get("topology"), dict) else {}
    mode = str(topo.get("mode") or "")
    mp = m.get("policy") if isinstance(m.get("policy"), dict) else {}
    if mode == "adopted":
        return policy.ADOPTED
    if mode.startswith("fsdp"):
        req = set(_strings(mp.get("require")))
        specs = mp.get("invariants") if isinstance(mp.get("invariants"), list) else []
        kinds = {(x.get("check") if isinstance(x, dict) else str(x)) for x in specs}
        if {"shard_replay", "at_rest"} <= req or kinds & set(VOUCHING_KINDS):
            base = dict(DEFAULT_POLICY)
            extra = ["shard_replay", "at_rest"] if {"shard_replay", "at_rest"} <= req else []
            return {"require": [*base["require"], *extra], "allow_not_applicable": ["consensus", "replay"]}
    return DEFAULT_POLICY


def strictest(manifest_policy: dict, default: dict = DEFAULT_POLICY) -> dict:
    """The stricter of two policies: every kind either requires, not-applicable allowed only where both allow.
    Other keys (invariant specs, replay targets) are the manifest's."""
    mp = manifest_policy if isinstance(manifest_policy, dict) else {}
    require = list(dict.fromkeys([*default["require"], *_strings(mp.get("require"))]))
    allow = [k for k in _strings(mp.get("allow_not_applicable")) if k in default["allow_not_applicable"]]
    return {**mp, "require": require, "allow_not_applicable": allow}


def _strings(v) -> list[str]:
    return [x for x in v if isinstance(x, str)] if isinstance(v, list) else []


def _old_ledger(root: Path) -> tuple[dict[int, dict], str | None]:
    """The old ledger's checkpoint rows by step ({} and a note if it is missing or unreadable)."""
    if not (root / LEDGER_NAME).exists():
        return {}, "no old ledger"
    try:
        try:
            old = Ledger.open(root, readonly=True)
        except LedgerError as e:
            if "needs migration" not in str(e):
                raise
            old = Ledger.open(root)  # an older schema: migrate it (it is about to become the .bak) and read it
        with old:
            return {r["step"]: r for r in old.checkpoints()}, None
    except Exception as e:  # noqa: BLE001 - a corrupt old ledger is a reason to rebuild, not to stop
        return {}, f"old ledger unreadable ({e})"


def _journal_view(records: list[dict], step: int, digest: str, intact: bool = True) -> dict:
    """What the journal says of one step (journal.standing): quarantined (the last operator decision), the
    standing verdict for this manifest digest (a rejection outlives any certification of it, whatever the
    writers' clocks), and whether a certified verdict for it is on record. A journal whose chain is broken
    (`intact` False, journal.verify) vouches for no certificate: the record removed or edited could have been a
    rejection of any step; its rejections and quarantines stand all the same."""
    s = journal.standing(records, step, digest)
    verdict = {"state": s["state"], "reasons": s["reasons"]} if s["state"] is not None else None
    return {"quarantine": s["quarantine"], "verdict": verdict, "certified": s["certified"] and intact}


def _demote(ev: dict) -> dict:
    """Evidence no one vouches for: what would raise trust (pass, not_applicable) becomes `missing`; a failure
    stays a failure (it only lowers trust)."""
    out = {}
    for kind, item in ev.items():
        if kind in REVERIFIED or not isinstance(item, dict) or item.get("status") in (policy.FAIL, policy.INCONCLUSIVE):
            out[kind] = item
        else:
            out[kind] = policy.evidence(
                policy.MISSING, [{"code": UNVERIFIED, "kind": kind, "claimed": item.get("status")}]
            )
    return out


def decide(step: int, m: dict, digest: str, fresh_bytes: dict, jview: dict, old: dict | None) -> dict:
    """The rebuilt row of one step: {"state", "reasons", "evidence", "policy", "quarantine", "why"}. Pure."""
    pol = strictest(m.get("policy"), default_policy(m))
    old_same = old if old and old.get("manifest_digest") == digest else None
    vouched = bool(jview["certified"] or (old_same and old_same["state"] == "certified"))
    if old_same is not None and old_same["state"] not in ("certified", "quarantined"):
        vouched = False  # the old ledger had not certified this manifest: neither does the rebuild
    raw = m.get("evidence") if isinstance(m.get("evidence"), dict) else {}
    ev = {k: v for k, v in raw.items() if isinstance(v, dict) and v.get("status") in policy.STATUSES}
    ev["bytes"] = fresh_bytes
    if not vouched:
        ev = _demote(ev)
    v = policy.evaluate(pol, ev)
    state, reasons = v.state, v.reasons
    why = (reasons[0].get("code") if reasons else None) or "evidence"
    if state == "certified" and not vouched:  # cannot happen after _demote unless nothing is required; still
        state, reasons = "committed", [{"code": UNVERIFIED}]
    elif state == "committed" and not vouched:
        reasons = [{"code": UNVERIFIED}] + [r for r in reasons if r.get("code") != UNVERIFIED]
        why = UNVERIFIED
    if state != "rejected":
        # rejections on record for this manifest stand (a load mismatch, a failed re-verification)
        rec = jview["verdict"]
        if rec is not None and rec.get("state") == "rejected":
            state, reasons, why = "rejected", list(rec.get("reasons") or []), "journal_rejection"
        elif old_same is not None and old_same["state"] == "rejected":
            state, reasons, why = "rejected", list(old_same["reasons"] or []), "old_ledger_rejection"
    quarantine = None
    if jview["quarantine"] is not None:
        quarantine = {"reason": jview["quarantine"].get("reason"), "from": "journal"}
    elif old is not None and old["state"] == "quarantined":
        detail = next((r.get("detail") for r in old["reasons"] or [] if r.get("code") == "quarantined"), None)
        quarantine = {"reason": detail, "from": "old_ledger"}
    if state == "certified":
        why = "vouched"
    return {"state": state, "reasons": reasons, "evidence": ev, "policy": pol, "quarantine": quarantine, "why": why}


def _quarantine_copies(ledger: Ledger, records: list[dict], local_result: dict | None) -> None:
    """A quarantine on record for a step holds for every copy of it: the fast tier's rebuilt rows of a step the
    journal says is quarantined (and not released since) are quarantined too, their state before kept for a
    release (ops/operator.py)."""
    for r in tiers.rows(ledger):
        q = journal.standing(records, r["step"], None)["quarantine"]
        if q is None or r["state"] in ("deleted", "quarantined"):
            continue
        tiers.set_state(
            ledger,
            r["step"],
            "quarantined",
            [
                {
                    "code": "quarantined",
                    "detail": q.get("reason"),
                    "before": r["state"],
                    "before_reasons": r.get("reasons") or [],
                }
            ],
            expect=r["state"],
        )
        if local_result is not None:
            for row in local_result.get("rows") or []:
                if row.get("step") == r["step"]:
                    row.update(state="quarantined", why="quarantine_from_journal")


@dataclass(frozen=True)
class Entry:
    """One step to rebuild: its manifest (and the digest of its bytes), the path the ledger row records (the
    step dir's name, or the attempt prefix on an object store), and how to measure and re-verify it."""

    manifest: dict
    digest: str
    path: str
    nbytes: Callable[[], int]
    check: Callable[[], dict]


def write_ledger(
    root: Path,
    entries: dict[int, Entry],
    skipped: list[dict],
    records: list[dict],
    *,
    verify: bool,
    present: set[int],
    before_swap: Callable[[], None] | None = None,
    local: Callable[[Ledger], dict] | None = None,
) -> dict:
    """The part of a rebuild common to every storage: decide() each entry against the journal `records` and the
    old ledger in ROOT, build the new ledger under a temp name in ROOT, keep the old one as .bak, rename.
    `present`: the steps that exist at all (for `changes`' why of an old row left out: skipped or gone).
    `before_swap`: called once the new ledger is complete, just before it is renamed into place. `local`: writes
    the fast tier's rows into the new ledger (ops/rebuild_local.py) and returns what it did (result key "local")."""
    manifests = {step: (e.manifest, e.digest) for step, e in entries.items()}
    old_rows, old_note = _old_ledger(root)
    chain = journal.verify(records)
    build_dir = root / f".ledger-rebuild-{os.getpid()}"
    shutil.rmtree(build_dir, ignore_errors=True)
    rows, changes = [], []
    skipped = list(skipped)
    try:
        build_dir.mkdir()
        with Ledger.open(build_dir, create=True) as ledger:
            for run_id in sorted({m.get("run_id") or "unknown" for m, _ in manifests.values()}):
                first = next(m for m, _ in manifests.values() if (m.get("run_id") or "unknown") == run_id)
                ledger.begin_run(
                    run_id,
                    world_size=first.get("world_size") or 0,
                    topology=first.get("topology", {}),
                    policy=strictest(first.get("policy"), default_policy(first)),
                    versions=first.get("versions", {}),
                )
            for step, (m, digest) in sorted(manifests.items()):
                e = entries[step]
                if verify:
                    fresh = e.check()
                    if could_not_check(fresh):
                        # an I/O error is no verdict: rebuilding the row would demote it for good (the next
                        # rebuild trusts no more than this ledger); left out, the rebuild is not a success
                        skipped.append(
                            {
                                "step": step,
                                "could_not_check": True,
                                "reason": "its bytes could not be read now ("
                                + "; ".join(str(r.get("detail")) for r in fresh["reasons"])
                                + ")",
                            }
                        )
                        manifests.pop(step)
                        continue
                else:
                    fresh = policy.evidence(policy.MISSING, [{"code": "bytes_unverified"}])
                d = decide(
                    step, m, digest, fresh, _journal_view(records, step, digest, chain["intact"]), old_rows.get(step)
                )
                run_id = m.get("run_id") or "unknown"
                attempt = m.get("attempt") or f"rebuild-{step}"
                ledger.record_writing(step, run_id, attempt, e.path, source="rebuild")
                ledger.record_commit(
                    step,
                    run_id=run_id,
                    path=e.path,
                    nbytes=e.nbytes(),
                    manifest_digest=digest,
                    files=m["files"],
                    evidence=d["evidence"],
                    state=d["state"],
                    reasons=d["reasons"],
                    source="rebuild",
                    attempt=attempt,
                )
                state, reasons, why = d["state"], d["reasons"], d["why"]
                if d["quarantine"] is not None:
                    reasons = [{"code": "quarantined", "detail": d["quarantine"]["reason"]}]
                    ledger.transition(step, "quarantined", reasons, source="operator", expect=state)
                    state, why = "quarantined", f"quarantine_from_{d['quarantine']['from']}"
                rows.append({"step": step, "state": state, "reasons": reasons})
                before = old_rows.get(step, {}).get("state")
                if before != state:
                    changes.append({"step": step, "before": before, "after": state, "why": why})
            local_result = local(ledger) if local is not None else None
            _quarantine_copies(ledger, records, local_result)
        for step, old in sorted(old_rows.items()):
            if step not in manifests and old["state"] != "deleted":
                changes.append(
                    {
                        "step": step,
                        "before": old["state"],
                        "after": None,
                        "why": "skipped" if step in present else "no_directory",
                    }
                )
        if before_swap is not None:
            before_swap()
        final = root / LEDGER_NAME
        backup = None
        # an orphaned -wal/-shm (the database itself lost) must not be replayed into the new ledger: move it too
        if any(Path(f"{final}{suffix}").exists() for suffix in ("", "-wal", "-shm")):
            backup = root / f"{LEDGER_NAME}.bak-{time.strftime('%Y%m%dT%H%M%S')}"
            for suffix in ("", "-wal", "-shm"):
                if Path(f"{final}{suffix}").exists():
                    os.rename(f"{final}{suffix}", f"{backup}{suffix}")
        os.rename(build_dir / LEDGER_NAME, final)
        fsync_dir(root)
    except OSError as e:
        raise ScoutError(f"{root}: ledger rebuild failed ({e.strerror})") from None
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    return {
        "checkpoints": rows,
        "changes": sorted(changes, key=lambda c: c["step"]),
        "skipped": skipped,
        "backup": str(backup) if backup else None,
        "old_ledger": old_note or "read",
        "journal_records": len(records),
        "journal_chain": chain,
        "local": local_result,
    }
