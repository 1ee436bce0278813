"""One framework run's side of the commit protocol, shared by the integrations (TorchTitan's manager, the Trainer's
callback): they differ in when a save starts and ends and in what state they can see, not in how a save is
recorded. Imports torch, no framework.

Who calls what (every method marked collective is called by every rank, in the same order):

  IntegrationRun(root, framework=, timeout_s=)    collective: the run's own gloo group (never the training group)
  start(topology, policy, versions)               collective: coordinator opens the ledger, settles what a crash
                                                  left (core settle + removal of interrupted in-place folders),
                                                  begins the run; every rank gets the run id, or the same error
  begin_save(step, name, remove_stale=)           collective: the `writing` row (with this process as owner) before
                                                  any byte is written; every rank derives the same attempt id;
                                                  a certified (or quarantined) step: every rank raises CertifiedStep
                                                  (Quarantined), unless SCOUT_CKPT_REPLACE_CERTIFIED names it
  hash_share(step_dir)                            collective: the coordinator lists the folder, each rank hashes
                                                  its share (by size), the coordinator hashes what a rank could not
                                                  see (no shared filesystem); files go to the coordinator
  commit(step, attempt, step_dir, files, ...)     collective: coordinator writes the manifest (temp + fsync +
                                                  rename), records the verdict (compare-and-set), journals it and
                                                  runs `after` (retention); every rank returns the same verdict or
                                                  raises the same ScoutError

An error on the coordinator never leaves the other ranks waiting in a collective: every coordinator-only block
catches, and the broadcast that follows carries the error to all ranks. An error is latched and delivered at the
next collective, never thrown mid-protocol, so the ranks never disagree about how a save ended.
"""

from __future__ import annotations

import atexit
import datetime
import os
import uuid
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from scout_ckpt import policy
from scout_ckpt.errors import BadInput, CertifiedStep, Quarantined, ScoutError, one_line_refusals
from scout_ckpt.format import layout, manifest
from scout_ckpt.format.digests import digest_files
from scout_ckpt.integrations import folders
from scout_ckpt.ledger import Ledger
from scout_ckpt.ledger.journal import journal_verdict
from scout_ckpt.ops.settle import this_process_owner
from scout_ckpt.ops.startup import open_run_ledger
from scout_ckpt.options import as_fleet
from scout_ckpt.save import log, placement
from scout_ckpt.save.set_aside import set_aside_quarantined

COORDINATOR = 0
REPLACE_ENV = "SCOUT_CKPT_REPLACE_CERTIFIED"


def replace_certified_steps(value: str | None) -> frozenset[int]:
    """The steps an operator allows a framework save to replace although certified: SCOUT_CKPT_REPLACE_CERTIFIED,
    comma-separated step numbers (empty or unset: none). Anything else is BadInput (one line, exit code 2),
    raised when the run is built, before the job trains."""
    out = set()
    for part in (value or "").split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            raise BadInput(f"{REPLACE_ENV}={value!r}: expected comma-separated step numbers, e.g. {REPLACE_ENV}=10,20")
        out.add(int(part))
    return frozenset(out)


def new_run_id() -> str:
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"


