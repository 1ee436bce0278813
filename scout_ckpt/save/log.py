"""What the library tells a training job's log, through Python `logging` (logger "scout_ckpt").

The library configures no handler and no level: a script that calls `logging.basicConfig(level=logging.INFO)`
sees these lines, one that does not sees only WARNINGs (Python's last-resort handler). Lines come from the
coordinator (global rank 0) unless SCOUT_CKPT_LOG_ALL_RANKS=1, since every rank would say the same.

    INFO     scout_ckpt: resumed from step 120 (/ckpt/step-00000120): bytes re-verified (12 files, 201.3 MB,
             4 ranks), loaded state matches the saved signatures, 1.84 s
    WARNING  scout_ckpt: skipped step 130 (certified at save): digest_mismatch(__1_0.distcp)[ranks 1]
    INFO     scout_ckpt: step 140 certified (bytes, consensus, invariants) in 0.42 s
    WARNING  scout_ckpt: step 150 rejected: consensus_attributed[ranks 2]
    WARNING  scout_ckpt: no certified checkpoint under /ckpt: starting from scratch although 3 committed
             checkpoint(s) exist that were never certified: 10 (consensus_not_applicable), ...
    WARNING  scout_ckpt: no certified checkpoint under /ckpt: starting from step 0; 2 checkpoint(s) exist and
             were rejected; newest: 20 (rejected: digest_mismatch(__0_0.distcp)), 30 (rejected: load_mismatch)
    WARNING  scout_ckpt: could not check step 30 now (could_not_check(__1_0.distcp)[ranks 1]): loading an older
             step; step 30 stays certified
"""

from __future__ import annotations

import logging
import os

from scout_ckpt.ops.views import reason_text

logger = logging.getLogger("scout_ckpt")


def _speaks(rank: int) -> bool:
    return rank == 0 or os.environ.get("SCOUT_CKPT_LOG_ALL_RANKS") == "1"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def save_verdict(
    rank: int, step: int, verdict: dict, seconds: float | None = None, evidence_kinds: list[str] | None = None
) -> None:
    """One line per committed save: INFO when certified or awaiting evidence, WARNING when rejected."""
    if not _speaks(rank):
        return
    took = f" in {seconds:.2f} s" if seconds is not None else ""
    state, reasons = verdict.get("state"), verdict.get("reasons") or []
    if state == "certified":
        kinds = f" ({', '.join(evidence_kinds)})" if evidence_kinds else ""
        logger.info("step %d certified%s%s", step, kinds, took)
    elif state == "rejected":
        logger.warning("step %d rejected%s: %s", step, took, reason_text(reasons))
    else:
        logger.info("step %d %s%s, awaiting: %s", step, state, took, reason_text(reasons) or "-")


def resumed(
    rank: int, step: int, path: str, *, files: int, nbytes: int, ranks: int, signatures: bool, seconds: float
) -> None:
    if not _speaks(rank):
        return
    sig = ", loaded state matches the saved signatures" if signatures else ""
    logger.info(
        "resumed from step %d (%s): bytes re-verified (%d files, %s, %d ranks)%s, %.2f s",
        step,
        path,
        files,
        _mb(nbytes),
        ranks,
        sig,
        seconds,
    )


def skipped(rank: int, step: int, reasons: list[dict]) -> None:
    if _speaks(rank):
        logger.warning("skipped step %d: %s", step, reason_text(reasons))


def could_not_check(rank: int, step: int, reasons: list[dict]) -> None:
    """A certified step whose files could not be read now (an I/O error): passed over for this load, not
    rejected (it stays certified; the next restart tries it again)."""
    if _speaks(rank):
        logger.warning(
            "could not check step %d now (%s): loading an older step; step %d stays certified",
            step,
            reason_text(reasons),
            step,
        )


def fresh_start(rank: int, root: str, uncertified: list[dict]) -> None:
    """No certified checkpoint to load: quiet (INFO) on a new run; a WARNING when checkpoints exist that were
    rejected (naming each and why: a restart past them all is worth a person's look) or committed but never
    certified (almost always a configuration that cannot certify, e.g. pure FSDP without shard evidence)."""
    if not _speaks(rank):
        return
    rejected = [r for r in uncertified if r["state"] == "rejected"]
    pending = [r for r in uncertified if r["state"] in ("committed", "writing")]
    if not rejected and not pending:
        logger.info("no checkpoint under %s: starting from step 0", root)
        return

    def listed(rows):
        return ", ".join(f"{r['step']} ({r['state']}: {reason_text(r.get('reasons') or []) or '-'})" for r in rows[-5:])

    if rejected:
        logger.warning(
            "no certified checkpoint under %s: starting from step 0; %d checkpoint(s) exist and were "
            "rejected; newest: %s%s. `scout-ckpt explain %s STEP` says why each was rejected",
            root,
            len(rejected),
            listed(rejected),
            f"; {len(pending)} more never certified: {listed(pending)}" if pending else "",
            root,
        )
        return
    logger.warning(
        "no certified checkpoint under %s: starting from scratch although %d checkpoint(s) exist that "
        "were never certified; newest: %s. `scout-ckpt explain %s STEP` says what each lacks",
        root,
        len(pending),
        listed(pending),
        root,
    )


RESTART_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def restart_hint(env) -> str | None:
    """Pure: the warning a job started by `torchrun --max-restarts N` (N > 0) needs when its environment lacks
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it a restarted generation can fail to form its gloo group, or
    hang, against the previous generation's addresses (docs/pytorch-facts.md, torch 2.13). None when nothing is to say."""
    if "TORCHELASTIC_RUN_ID" not in env or env.get(RESTART_ENV) == "1":
        return None
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return None
    if restarts <= 0:
        return None
    return (
        f"torchrun --max-restarts {restarts} without {RESTART_ENV}=1 in the environment: a restarted "
        "generation can hang forming its process group; start the job with "
        f"`{RESTART_ENV}=1 torchrun ...`"
    )


def warn_restart_env(rank: int, env) -> None:
    hint = restart_hint(env)
    if hint is not None and _speaks(rank):
        logger.warning(hint)
