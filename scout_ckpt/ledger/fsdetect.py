"""Which SQLite journal mode the ledger may use on the filesystem that holds ROOT.

SQLite documents that WAL "does not work over a network filesystem": WAL readers and writers coordinate through
a shared-memory index (the -shm file mapped into every process), and memory is not shared between hosts. On
Lustre and GPFS it fails in practice; on NFS two hosts can each believe they own the WAL. The rollback journal
(journal_mode=DELETE) needs only POSIX byte-range locks on the database file, which NFSv4, NFSv3 with lockd,
Lustre (mounted with `flock`), GPFS, BeeGFS and CephFS provide across hosts. So: WAL on local disks (readers
never wait for the writer), DELETE on anything network or FUSE.

Detection: the longest mount point in /proc/self/mountinfo that contains the path's real location gives the
filesystem type (a string such as "ext4", "nfs4", "fuse.sshfs"); where mountinfo cannot be read, statfs(2)'s
f_type magic number. An unknown type counts as network (fail closed: DELETE is correct everywhere, WAL is not).

SQLite's locks are POSIX byte-range locks: on a mount whose locks stay local to each host (NFS `nolock` or
`local_lock=...`, Lustre `localflock`) they do not serialize writers on different hosts; `choose_journal` says so
("cross_host_locks": False) and the writer logs a warning: keep every ledger writer on one host there.

Overrides, strongest first: the caller's `ledger_journal` ("wal" | "delete" | "auto"), the environment variable
SCOUT_CKPT_LEDGER_JOURNAL (same values), and for tests and odd mounts SCOUT_CKPT_FSTYPE (pretend ROOT is on
that filesystem type).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

from scout_ckpt.errors import BadInput

JOURNAL_ENV = "SCOUT_CKPT_LEDGER_JOURNAL"
FSTYPE_ENV = "SCOUT_CKPT_FSTYPE"
MODES = ("auto", "wal", "delete")

# Local, block-device or memory filesystems on which WAL's shared-memory index is sound.
LOCAL_TYPES = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "zfs",
        "f2fs",
        "jfs",
        "reiserfs",
        "bcachefs",
        "tmpfs",
        "ramfs",
        "overlay",
        "overlayfs",
        "vfat",
        "exfat",
        "ntfs",
        "ntfs3",
        "hfs",
        "hfsplus",
        "apfs",
        "squashfs",
        "erofs",
        "devtmpfs",
        "nilfs2",
        "udf",
        "iso9660",
        "rootfs",
        "shm",
    }
)
# Known network / cluster / FUSE types (documentation and tests; anything not local counts as network anyway).
NETWORK_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb",
        "smb2",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "cephfs",
        "9p",
        "glusterfs",
        "afs",
        "ocfs2",
        "gfs2",
        "orangefs",
        "pvfs2",
        "panfs",
        "wekafs",
        "virtiofs",
        "fuse",
        "fuseblk",
        "davfs",
        "sshfs",
        "s3fs",
        "gcsfuse",
        "juicefs",
        "quobyte",
        "vboxsf",
        "nfsd",
    }
)

# statfs(2) f_type magic numbers (linux/magic.h and the filesystems' own headers), used when mountinfo is absent.
_MAGIC = {
    0xEF53: "ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x2FC12FC1: "zfs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x794C7630: "overlay",
    0xF2F52010: "f2fs",
    0x6969: "nfs",
    0x517B: "smb",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
    0x19830326: "beegfs",
    0x00C36400: "ceph",
    0x01021997: "9p",
    0x65735546: "fuse",
    0x5346414F: "afs",
    0x7461636F: "ocfs2",
    0x01161970: "gfs2",
    0x6E667364: "nfsd",
}


def is_network(fstype: str) -> bool:
    """True for every type on which WAL is unsafe: network, cluster, FUSE (`fuse.*`), and anything unknown."""
    t = fstype.lower()
    return t not in LOCAL_TYPES


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\040, \\011, \\012, \\134."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1 : i + 4]) == 3 and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """[(mount point, filesystem type)] from /proc/self/mountinfo text (proc(5): the fields after " - " are
    type, source, options). Malformed lines are skipped."""
    return [(point, fstype) for point, fstype, _ in _mounts(text)]


def _mounts(text: str) -> list[tuple[str, str, set[str]]]:
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        parts, tail = left.split(), right.split()
        if not sep or len(parts) < 5 or not tail:
            continue
        opts = set(parts[5].split(",")) if len(parts) > 5 else set()
        if len(tail) > 2:
            opts |= set(tail[2].split(","))
        out.append((_unescape(parts[4]), tail[0], opts))
    return out


# Mount options under which byte-range locks are local to each host: SQLite's locking (and so the one-writer
# discipline) then does not hold across hosts (NFS `nolock` / `local_lock=all|posix`, Lustre `localflock`).
LOCAL_LOCK_OPTIONS = ("nolock", "local_lock=all", "local_lock=posix", "localflock")


def mount_options(path: str | os.PathLike, *, mountinfo: str | None = None) -> set[str]:
    """The mount and superblock options of the mount holding `path` (empty if unknown)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return set()
    real = os.path.realpath(os.path.abspath(path))
    best: tuple[str, set[str]] | None = None
    for point, _, opts in _mounts(mountinfo):
        p = point.rstrip("/") or "/"
        if (real == p or real.startswith(p if p == "/" else p + "/")) and (best is None or len(p) >= len(best[0])):
            best = (p, opts)
    return best[1] if best else set()


