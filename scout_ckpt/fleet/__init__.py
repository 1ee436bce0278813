"""Fleet memory: which hosts and devices keep turning up in attributed verdicts, across jobs (docs/fleet.md).

identity (where a rank runs: host, local rank, the device's stable identity), store (the shared SQLite file),
records (a ROOT's attributed events as fleet records), recorder (the job's background appender), suspects (the
ranking an operator reads, and the drain commands it prints).
"""
