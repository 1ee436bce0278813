"""Helpers for tests, benches and the campaign: real gloo ranks in child processes (`launch`)."""
