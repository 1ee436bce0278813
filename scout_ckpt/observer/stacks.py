"""Python stacks of a stuck trainer, taken from outside, and the process facts the observer needs.

Why faulthandler: its SIGUSR1 handler is C code that dumps every thread's Python stack straight to a file
descriptor, without the GIL, so it answers even while the main thread is blocked inside a gloo collective.
A SIGSTOPped process cannot run any handler: the observer says so instead of waiting.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from pathlib import Path

DEFAULT_SIGNAL = signal.SIGUSR1


class StackDumper:
    """Training side: registers the dump handler on a per-rank file opened for appending (so the observer can
    read each dump as the bytes added after the signal)."""

    def __init__(self, path: str | os.PathLike, sig: int = DEFAULT_SIGNAL):
        self.path, self.sig = Path(path), sig
        self._file = open(self.path, "ab", buffering=0)
        faulthandler.register(sig, file=self._file, all_threads=True, chain=False)

    def close(self) -> None:
        if self._file.closed:
            return
        faulthandler.unregister(self.sig)
        self._file.close()


def proc_state(pid: int) -> str | None:
    """The state letter from /proc/PID/stat (R, S, D, T stopped, t traced, Z zombie), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return data[data.rindex(b")") + 2 : data.rindex(b")") + 3].decode()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stopped_text(state: str = "T") -> str:
    """Why a stopped process has no stacks (it runs no handler until it is continued)."""
    return f"process is stopped (state {state}, e.g. SIGSTOP): it cannot dump its stacks"


def capture(
    pid: int, path: str | os.PathLike, sig: int = DEFAULT_SIGNAL, timeout_s: float = 1.0, settle_s: float = 0.05
) -> tuple[int, int] | str:
    """Signal `pid` to dump its stacks into `path`; returns the (start, end) byte range of the new dump, or a
    one-line reason why there is none."""
    state = proc_state(pid)
    if state is None or state == "Z":
        return "process is gone"
    if state in ("T", "t"):
        return stopped_text(state)
    path = Path(path)
    start = path.stat().st_size if path.exists() else 0
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return "process is gone"
    deadline = time.monotonic() + timeout_s
    size, stable_since = start, None
    while time.monotonic() < deadline:
        time.sleep(0.01)
        now_size = path.stat().st_size if path.exists() else 0
        if now_size != size:
            size, stable_since = now_size, time.monotonic()
        elif size > start and stable_since is not None and time.monotonic() - stable_since >= settle_s:
            return (start, size)
    if size > start:
        return (start, size)
    return f"no stack dump within {timeout_s:.1f}s (state {proc_state(pid)})"


def read_dump(path: str | os.PathLike, span: tuple[int, int], limit: int = 64_000) -> str:
    start, end = span
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(min(end - start, limit))
    return data.decode(errors="replace")


def collect(ranks, fresh: dict, gone, gone_text: str, channel: Path, stopped=None) -> dict[str, str]:
    """An incident's stacks, by rank: what each named rank dumped (read from its dump file), or why there is none.
    `fresh`: rank -> the dump's record of this incident; `gone(rank)`: the rank's process is gone (or silent);
    `stopped(rank)`: its observer reports the process stopped. A stopped rank's observer records that instead of
    a dump, but the judge may decide before that record arrives (a loaded host delays the rank's observer):
    the row's state already says why there is no dump, so it is never "no stack dump captured"."""
    out = {}
    for r in ranks:
        st = fresh.get(r)
        if gone(r):
            out[str(r)] = gone_text
        elif st is None and stopped is not None and stopped(r):
            out[str(r)] = stopped_text()
        elif st is None:
            out[str(r)] = "no stack dump captured"
        elif "span" in st:
            out[str(r)] = read_dump(channel / f"stacks-{r}.log", tuple(st["span"]))
        else:
            out[str(r)] = st["reason"]
    return out


def incident_detail(verdict: dict, stacks: dict, stall_s: float, action: str) -> dict:
    """The detail of a hang/desync/crash incident the judge publishes (flat or hierarchical observer alike)."""
    detail = {
        "attribution": verdict["attribution"],
        "reason": verdict["reason"],
        "seq": verdict["seq"],
        "cseq": verdict.get("cseq"),
        "stall_s": stall_s,
        "stacks": stacks,
        "action": action,
    }
    if verdict.get("where"):
        detail["where"] = {str(r): w for r, w in verdict["where"].items()}
    return detail
