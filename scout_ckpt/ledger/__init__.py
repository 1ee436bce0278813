"""The SQLite ledger beside the checkpoints; the only package that opens the database."""

from scout_ckpt.ledger.schema import SCHEMA_VERSION
from scout_ckpt.ledger.store import Ledger, LedgerUnavailable
from scout_ckpt.ledger.transitions import ALLOWED, STATES

__all__ = ["Ledger", "LedgerUnavailable", "STATES", "ALLOWED", "SCHEMA_VERSION"]