def _mount_of(path: str, mounts: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The longest mount point containing path (the last one listed wins among equal points: over-mounts)."""
    best = None
    for point, fstype in mounts:
        p = point.rstrip("/") or "/"
        if path == p or path.startswith(p if p == "/" else p + "/"):
            if best is None or len(p) >= len(best[0]):
                best = (p, fstype)
    return best


class _Statfs(ctypes.Structure):
    # struct statfs on Linux (64-bit and 32-bit with _FILE_OFFSET_BITS irrelevant for f_type: the first word)
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 120)]


def _statfs_type(path: str) -> str | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        buf = _Statfs()
        if libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    magic = buf.f_type & 0xFFFFFFFF
    return _MAGIC.get(magic, f"magic-0x{magic:x}")


def fs_type(path: str | os.PathLike, *, mountinfo: str | None = None) -> str:
    """The filesystem type holding `path` (its nearest existing ancestor): SCOUT_CKPT_FSTYPE if set, else the
    mountinfo entry (the given text, or /proc/self/mountinfo), else statfs's magic; "unknown" if all fail."""
    forced = os.environ.get(FSTYPE_ENV, "").strip()
    if forced:
        return forced
    p, tail = Path(os.path.abspath(path)), list[str]()
    while not p.exists() and p != p.parent:  # a ROOT not created yet: its nearest existing ancestor decides
        tail.insert(0, p.name)
        p = p.parent
    real = os.path.join(os.path.realpath(p), *tail)
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            mountinfo = ""
    found = _mount_of(real, parse_mountinfo(mountinfo))
    if found is not None:
        return found[1]
    return _statfs_type(str(p)) or "unknown"


def resolve_mode(requested: str | None) -> str:
    """The journal mode asked for: `requested` if given, else SCOUT_CKPT_LEDGER_JOURNAL, else "auto".
    BadInput for anything but auto, wal, delete."""
    mode = requested if requested is not None else (os.environ.get(JOURNAL_ENV, "").strip() or "auto")
    mode = mode.lower()
    if mode not in MODES:
        src = "ledger_journal" if requested is not None else JOURNAL_ENV
        raise BadInput(f"{src}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def choose_journal(root: str | os.PathLike, requested: str | None = None, *, mountinfo: str | None = None) -> dict:
    """{"mode": "wal"|"delete", "requested", "fstype", "why"}: the journal mode for a ledger under `root`."""
    req = resolve_mode(requested)
    fstype = fs_type(root, mountinfo=mountinfo)
    network = is_network(fstype)
    local_locks = (
        sorted(o for o in mount_options(root, mountinfo=mountinfo) if o in LOCAL_LOCK_OPTIONS) if network else []
    )
    out = {
        "mode": req,
        "requested": req,
        "fstype": fstype,
        "why": "requested",
        "cross_host_locks": not local_locks,
        "local_lock_options": local_locks,
    }
    if req == "auto":
        out.update(
            mode="delete" if network else "wal",
            why=f"{fstype} is {'a network, FUSE or unknown' if network else 'a local'} filesystem",
        )
    return out