class IntegrationRun:
    """The ledger, the run id and the side group of one framework run (see the module docstring)."""

    def __init__(self, root: str | Path, *, framework: str, timeout_s: float = 600.0):
        one_line_refusals()  # an uncaught refusal ends the job as one line, not a traceback per rank
        self.root = Path(root)
        self.framework = framework
        self.timeout_s = timeout_s
        self.replace_certified = replace_certified_steps(os.environ.get(REPLACE_ENV))
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.is_coordinator = self.rank == COORDINATOR
        timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = dist.new_group(backend="gloo", timeout=timeout) if self.distributed else None
        self.ledger: Ledger | None = None
        self.run_id: str | None = None
        self.settled: list[dict] = []
        self._saves = 0
        self._fleet = None  # the fleet recorder (coordinator, where SCOUT_CKPT_FLEET names a store)

    # ---- small collectives on the run's own gloo group ------------------------------------------------------

    def bcast(self, obj):
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=COORDINATOR, group=self.pg)
        return box[0]

    def gather(self, obj) -> list | None:
        if not self.distributed:
            return [obj]
        out = [None] * self.world if self.is_coordinator else None
        dist.gather_object(obj, out, dst=COORDINATOR, group=self.pg)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.pg)

    def on_coordinator(self, what: str, fn: Callable[[], Any]) -> Any:
        """Collective: run fn on the coordinator, broadcast its result; an exception there is raised on every
        rank as ScoutError("scout-ckpt could not {what}: ...")."""
        out = error = None
        if self.is_coordinator:
            try:
                out = fn()
            except Exception as e:  # every rank must still reach the broadcast below
                error = f"{type(e).__name__}: {e}"
        out, error = self.bcast((out, error))
        if error:
            raise ScoutError(f"scout-ckpt could not {what}: {error}")
        return out

    # ---- start-up ------------------------------------------------------------------------------------------

    def start(
        self,
        *,
        topology: dict,
        policy: dict,
        versions: dict,
        resumed_from: int | None = None,
        after: Callable[[Ledger, str], None] | None = None,
    ) -> str:
        """Collective: open the ledger, settle interrupted saves, begin the run; returns the run id. `after(ledger,
        run_id)` runs on the coordinator once the run is begun (e.g. a warning about an uncertified resume). Where
        every rank runs (host, local rank, device) is recorded with the run, so that its events name hardware
        (docs/fleet.md); with SCOUT_CKPT_FLEET set, each rank first looks its device up in the fleet record and
        the coordinator starts the fleet recorder."""
        fleet = as_fleet(None)
        if fleet is not None:  # before any collective: a rank on a persistent suspect may exit (on_suspect)
            from scout_ckpt.fleet.startup import check_this_rank

            check_this_rank(fleet, self.rank)

        def begin():
            self.root.mkdir(parents=True, exist_ok=True)
            # never a fresh ledger over checkpoints: a lost one is rebuilt first, an unreadable one refuses
            self.ledger = open_run_ledger(self.root)
            self.settled = folders.settle_folders(self.ledger, self.root, source="startup")
            run_id = new_run_id()
            self.ledger.begin_run(
                run_id,
                world_size=self.world,
                topology=topology,
                policy=policy,
                versions=versions,
                resumed_from=resumed_from,
            )
            if after is not None:
                after(self.ledger, run_id)
            return run_id

        self.run_id = self.on_coordinator(f"open the ledger in {self.root}", begin)
        places = self.gather(placement.this_rank(self.rank))
        if self.is_coordinator and places is not None:
            try:
                self.ledger.record_ranks(self.run_id, places)
            except Exception as e:  # noqa: BLE001 - placement is a label: every rank has passed the gather
                log.logger.warning("rank placement not recorded: %s", e)
            if fleet is not None:
                from scout_ckpt.fleet.recorder import FleetRecorder

                self._fleet = FleetRecorder(fleet.path, self.root, fleet.interval_s)
        if self.is_coordinator:
            # a script that never calls close() (DeepSpeed's, Megatron's: optional there) still closes the ledger
            # cleanly at exit, so that SQLite folds its -wal/-shm sidecars back into the ledger file
            atexit.register(self._close_ledger)
        return self.run_id

    def bind_replay(self, replay, policy: dict) -> None:
        """After `start`: a started ReplayEvidence (None: nothing to do) records its faults and coverage in this
        run's ledger under this run's id and policy, the coordinator writing. One place for what every drop-in
        with replay (DeepSpeed, Megatron-Core, TorchTitan, the HF Trainer) does once its run has begun."""
        if replay is None:
            return
        replay.bind(
            ledger=self.ledger,
            root=self.root,
            run_id=self.run_id,
            policy=policy,
            is_coordinator=self.is_coordinator,
        )

    def _close_ledger(self) -> None:
        if self._fleet is not None:  # its last round reads the ledger: before the ledger closes
            recorder, self._fleet = self._fleet, None
            recorder.close()
        if self.ledger is not None:
            ledger, self.ledger = self.ledger, None
            try:
                ledger.close()
            except Exception:  # noqa: BLE001 - at exit: the ledger's data is committed either way
                pass

    # ---- one save ------------------------------------------------------------------------------------------

    def begin_save(self, step: int, name: str, *, remove_stale: bool = True) -> str:
        """Collective: record `writing` for ROOT/name before anything is written; returns the attempt id (the same
        on every rank, no collective needed for it). remove_stale: remove a folder of an abandoned attempt at the
        same step first (after a walk-back past it), so its files never mix with this save's.

        A framework save never replaces a certified step (its row or its folder), as the Checkpointer's own save
        does not: a run that trains over certified checkpoints instead of resuming from them would turn the
        certified row into `writing` and the folder into the new attempt's, and a crash before the commit would
        leave a good checkpoint judged interrupted. Every rank raises CertifiedStep (exit code 1), or Quarantined
        for a quarantined step, before any byte is written. The operator's override is explicit and per step:
        SCOUT_CKPT_REPLACE_CERTIFIED=STEP[,STEP...] in the job's environment (replace_certified_steps); the
        replaced verdict stays in the step's history and an event says who replaced it."""
        self._saves += 1
        attempt = f"{self.run_id.rsplit('-', 1)[-1]}-{self._saves}"
        replace = step in self.replace_certified

        def record():
            before = self.ledger.checkpoint(step)
            if before is not None and before["state"] == "quarantined":
                set_aside_quarantined(
                    self.ledger, self.root, step, before, name, source=f"{self.framework} save", run_id=self.run_id
                )
            try:
                self.ledger.record_writing(
                    step,
                    self.run_id,
                    attempt,
                    name,
                    owner=this_process_owner(),
                    keep_certified=not replace,
                    over_quarantined=True,
                )
            except (CertifiedStep, Quarantined) as e:  # nothing written, nothing removed: every rank raises it
                return type(e).__name__, str(e)
            if replace and before is not None and before["state"] == "certified":
                self.ledger.add_event(
                    "certified_replaced",
                    step=step,
                    run_id=self.run_id,
                    detail={"attempt": before["attempt"], "by": f"{REPLACE_ENV}={step}", "framework": self.framework},
                )
            stale = self.root / name
            if remove_stale and stale.is_dir():
                layout.remove_dir(stale)
            return None

        refused = self.on_coordinator(f"begin the save of step {step}", record)
        if refused is not None:
            kind, message = refused
            raise (CertifiedStep if kind == "CertifiedStep" else Quarantined)(
                message
                + (f" (or set {REPLACE_ENV}={step} to replace it on purpose)" if kind == "CertifiedStep" else "")
            )
        return attempt

    def hash_share(
        self, step_dir: Path, writer: Callable[[str], int | None] | None = None
    ) -> tuple[list[dict], list[tuple[str, int]]]:
        """Collective: (files hashed, listing) on the coordinator, ([], listing) elsewhere. A file whose writing
        rank `writer(path)` names is hashed by that rank (DCP's `__R_0.distcp`); the others are split over the
        ranks by size. What a rank cannot see comes back unhashed and the coordinator hashes it."""
        step_dir = Path(step_dir)
        listing = self.bcast(folders.listing(step_dir) if self.is_coordinator else None)
        owners = {p: writer(p) if writer else None for p, _ in listing}
        owned = {p for p, r in owners.items() if r is not None and 0 <= r < self.world}
        rest = folders.assign_shares([f for f in listing if f[0] not in owned], self.world)[self.rank]
        mine = sorted(rest + [p for p in owned if owners[p] == self.rank])
        visible = [p for p in mine if (step_dir / p).is_file()]
        got = digest_files([step_dir / p for p in visible])
        rows = [
            {"path": p, "size": got[str(step_dir / p)][0], "digest": got[str(step_dir / p)][1], "rank": self.rank}
            for p in visible
            if str(step_dir / p) in got
        ]
        gathered = self.gather({"files": rows, "unseen": sorted(set(mine) - {r["path"] for r in rows})})
        if not self.is_coordinator:
            return [], listing
        files = [f for g in gathered for f in g["files"]]
        unseen = [p for g in gathered for p in g["unseen"]]
        if unseen:
            got = digest_files([step_dir / p for p in unseen if (step_dir / p).is_file()])
            files += [
                {"path": p, "size": got[k][0], "digest": got[k][1], "rank": self.rank}
                for p in unseen
                if (k := str(step_dir / p)) in got
            ]
        return sorted(files, key=lambda f: f["path"]), listing

    def commit(
        self,
        step: int,
        attempt: str,
        step_dir: Path,
        files: list[dict],
        listing,
        live: dict,
        *,
        run_policy: dict,
        topology: dict,
        versions: dict,
        need_metadata: bool = False,
        signatures: dict | None = None,
        after: Callable[[dict, dict], None] | None = None,
        **manifest_extra,
    ) -> dict:
        """Collective: the coordinator publishes (bytes evidence from the hashed files against the listing, the
        live evidence, the run's policy) and runs `after(verdict, evidence)` once the verdict is recorded (events,
        retention); every rank returns {"state", "reasons"} or raises the same ScoutError."""

        def publish():
            hashed = {f["path"] for f in files}
            reasons = [{"code": "missing_file", "file": p} for p, _ in listing if p not in hashed]
            if need_metadata and layout.DCP_METADATA not in hashed:
                reasons.append({"code": "missing_file", "file": layout.DCP_METADATA})
            if not files:
                reasons.append({"code": "no_files_recorded"})
            ev = {
                "bytes": policy.evidence(
                    policy.FAIL if reasons else policy.PASS,
                    reasons,
                    files=len(files),
                    bytes=sum(f["size"] for f in files),
                    hashed_by="ranks",
                    ranks=sorted({f["rank"] for f in files}),
                ),
                **live,
            }
            v = policy.evaluate(run_policy, ev)
            verdict = {"state": v.state, "reasons": v.reasons}
            m = manifest.build(
                step=step,
                run_id=self.run_id,
                attempt=attempt,
                world_size=self.world,
                topology=topology,
                policy=run_policy,
                files=files,
                evidence=ev,
                verdict=verdict,
                signatures=signatures,
                invariants=run_policy.get("invariants"),
                versions=versions,
                **manifest_extra,
            )
            digest = manifest.write(step_dir, m)
            applied = self.ledger.record_commit(
                step,
                run_id=self.run_id,
                path=Path(step_dir).name,
                nbytes=layout.dir_bytes(step_dir),
                manifest_digest=digest,
                files=files,
                evidence=ev,
                state=v.state,
                reasons=v.reasons,
                attempt=attempt,
            )
            if not applied:  # the row changed meanwhile (compare-and-set): what the ledger holds stands
                row = self.ledger.checkpoint(step)
                return {"state": row["state"], "reasons": row["reasons"]}
            journal_verdict(self.root, step, attempt, digest, v.state, v.reasons, "save")
            for kind in ("consensus", "invariants"):
                for r in (ev.get(kind) or {}).get("reasons") or []:
                    if r.get("code") in ("consensus_attributed", "consensus_inconclusive", "invariant_failed"):
                        self.ledger.add_event(
                            "sdc",
                            step=step,
                            ranks=r.get("ranks") or [],
                            run_id=self.run_id,
                            detail={"source": kind, **{k: x for k, x in r.items() if k != "ranks"}},
                        )
            if after is not None:
                after(verdict, ev)
            if self._fleet is not None:
                self._fleet.nudge()  # the save's events reach the fleet store now, from the recorder's thread
            return verdict

        return self.on_coordinator(f"commit step {step}", publish)

    def close(self, groups=(), *, release: bool = True) -> None:
        """Every rank, at the framework's train end: the ledger closed and the run's side groups (its own and the
        `groups` given, e.g. consensus groups) released after a barrier on its own group, so that no gloo group of
        ours is alive when the interpreter exits. A framework that never destroys the default group (the HF
        Trainer) otherwise left them to static destruction, where gloo's threads aborted the process one run in
        four ("terminate called without an active exception") and torchrun called a finished job failed.
        `release=False` keeps them (a framework whose close may run on some ranks only)."""
        self._close_ledger()
        atexit.unregister(self._close_ledger)
        if self.pg is None or not release:
            return
        pg, self.pg = self.pg, None
        release_groups(pg, groups)


