"""Collective fingerprints: which public torch.distributed collective each rank entered, and in what order.

The tracer replaces the collective functions on the `torch.distributed` module for the Checkpointer's lifetime.
Each call that is not on an ignored group (the checkpointer's own side groups) gets the next per-process sequence
number and a 64-bit fingerprint of what every rank must agree on: the op, the group's shape, tensor shapes and
dtypes, the reduce op and the root. Rank-dependent values are left out: split sizes and per-rank list contents,
the src-only scatter list and dst-only gather list, and the group's absolute members (HSDP's replica groups
{0,2} and {1,3} have the same shape, so SPMD subgroups fingerprint equal on every rank).

Why Python's tuple hash: it costs ~100 ns, and over ints (op ids, shapes, dtype ids) it is the same in every
process (only str/bytes hashing is salted per process), which is all the observers compare.

What is seen: every call made through the `torch.distributed` namespace: the user's own, FSDP2's all-gathers
and reduce-scatters (torch 2.13 issues them as `dist.all_gather_single` / `dist.reduce_scatter_single`), and
DDP's gradient all-reduces only where the opt-in traced comm hook is registered (`observer.ddp`); by default
DDP's reducer all-reduces in C++ and is counted, not traced (observer/counts.py). Each traced call on a watched
group also records its native position (the watched groups' count it takes), so a Python collective can be
told from a native one issued at the same position on another rank. An `async_op=True` call leaves the "in collective" flag when it is issued; the
rank's wait for it lasts until its Work completes (a future callback), which is what the busy time subtracts.

Limits: functional collectives (torch.distributed._functional_collectives, compiled code) run in C++ and are
not seen; a side-group call on the training thread sets a "waiting" flag but no sequence number (a rank stuck in
a checkpoint collective is waiting too); sequence numbers are comparable across ranks for SPMD jobs
(DDP/FSDP/HSDP), not for pipeline stages.
"""

from __future__ import annotations

import functools
import inspect
import zlib
from threading import get_ident

import torch.distributed as dist

from scout_ckpt.observer.heartbeat import Heartbeat

Work = dist.Work

MASK64 = (1 << 64) - 1
ABSENT = -7  # stands in for None: hash(None) is address-based in Python 3.11, so it differs between processes

# op -> the arguments that every rank passes identically, and how to fingerprint each:
#   T: one tensor (shape, dtype); TL: list of tensors; TD: dtype and trailing dims (the leading dim may differ);
#   TLD: list length and dtypes; V: a plain value (root rank, op); N: a list's length.
SPECS: dict[str, tuple[tuple[str, str], ...]] = {
    "all_reduce": (("tensor", "T"), ("op", "V")),
    "all_gather": (("tensor_list", "TL"), ("tensor", "T")),
    "all_gather_into_tensor": (("output_tensor", "T"), ("input_tensor", "T")),
    "reduce_scatter": (("output", "T"), ("input_list", "TL"), ("op", "V")),
    "reduce_scatter_tensor": (("output", "T"), ("input", "T"), ("op", "V")),
    # torch 2.13's FSDP2 (fully_shard) issues its all-gathers and reduce-scatters through these two names
    # (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), as `dist.<name>(..., async_op=...)` calls
    "all_gather_single": (("output_tensor", "T"), ("input_tensor", "T")),
    "reduce_scatter_single": (("output", "T"), ("input", "T"), ("op", "V")),
    "broadcast": (("tensor", "T"), ("src", "V"), ("group_src", "V")),
    "barrier": (),
    "monitored_barrier": (),
    "all_to_all": (("output_tensor_list", "TLD"), ("input_tensor_list", "TLD")),
    "all_to_all_single": (("output", "TD"), ("input", "TD")),
    "gather": (("tensor", "T"), ("dst", "V"), ("group_dst", "V")),
    "scatter": (("tensor", "T"), ("src", "V"), ("group_src", "V")),
    "reduce": (("tensor", "T"), ("dst", "V"), ("op", "V"), ("group_dst", "V")),
    "all_gather_object": (("object_list", "N"),),
    "gather_object": (("dst", "V"), ("group_dst", "V")),
    "broadcast_object_list": (("object_list", "N"), ("src", "V"), ("group_src", "V")),
    "scatter_object_list": (("src", "V"), ("group_src", "V")),
}


