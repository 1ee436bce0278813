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
        super().__init__("no certified checkpoint to resume from" + (
            f" ({len(reasons[0].get('skipped', []))} failed re-verification)" if reasons and reasons[0].get("skipped")
            else ""))
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
        kinds = ", ".join(verdict.get("live_fault") or []) or "evidence"
        codes = ", ".join(sorted({r.get("code", "?") for r in verdict.get("reasons") or []})) or "-"
        super().__init__(f"checkpoint {step} shows the live training state is bad ({kinds}: {codes}); ending the "
                         "generation so that it restarts from the latest clean checkpoint")
        self.step, self.verdict = step, verdict


class CertifiedStep(ScoutError):
    """A job's save of a step whose certified row exists: refused, the checkpoint and its row left as they are
    (a run that trains over certified checkpoints instead of loading them would replace them)."""

    exit_code = 1


class Quarantined(ScoutError):
    """The step is quarantined by an operator: it is not re-saved or resumed until `scout-ckpt release`."""

    exit_code = 1
