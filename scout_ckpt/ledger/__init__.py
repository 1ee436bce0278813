"""The SQLite ledger beside the checkpoints; the only package that opens the database.

connection.py opens it (journal mode, busy timeouts, migration, the write transaction), queries.py is the read
side, store.py the state machine's writes; `Ledger` (store.py) is all three in one class.
"""

from scout_ckpt.ledger.schema import SCHEMA_VERSION
from scout_ckpt.ledger.store import Ledger
from scout_ckpt.ledger.transitions import ALLOWED, STATES

__all__ = ["Ledger", "STATES", "ALLOWED", "SCHEMA_VERSION"]
