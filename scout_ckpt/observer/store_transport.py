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
"""

from __future__ import annotations

import datetime
import json


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
