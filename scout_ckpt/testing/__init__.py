"""Helpers for tests, benches and the campaign: real gloo ranks in child processes (`launch`), fault injection
at the Checkpointer's fault points (`faults.fault_points`)."""
