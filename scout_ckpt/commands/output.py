"""How the commands print: one JSON document on stdout (--json), or rich text sized for a terminal or a log.

rich is imported when text is drawn, not before: a --json command never pays for it.
"""

from __future__ import annotations

import contextlib
import json
import sys


def emit(obj) -> None:
    """The --json answer: one document on stdout, keys sorted."""
    sys.stdout.write(json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")


def console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 120)  # pipes and logs get full rows, not 80 columns


def escape(text: str) -> str:
    """Text from a ROOT (reasons, paths) printed literally, never read as rich markup."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@contextlib.contextmanager
def progress(enabled: bool):
    """A factory for certify's byte counter: a rich bar on stderr when hashing at least 64 MiB on a terminal,
    stopped (and erased) when the block ends."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    bar = Progress(
        "[progress.description]verifying",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        transient=True,
        console=Console(stderr=True),
    )

    def make(total: int):
        if total < (64 << 20):
            return None
        bar.start()
        task = bar.add_task("verify", total=total)
        return lambda n: bar.advance(task, n)

    try:
        yield make
    finally:
        bar.stop()


__all__ = ["console", "emit", "escape", "human_bytes", "progress"]