def stable_id(text: str) -> int:
    return zlib.crc32(text.encode())


class _DtypeIds(dict):
    """dtype -> a stable int (a dtype's own hash is its address, which differs between processes)."""

    def __missing__(self, dt):
        self[dt] = stable_id(str(dt))
        return self[dt]


def _value(v):
    if v is None:
        return ABSENT
    if isinstance(v, (int, bool)):
        return v
    try:
        return int(v)  # ReduceOp.RedOpType
    except (TypeError, ValueError):
        return stable_id(type(v).__name__ + ":" + str(v))


# how each kind of argument enters the fingerprint; `{v}` is the argument
_KIND_EXPR = {
    "T": "ABSENT if {v} is None else ({v}.shape, DT[{v}.dtype])",
    "TL": "ABSENT if {v} is None else tuple((t.shape, DT[t.dtype]) for t in {v})",
    "TD": "ABSENT if {v} is None else ({v}.shape[1:], DT[{v}.dtype])",
    "TLD": "ABSENT if {v} is None else tuple(DT[t.dtype] for t in {v})",
    "N": "ABSENT if {v} is None else len({v})",
    "V": "VALUE({v})",
}


def _compile_fp(name: str, orig, spec, ignored: set, group_key, group_keys: dict):
    """fp_of(args, kwargs) -> fingerprint, or None for an ignored group. Generated per op (straight-line code,
    no loop over the spec) because it runs on every collective: about 0.3 us instead of 1 us."""
    sig = inspect.signature(orig).parameters
    params = list(sig)
    defaults = {p: (None if sig[p].default is inspect.Parameter.empty else sig[p].default) for p in params}
    gidx = params.index("group")
    lines = [
        "def fp_of(args, kwargs):",
        "    n = len(args)",
        f"    g = args[{gidx}] if n > {gidx} else kwargs.get('group')",
        "    if g is not None and id(g) in IGNORED:",
        "        return None",
    ]
    feats = []
    for j, (p, kind) in enumerate(spec):
        i = params.index(p)
        lines.append(f"    a{j} = args[{i}] if n > {i} else kwargs.get({p!r}, D{j})")
        feats.append(_KIND_EXPR[kind].format(v=f"a{j}"))
    lines.append("    gk = GROUP_KEYS.get(id(g) if g is not None else None) or GROUP_KEY(g)")
    lines.append(f"    return hash((OP, gk, ({', '.join(feats)}{',' if feats else ''}))) & MASK64")
    ns = {
        "IGNORED": ignored,
        "OP": stable_id(name),
        "GROUP_KEY": group_key,
        "GROUP_KEYS": group_keys,
        "ABSENT": ABSENT,
        "DT": _DTYPE_IDS,
        "VALUE": _value,
        "MASK64": MASK64,
        **{f"D{j}": defaults[p] for j, (p, _k) in enumerate(spec)},
    }
    exec(compile("\n".join(lines), f"<scout fingerprint of {name}>", "exec"), ns)
    return ns["fp_of"]


_DTYPE_IDS = _DtypeIds()


