"""The evidence a save boundary assembles from the live state: consensus and invariants (`boundary`), the replay
runner's bookkeeping (`replay`), sharded-state evidence (`shard`, `at_rest`) and what the observer saw (`health`)."""
