"""The hierarchy's transport: a c10d TCPStore hosted by the root observer (node 0's aggregator).

Why a TCPStore: torch gives every job one (its server is a C++ thread that keeps answering while the process's
Python is busy), it needs no new protocol, and it reads a batch of keys in one round trip (`multi_get`: 112 keys
of 1 KB in under a millisecond on this machine's loopback). Why one the root observer hosts rather than the job's
own store: the job's store lives in rank 0's trainer (torch's env:// rendezvous), and dies with it, the very
moment the observers must speak. Its address travels through the job's store (observer/handle.py), once.

Keys are small JSON documents, each written by one process: `node/N` (node N's summary), `group/G` (a group
leader's merge), and the counter `claims` (bumped by the root at each incident it publishes; `add(key, 0)` reads
it without blocking). A key that does not exist yet is never waited for: `read` checks first (a store `get` of a
missing key blocks until the store's timeout).

A store that does not answer is not bounded by the store's own timeout: with torch 2.13, a client whose server's
process is stopped (its host stuck, SIGSTOP) blocks in `check`, `add` and in the constructor's handshake far past
the timeout it was given (measured: over 60-85 s against 5 s; docs/pytorch-facts.md). `Bounded` runs such calls on
a thread of their own, so that the observer's loop waits at most its own limit.
"""

from __future__ import annotations

import datetime
import json
import threading
from typing import Any, Callable


class StoreTransport:
    """`host`, `port`: the root's store. `serve`: this process hosts it (the root observer)."""

    CLAIMS = "claims"

    def __init__(self, host: str, port: int, serve: bool, timeout_s: float = 30.0):
        from torch.distributed import TCPStore  # only aggregators import torch, after their first status

        self.store = TCPStore(
            host,
            port,
            is_master=serve,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self._present: set[str] = set()
        self.reads = 0  # keys read since the last `take_reads` (the bench's and the tests' count)

    def publish(self, key: str, obj: dict) -> None:
        self.store.set(key, json.dumps(obj, separators=(",", ":")))

    def read(self, keys: list[str]) -> dict[str, dict | None]:
        """{key: document or None (not written yet)}; one round trip for the keys known to exist."""
        missing = [k for k in keys if k not in self._present]
        for k in missing:
            if self.store.check([k]):
                self._present.add(k)
        have = [k for k in keys if k in self._present]
        out: dict[str, dict | None] = dict.fromkeys(keys)
        if have:
            for k, v in zip(have, self.store.multi_get(have)):
                out[k] = json.loads(v)
        self.reads += len(keys)
        return out

    def claims(self) -> int:
        return int(self.store.add(self.CLAIMS, 0))

    def bump_claims(self) -> int:
        return int(self.store.add(self.CLAIMS, 1))


class Bounded:
    """Runs one call at a time on a daemon thread and waits for it at most `timeout_s`. A call that outlives its
    wait is left to finish on its thread (a Python thread cannot be stopped), and every call made before it
    returns fails at once: the caller's loop goes on either way, and the store is tried again once it answers."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._running: threading.Thread | None = None

    def __call__(self, fn: Callable[[], Any]) -> Any:
        if self._running is not None and self._running.is_alive():
            raise TimeoutError("the store call of an earlier round has not returned yet")
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["value"] = fn()
            except BaseException as e:  # handed to the caller, on its thread
                out["error"] = e

        t = threading.Thread(target=run, name="scout-observer-store", daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            self._running = t
            raise TimeoutError(f"the store did not answer within {self.timeout_s:.1f}s")
        if "error" in out:
            raise out["error"]
        return out.get("value")