class CollectiveTracer:
    """Wraps the public collectives; `install` / `uninstall` bracket the Checkpointer's lifetime."""

    _active: "CollectiveTracer | None" = None

    def __init__(self, heartbeat: Heartbeat | None, ignore=()):
        self.hb = heartbeat
        self.seq = 0
        self._ignored: set[int] = set()
        self._ignored_refs: list = []  # keep ignored groups alive so their ids are not reused
        self._group_keys: dict[int | None, tuple] = {}
        self._group_refs: list = []
        self._originals: dict[str, object] = {}
        self._wrappers: dict[str, object] = {}
        self.counter = None  # observer/counts.py: set by Observer.start; gives each call its native position
        self.ignore(*ignore)

    @classmethod
    def install(cls, heartbeat: Heartbeat | None, *, ignore=()) -> "CollectiveTracer":
        if CollectiveTracer._active is not None:
            raise RuntimeError("a CollectiveTracer is already installed in this process")
        tracer = cls(heartbeat, ignore)
        for name, spec in SPECS.items():
            orig = getattr(dist, name, None)
            if orig is None:
                continue
            tracer._originals[name] = orig
            tracer._wrappers[name] = wrapper = tracer._wrap(name, orig, spec)
            setattr(dist, name, wrapper)
        CollectiveTracer._active = tracer
        return tracer

    def ignore(self, *groups) -> None:
        """Collectives on these groups are passed through unseen (the checkpointer's own side groups)."""
        for g in groups:
            if g is not None and id(g) not in self._ignored:
                self._ignored.add(id(g))
                self._ignored_refs.append(g)

    def uninstall(self) -> None:
        """Puts the original functions back (only where our wrapper is still the one installed)."""
        for name, orig in self._originals.items():
            if getattr(dist, name, None) is self._wrappers[name]:
                setattr(dist, name, orig)
        self._originals.clear()
        self._wrappers.clear()
        if CollectiveTracer._active is self:
            CollectiveTracer._active = None

    # ---- the wrapper ---------------------------------------------------------------------------------------

    def _group_key(self, group) -> tuple:
        """The group's shape: its size and members relative to the first. Cached per group object."""
        key = self._group_keys.get(id(group) if group is not None else None)
        if key is None:
            ranks = sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
            key = (len(ranks),) + tuple(r - ranks[0] for r in ranks)
            self._group_keys[id(group) if group is not None else None] = key
            if group is not None:
                self._group_refs.append(group)
        return key

    def fingerprint(self, name: str, args: tuple, kwargs: dict) -> int | None:
        """The fingerprint the wrapper would record for this call (None on an ignored group)."""
        return self._wrappers[name].__scout_fp__(args, kwargs)

    def _wrap(self, name: str, orig, spec):
        fp_of = _compile_fp(name, orig, spec, self._ignored, self._group_key, self._group_keys)
        gidx = list(inspect.signature(orig).parameters).index("group")
        hb = self.hb
        owner = hb.owner if hb is not None else None
        tracer = self

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            fp = fp_of(args, kwargs)
            if fp is None:  # a side group: visible as waiting, not counted
                if hb is None or get_ident() != owner:
                    return orig(*args, **kwargs)
                hb.side(True)
                try:
                    return orig(*args, **kwargs)
                except Exception:
                    hb.error()  # a side group's collective failed under this rank: a victim too, not a culprit
                    raise
                finally:
                    hb.side(False)
            tracer.seq = seq = tracer.seq + 1
            if hb is None:
                return orig(*args, **kwargs)
            counter = tracer.counter
            hb.enter(
                seq,
                fp,
                0 if counter is None else counter.position(args[gidx] if len(args) > gidx else kwargs.get("group")),
            )
            try:
                out = orig(*args, **kwargs)
            except BaseException:
                hb.error()
                hb.leave(seq)
                raise
            # an async_op call returns its Work: the rank waits until it completes, not until it is issued
            hb.leave(seq, out if out is not None and isinstance(out, Work) else None)
            return out

        def issue_async(*args, **kwargs):
            """The same call with async_op=True, whose wait the caller ends: returns (work, box), box None when
            nothing was recorded (an ignored group, no heartbeat, another thread); else the caller's completion
            callback calls `hb.completed(box, failed)` (CollectiveTracer.issue_async)."""
            fp = fp_of(args, kwargs)
            if fp is None or hb is None or get_ident() != owner:
                if fp is not None:
                    tracer.seq += 1
                return orig(*args, async_op=True, **kwargs), None
            tracer.seq = seq = tracer.seq + 1
            counter = tracer.counter
            hb.enter(
                seq,
                fp,
                0 if counter is None else counter.position(args[gidx] if len(args) > gidx else kwargs.get("group")),
            )
            try:
                work = orig(*args, async_op=True, **kwargs)
            except BaseException:
                hb.error()
                hb.leave(seq)
                raise
            return work, hb.leave_open(seq)

        wrapper.__scout_fp__ = fp_of
        wrapper.__scout_original__ = orig
        wrapper.__scout_issue_async__ = issue_async
        return wrapper

    def issue_async(self, name: str, *args, **kwargs):
        """Issue collective `name` with async_op=True, traced like any call (sequence number, fingerprint,
        "in collective" while it is issued), but leave the end of this rank's wait to the caller: returns
        (work, box); the caller's own completion callback calls `self.hb.completed(box, failed)` when box is
        not None. DDP's comm hook chains a callback on every bucket anyway, so this saves the tracer's own."""
        return self._wrappers[name].__scout_issue_async__(*args, **kwargs)
