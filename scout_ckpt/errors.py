"""Errors the CLI maps to exit codes: 1 = not clean / not found / failed verification, 2 = bad input."""

from __future__ import annotations


class ScoutError(Exception):
    """Base error; `exit_code` is what the CLI exits with. The message is one line for a person."""

    exit_code = 2


class BadInput(ScoutError):
    """Missing or foreign directory, unreadable ledger, bad option, malformed manifest."""

    exit_code = 2


class BadOption(BadInput, ValueError):
    """An API option is misspelled or out of range (scout_ckpt/options.py); the message names the field."""


class LedgerError(BadInput):
    """The ledger is missing, not SQLite, of a newer schema, or locked beyond the busy timeout."""


class NotClean(ScoutError):
    """The thing asked about exists but is not certified, or failed verification."""

    exit_code = 1


class NotFound(ScoutError):
    """No checkpoint matches (e.g. no certified step to resume from)."""

    exit_code = 1


class NoCleanCheckpoint(NotFound):
    """No certified checkpoint to resume from; `reasons` says why (what was skipped, what is newer)."""

    def __init__(self, reasons: list[dict]):
        super().__init__(
            "no certified checkpoint to resume from"
            + (
                f" ({len(reasons[0].get('skipped', []))} failed re-verification)"
                if reasons and reasons[0].get("skipped")
                else ""
            )
        )
        self.reasons = reasons


class LiveStateCorrupt(ScoutError):
    """A save's evidence showed that the live training state is bad (replicas disagreed, replay or a shard's
    update did not recompute, a shard changed at rest, non-finite values, a hardware fault): every checkpoint
    the job would save from here on descends from it. `Checkpointer.save` raises it on every rank (async: at the
    next step()/save()/wait()) so that the generation ends and torchrun restarts from the latest clean
    checkpoint; `on_live_fault="continue"` keeps training instead (every later save is then rejected,
    `lineage_tainted`, until a clean checkpoint is loaded). `step` and `verdict` are the save's."""

    exit_code = 1

    def __init__(self, step: int, verdict: dict):
        kinds = list(verdict.get("live_fault") or [])
        codes = sorted({r.get("code", "?") for r in verdict.get("reasons") or []})
        # kinds of evidence and the reasons' codes; said once where they are the same words (an integration's
        # live_fault lists the codes themselves)
        same = bool(kinds) and set(kinds) <= set(codes)
        what = ", ".join(kinds or ["evidence"]) + ("" if same else f": {', '.join(codes) or '-'}")
        super().__init__(
            f"checkpoint {step} shows the live training state is bad ({what}); ending the "
            "generation so that it restarts from the latest clean checkpoint"
        )
        self.step, self.verdict = step, verdict


class CertifiedStep(ScoutError):
    """A job's save of a step whose certified row exists: refused, the checkpoint and its row left as they are
    (a run that trains over certified checkpoints instead of loading them would replace them)."""

    exit_code = 1


class Quarantined(ScoutError):
    """The step is quarantined by an operator: it is not re-saved or resumed until `scout-ckpt release`."""

    exit_code = 1


class StartRefused(LedgerError):
    """The job must not start on this ROOT's ledger as it is; the message says what to run."""


class CheckpointsUnreadable(StartRefused):
    """Certified checkpoints exist but none could be read now (an I/O error, a missing peer, an unreachable
    store): the job refuses to start from step 0 over them (exit code 75, EX_TEMPFAIL: try again later; on every
    rank alike). "Could not check" is no evidence of a bad checkpoint: torchrun's next restart (or the operator,
    once the storage answers) tries them again."""

    exit_code = 75


class CheckpointsUnverified(StartRefused):
    """Checkpoints exist whose trust a ledger rebuild could not re-establish (`unverified_after_rebuild`: the
    journal that vouched for their consensus and replay is lost or broken), and no certified one is left: the
    job refuses to start from step 0 over them (exit code 2, on every rank alike; a retry does not help, a person
    decides: restore the journal and rebuild, or give the new run its own ROOT)."""


class StateOverwritten(StartRefused):
    """load_latest_clean put a checkpoint's values into the caller's state, found they did not match what was
    certified (the step is rejected), and no older certified checkpoint was left: the state holds those values,
    so the job must not train on it (exit code 75, on every rank alike). The next start, in a fresh process,
    finds the step rejected and starts from fresh state."""

    exit_code = 75


class RootInUse(StartRefused):
    """Another job's Checkpointer holds this ROOT's run lease (exit code 2): two jobs would overwrite each other's
    checkpoints. Point the second job at its own ROOT, or stop the first."""


class LedgerUnavailable(LedgerError):
    """The ledger file exists but cannot be read now: locked beyond the busy timeout, corrupt, a hot journal a
    read-only reader cannot roll back, or WAL on a network filesystem. Readers with a fallback (ls, resume) read
    the checkpoints' manifests and the journal instead (scout_ckpt/ops/disk_view.py)."""


class SaveRefused(ScoutError):
    """The coordinator refused to start a save (e.g. the step is quarantined); raised on every rank."""

    exit_code = 1


class CommitError(ScoutError):
    """The checkpoint could not be published (nothing at step-S changed); raised on every rank."""

    exit_code = 1


class LoadVerificationError(ScoutError):
    """The state passed to load_latest_clean cannot take the saved values (the caller's error: the checkpoint
    keeps its state)."""


class ManifestExists(ScoutError):
    """The attempt's manifest already exists (conditional create refused): another writer published it."""

    exit_code = 1


class NoTargets(ScoutError):
    """Replay found nothing to cover on the model; the message says how to name the targets."""


# Refusals every rank raises alike (the same broadcast decision): the one line is printed by rank 0 alone.
_COLLECTIVE = ("StartRefused", "CheckpointsUnreadable", "LiveStateCorrupt", "CertifiedStep", "Quarantined")
_HOOKED = False


def one_line_refusals() -> None:
    """Chains sys.excepthook once (the integrations' entry points and the Checkpointer call it): a ScoutError that
    ends the program uncaught is printed as one line, `scout-ckpt: <Class>: <message>` (which names the cause and
    the fix), instead of a traceback per rank. A refusal every rank raises alike (StartRefused, LiveStateCorrupt) is
    printed by rank 0 only; any other ScoutError by each rank that raised it, with its rank. Other exceptions, and
    one a script catches, are untouched; the process exits 1 as for any uncaught exception. Installed once, before
    the observer's own hook (observer/handle.py), which chains outside it and so still sees every exception.
    SCOUT_CKPT_TRACEBACK=1 keeps the full traceback."""
    import os
    import sys

    global _HOOKED
    if _HOOKED or os.environ.get("SCOUT_CKPT_TRACEBACK") == "1":
        return
    _HOOKED = True
    previous = sys.excepthook

    def hook(tp, value, tb):
        if not (isinstance(tp, type) and issubclass(tp, ScoutError)):
            return previous(tp, value, tb)
        rank = os.environ.get("RANK")
        collective = any(c.__name__ in _COLLECTIVE for c in tp.__mro__)
        if collective and rank not in (None, "0"):
            return
        where = "" if collective or rank is None else f" (rank {rank})"
        text = " ".join(str(value).split())
        text = text[len("scout-ckpt: ") :] if text.startswith("scout-ckpt: ") else text
        sys.stderr.write(f"scout-ckpt{where}: {tp.__name__}: {text}\n")
        sys.stderr.flush()

    sys.excepthook = hook
