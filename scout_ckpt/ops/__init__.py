"""Offline operations on a ROOT, each the library behind one CLI command: recovery (latest clean), retention,
settling dead saves, certify, ledger rebuild, adopt, operator decisions, views and export. Torch-free except
where a command reads tensors (certify's invariants, export)."""
