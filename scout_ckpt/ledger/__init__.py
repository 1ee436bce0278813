"""The SQLite ledger beside the checkpoints; the only package that opens the database."""

from scout_ckpt.ledger.schema import SCHEMA_VERSION
from scout_ckpt.ledger.store import STATES, Ledger

__all__ = ["Ledger", "STATES", "SCHEMA_VERSION"]
