"""What a failed torchrun job's stderr says, in a few lines a CI log keeps.

Why: an assertion message that ends with the last 3000 characters of torchrun's stderr shows its closing summary
and the tail of one rank's traceback, often cut mid-line; the rank that failed first, what it raised and the
signal that ended it are elsewhere. `why_failed` keeps, in order, every rank's exception line (the last line of
each `[rankN]:` traceback), the lines of native aborts (gloo's "enforce fail", "terminate called") with the Python
stacks faulthandler prints at a fatal signal (jobs run with PYTHONFAULTHANDLER=1), torchrun's per-attempt failure
lines and the summary's root cause, then the tail of the stderr."""

from __future__ import annotations

import re

_RANK = re.compile(r"^\[rank(\d+)\]:(.*)$")
_NATIVE = ("terminate called", "enforce fail", "what():", "Fatal Python error", "Segmentation fault")
_FAULTHANDLER = "Fatal Python error"
_STACK_LINES = 40  # of faulthandler's report: the current thread's stack and the other threads' tops
_AGENT = ("failed (exitcode", "Signal ", "exitcode  :", "rank      :", "error_file:", "Root Cause")


def why_failed(stderr: str, tail: int = 1200, limit: int = 4000) -> str:
    lines = stderr.splitlines()
    keep: list[str] = []
    last: dict[str, str] = {}  # rank -> the last line of its traceback so far
    stack = 0
    for line in lines:
        if _FAULTHANDLER in line:
            stack = _STACK_LINES
        if stack:
            keep.append(line.rstrip()[:300])
            stack -= 1
            continue
        m = _RANK.match(line)
        if m:
            text = m.group(2).strip()
            if text.startswith("Traceback"):
                last[m.group(1)] = ""
            elif m.group(1) in last and text and not line.startswith(f"[rank{m.group(1)}]:  "):
                # the exception line: the traceback's first unindented line after its frames
                keep.append(f"rank {m.group(1)} raised: {text[:400]}")
                last.pop(m.group(1))
            continue
        if any(s in line for s in _NATIVE) or any(s in line for s in _AGENT):
            keep.append(line.strip()[:400])
    head = "\n".join(k for i, k in enumerate(keep) if k not in keep[:i] or k.startswith("  "))[:limit]
    return f"{head}\n--- stderr tail ---\n{stderr[-tail:]}"