def rejudge_committed(ledger: Ledger, root: Path, run_id: str, run_policy: dict, kind: str) -> list[int]:
    """Coordinator, at start-up of a run whose policy accepts `kind` as not applicable (`accept_single_owner=True`):
    each `committed` step (folder present) that an earlier run's stricter policy left uncertified only because
    `kind` was missing (single-owner state no replica vouched for) is re-judged under this run's policy, with the
    same recorded evidence: `kind` becomes not_applicable, accepted by this run (`rejudged_by` names it), and the
    verdict is applied by compare-and-set with source "rejudge" (ledger history and journal). Nothing but that
    one kind changes: any other missing, failed or inconclusive evidence keeps the step where it is. Bytes are
    re-verified when a step is handed out (resume, `latest`), as for any certified step. Returns the steps
    certified."""
    from scout_ckpt.ledger import journal

    if kind not in run_policy.get("allow_not_applicable", []):
        return []
    out = []
    for row in ledger.checkpoints(states=("committed",)):
        if not row.get("path") or not (Path(root) / row["path"]).is_dir():
            continue
        ev = ledger.evidence(row["step"])
        item = ev.get(kind)
        if item is None or item.get("status") != policy.MISSING:
            continue
        accepted = {
            **item,
            "status": policy.NOT_APPLICABLE,
            "accepted": True,
            "rejudged_by": run_id,
            "was": policy.MISSING,
        }
        verdict = policy.evaluate(run_policy, {**ev, kind: accepted})
        if verdict.state != "certified":
            continue
        with ledger.write():
            now = ledger.checkpoint(row["step"])
            if now is None or now["state"] != "committed" or now["attempt"] != row["attempt"]:
                continue
            ledger.put_evidence(row["step"], {kind: accepted}, source="rejudge")
            if journal.record_transition(
                ledger, root, row["step"], "certified", [], source="rejudge", expect="committed", attempt=row["attempt"]
            ):
                out.append(row["step"])
    return out


def release_groups(pg, groups=()) -> None:
    """Barrier on `pg` (every rank has finished with the side groups), then destroy `pg` and `groups` (never the
    default group). Each destroy is local; a group already gone is passed over."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.barrier(group=pg)
    except Exception:  # noqa: BLE001 - a peer is gone: the job is ending anyway; destroy what is ours
        pass
    default = dist.group.WORLD
    for g in [*groups, pg]:
        if g is None or g is default:
            continue
        try:
            dist.destroy_process_group(g)
        except Exception:  # noqa: BLE001 - already destroyed (a destroy_process_group() of everything first)
            pass
