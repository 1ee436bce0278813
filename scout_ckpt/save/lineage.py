"""The lineage of the live training state: once a save's evidence showed it bad, every later save descends from it.

Why a module of its own: the rule spans a save's verdict (commit thread or training thread), the evidence of the
saves after it (SaveEvidence reads `tainted` into the `lineage` evidence, policy.lineage_evidence), the ledger (a
`live_fault` event, durable before any rank acts), and the training thread, which raises LiveStateCorrupt where
it may (outside a save's observer phase). A clean load ends it (`clear`). Every rank holds one, fed the same
broadcast verdicts, so every rank decides alike.
"""

from __future__ import annotations

from scout_ckpt.errors import LiveStateCorrupt
from scout_ckpt.save import log

ACTIONS = ("raise", "continue")


class Lineage:
    def __init__(self, on_live_fault: str = "raise"):
        self.on_live_fault = on_live_fault
        # {"step", "kinds"} of the first save whose evidence showed the live state bad, until a clean load
        self.tainted: dict | None = None
        self._pending: LiveStateCorrupt | None = None  # raised on the training thread (`take`)

    @property
    def raises(self) -> bool:
        return self.on_live_fault == "raise"

    def note(self, step: int, verdict: dict, *, ledger=None, run_id: str | None = None) -> None:
        """After a commit, on every rank (the coordinator's verdict, broadcast): a verdict with `live_fault`
        taints the lineage; `ledger` (the coordinator's) records the `live_fault` event first."""
        if not verdict.get("live_fault"):
            return
        if self.tainted is None:
            self.tainted = {"step": step, "kinds": list(verdict["live_fault"])}
        if ledger is not None:
            self._record(ledger, run_id, step, verdict)
        if self.raises:
            self._pending = LiveStateCorrupt(step, verdict)

    def pending(self) -> bool:
        return self._pending is not None

    def take(self) -> LiveStateCorrupt | None:
        """The LiveStateCorrupt to raise now, once (None: nothing to raise)."""
        e, self._pending = self._pending, None
        return e

    def clear(self) -> None:
        """A clean checkpoint was loaded (or the run starts fresh): nothing before it taints the saves to come."""
        self.tainted, self._pending = None, None

    def _record(self, ledger, run_id, step: int, verdict: dict) -> None:
        """The `live_fault` event (the report's timeline, the demo's generation story): which evidence found the
        live state bad, the ranks it names, and what the job does about it."""
        ranks = sorted(
            {r for reason in verdict.get("reasons") or [] for r in reason.get("ranks") or [] if isinstance(r, int)}
        )
        try:
            ledger.add_event(
                "live_fault",
                step=step,
                ranks=ranks,
                run_id=run_id,
                detail={
                    "kinds": list(verdict["live_fault"]),
                    "codes": sorted({r.get("code") for r in verdict.get("reasons") or []}),
                    "action": "generation ended" if self.raises else "training continued",
                },
            )
        except Exception as e:  # noqa: BLE001 - the verdict is in the manifest and the ledger row already
            log.logger.warning("step %d: the live_fault event was not recorded (%s)", step, e)
