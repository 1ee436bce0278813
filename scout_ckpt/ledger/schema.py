"""The ledger's schema, versioned. Migration N takes a database from version N-1 to N.

Every table is plain SQLite with JSON stored as text, so `sqlite3 scout-ledger.db` and `sqlite-utils` can read
it without scout-ckpt. The version lives in `meta.schema_version`.
"""

from __future__ import annotations

SCHEMA_VERSION = 2

# Each entry migrates from version i to i+1. Never edit a released entry: append a new one.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
    CREATE TABLE runs (
        id TEXT PRIMARY KEY,          -- one row per Checkpointer lifetime (an incarnation of the job)
        started REAL,
        world_size INTEGER,
        topology TEXT,                -- JSON: mode, mesh shape, replica groups
        policy TEXT,                  -- JSON: required evidence kinds and their settings
        versions TEXT,                -- JSON: torch, scout-ckpt, python
        resumed_from INTEGER,         -- the certified step this incarnation loaded (NULL: fresh start)
        host TEXT
    );
    CREATE TABLE checkpoints (
        step INTEGER PRIMARY KEY,     -- optimizer steps taken before this state was saved
        run_id TEXT,
        state TEXT NOT NULL,          -- writing|committed|certified|rejected|quarantined|deleted
        path TEXT,                    -- relative to ROOT
        bytes INTEGER,
        attempt TEXT,                 -- id of the temp dir of the save attempt
        started REAL,
        committed REAL,
        updated REAL,
        manifest_digest TEXT,
        reasons TEXT                  -- JSON list of {"code": ..., ...}
    );
    CREATE INDEX checkpoints_state_step ON checkpoints(state, step);
    CREATE TABLE files (
        step INTEGER NOT NULL,
        path TEXT NOT NULL,           -- relative to the checkpoint directory
        size INTEGER,
        digest TEXT,
        rank INTEGER,                 -- the rank that wrote (and hashed) it
        PRIMARY KEY (step, path)
    );
    CREATE TABLE evidence (
        step INTEGER NOT NULL,
        kind TEXT NOT NULL,           -- bytes|consensus|replay|invariants|...
        status TEXT NOT NULL,         -- pass|fail|inconclusive|missing|not_applicable
        detail TEXT,                  -- JSON
        source TEXT,                  -- save|certify|resume|rebuild|adopt
        recorded REAL,
        PRIMARY KEY (step, kind)
    );
    CREATE TABLE certifications (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        step INTEGER NOT NULL,
        time REAL,
        source TEXT,
        state TEXT,
        reasons TEXT
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        time REAL,
        run_id TEXT,
        kind TEXT NOT NULL,           -- sdc|hang|straggler|crash|desync|health|save_interrupted|...
        step INTEGER,
        ranks TEXT,                   -- JSON list of global ranks
        detail TEXT                   -- JSON
    );
    CREATE INDEX events_time ON events(time);
    CREATE TABLE replays (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id TEXT,
        step INTEGER NOT NULL,
        recipe TEXT NOT NULL,         -- block|embedding|head|optimizer
        target TEXT NOT NULL,         -- e.g. "blocks.3", "embedding", "head", "optimizer"
        status TEXT NOT NULL,         -- AGREE|ATTRIBUTED|INCONCLUSIVE
        ranks TEXT,                   -- JSON: attributed global ranks
        duration_s REAL,
        time REAL,
        detail TEXT
    );
    CREATE INDEX replays_run_step ON replays(run_id, step);
    """,
    # v2 (issue 9): who writes a `writing` row (so only a provably dead save is settled), and the outcome of
    # each verdict in the history: a verdict computed on a row that changed meanwhile is kept as 'superseded'.
    """
    ALTER TABLE checkpoints ADD COLUMN owner_host TEXT;
    ALTER TABLE checkpoints ADD COLUMN owner_pid INTEGER;
    ALTER TABLE checkpoints ADD COLUMN owner_start TEXT;
    ALTER TABLE certifications ADD COLUMN attempt TEXT;
    ALTER TABLE certifications ADD COLUMN outcome TEXT
    """,
]


# Additive side tables, outside the version number: created (IF NOT EXISTS) by the first writer that needs them,
# and read only where present, so an older scout-ckpt reading a newer ledger, and a newer one reading an older
# ledger, both work. Never a column that the versioned tables depend on.
AUX_TABLES: dict[str, str] = {
    # Where every global rank of a run (incarnation) ran: torchrun's GROUP_RANK (the agent's node rank in this
    # rendezvous), LOCAL_RANK, the host and the pid; one row per (run, rank), written once at start-up.
    "run_ranks": """
    CREATE TABLE IF NOT EXISTS run_ranks (
        run_id TEXT NOT NULL,
        rank INTEGER NOT NULL,
        host TEXT,
        node_rank INTEGER,
        local_rank INTEGER,
        pid INTEGER,
        detail TEXT,                  -- JSON: the rest of torchrun's env (role, local world size, restart count)
        PRIMARY KEY (run_id, rank)
    )""",
    # The fast tier (save/local_tier.py): one row per (tier, step) of a node-local save, apart from `checkpoints`
    # so that a durable and a local save of the same step never collide and every durable-tier reader (ls, gc,
    # certify, resume) is unchanged. `files`: per rank {"rank", "path", "size", "digest"}; `copies`: where each
    # rank's file lives, [{"rank", "holder", "host", "node", "path", "verified"}]; `signatures`: the full-tensor
    # signatures of the live state (load verification), `evidence`: as in the manifest.
    "tier_checkpoints": """
    CREATE TABLE IF NOT EXISTS tier_checkpoints (
        tier TEXT NOT NULL,           -- local
        step INTEGER NOT NULL,
        run_id TEXT,
        state TEXT NOT NULL,          -- certified|committed|rejected|deleted
        dir TEXT,                     -- DIR/RUN_ID/step-NNNNNNNN relative to each node's local dir
        world_size INTEGER,
        layout TEXT,                  -- JSON: what restoring needs to be the same (world size, mesh, ranks per node)
        files TEXT,
        copies TEXT,
        evidence TEXT,
        signatures TEXT,
        reasons TEXT,
        committed REAL,
        updated REAL,
        PRIMARY KEY (tier, step)
    )""",
    # Indexes for queries whose cost would otherwise grow with the number of checkpoints x ranks (bench/scale.py).
    "files_rank_index": "CREATE INDEX IF NOT EXISTS files_rank ON files(rank, step)",
    "certifications_step_index": "CREATE INDEX IF NOT EXISTS certifications_step ON certifications(step, id)",
    "events_run_index": "CREATE INDEX IF NOT EXISTS events_run ON events(run_id, kind)",
}
