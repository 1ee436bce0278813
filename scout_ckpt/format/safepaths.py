"""File names read from untrusted records (manifests, the ledger, DCP `.metadata`) before they are joined.

A checkpoint records its files as paths relative to its own directory. A name such as `../step-3/x`, `/etc/passwd`
or one with a NUL would make a reader hash, report or load a file outside the checkpoint: every name is checked
here, and a joined path is also resolved, so a symlink planted inside the directory cannot lead out of it either.
No torch here: `resume` and `ls` use this module.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

MAX_NAME = 4096


def relpath_problem(name) -> str | None:
    """Why `name` is not a normalized relative POSIX path inside its directory, or None if it is."""
    if not isinstance(name, str):
        return f"not a string ({type(name).__name__})"
    if not name or len(name) > MAX_NAME:
        return "empty or overlong name"
    if "\x00" in name:
        return "NUL in name"
    if name.startswith("/") or "\\" in name:
        return "absolute path or backslash"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "not a normalized relative path"
    if PurePosixPath(name).as_posix() != name:
        return "not a normalized relative path"
    return None


def clip(text, limit: int = 120) -> str:
    """A one-line, bounded rendering of an untrusted string for an error message."""
    s = str(text)
    s = s.encode("unicode_escape", "backslashreplace").decode("ascii", "replace")
    return s if len(s) <= limit else s[:limit] + "..."


def inside(base: str | os.PathLike, name: str) -> Path | None:
    """base/name if name is a safe relative path whose resolved location (symlinks followed) stays inside the
    resolved base directory; None otherwise. The file need not exist."""
    if relpath_problem(name) is not None:
        return None
    base_real = os.path.realpath(base)
    real = os.path.realpath(os.path.join(base_real, name))
    if os.path.commonpath([base_real, real]) != base_real or real == base_real:
        return None
    return Path(base) / name


def is_regular(path: str | os.PathLike) -> bool:
    """True for a regular file (after symlinks); False for a FIFO, device, socket, directory or nothing."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def read_bounded(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most `limit` bytes. Raises FileNotFoundError if it is absent and
    ValueError (with a one-line reason) if it is not a regular file or is larger, before reading it: a FIFO
    would block a reader for ever, `/dev/zero` never ends, a huge file would be read whole."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what} is not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{what} is {st.st_size} bytes, over the {limit}-byte limit")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{what} is over the {limit}-byte limit")
    return data
