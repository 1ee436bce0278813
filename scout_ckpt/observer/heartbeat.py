"""The training side's heartbeat: a fixed 2048-byte record in a shared-memory file that the observer maps read-only.

Why shared memory and a seqlock: the trainer must publish its progress at the cost of a few stores (no syscall,
no lock, no GIL hand-off to another thread), and the observer must read it even while the trainer is blocked in C
code or SIGSTOPped. The writer makes the version odd, writes the fields, then makes it even; a reader retries until
it sees the same even version before and after reading, so it never sees a torn record. (CPython's struct writes
and reads fields in order; on x86 stores and loads are not reordered with each other. The version itself is
stored and loaded through a memoryview of unsigned 64-bit items, one aligned 8-byte access: struct.pack_into
zero-fills before it writes, which would briefly show an even version 0.)

Three areas, each with its own version word: the training thread's (step, phase, traced collectives, busy
time), the counting thread's (observer/counts.py: the watched groups' native collective count, when it changed,
and the ring of per-step sampled arrivals) and the training thread's step stamps (observer/stamps.py: per step,
when this rank left the previous step's synchronisation and when it reached the next step's first collective,
both read on this rank's clock on the training thread itself, and how long the training thread waited for a CPU
in between: observer/cpuwait.py). Two writers on one seqlock would tear each
other's records; a seqlock per area costs nothing more, and keeps the main record's read short.

The file lives in /dev/shm (tmpfs) when there is one, so updates never reach a disk.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from scout_ckpt.observer.cpuwait import RunQueueWait

PHASES = ("idle", "step", "forward", "backward", "optimizer", "data", "checkpoint", "eval")
_PHASE_ID = {p: i for i, p in enumerate(PHASES)}
MAGIC = 0x5343_4F55_5448_4234  # "SCOUTHB4" (HB3: 1024 bytes, stamps without the run-queue wait)
SIZE = 2048

IN_COLL = 1  # inside a traced collective
COLL_ERROR = 2  # a traced collective raised (a victim of a peer's failure, not a culprit)
CLOSED = 4  # the trainer closed the heartbeat cleanly
IN_SIDE = 8  # inside a collective on an ignored (side) group: waiting, but not a training collective
OFF_WATCH = 16  # the latest traced collective is off the watched groups: fp_enter is not the one at pos_enter
COUNTED = 32  # a DDP module without a hook is watched, with step stamps: its gradient all-reduces are counted,
# their waits unseen by the tracer, so the stamps (not busy time) measure its compute

_COLL = struct.Struct("<QdQQQ")  # @8: flags, t_update, seq_enter, fp_enter, seq_leave
_STEP = struct.Struct("<qQddddd")  # @48: step, phase, last_dur, n_steps(as float), dur_sum, busy_sum, coll_sum
_IDENT = struct.Struct("<qQ")  # @104: pid, magic
ASYNC_ERROR_WORD = 15  # @120: set to 1 (one aligned store, outside the seqlock) by the
# completion callback of an async collective that failed
_ALL = struct.Struct("<QQdQQQqQddddd" + "qQ")  # version + everything, for readers
_POS = struct.Struct("<Q")  # @128 (under the version @0): position of the latest traced
# collective among the watched groups' native collectives
# The native-count area, written by the counting thread only (observer/counts.py), under its own version word:
# @136 version, @144 count (sum of the watched groups' C++ sequence numbers), @152 time it last changed,
# @160 how many arrivals were written, @168 ring of ARRIVALS (step, time its first collective was issued).
NATIVE_AT = 136
ARRIVALS = 16
_NATIVE = struct.Struct("<QdQ")
_ARRIVAL = struct.Struct("<qd")
_RING_AT = 168
# The step stamps, written by the training thread (observer/stamps.py) under their own version word: @512 version,
# @520 how many were written, @528 ring of STAMPS (step, left the previous step's sync, reached this step's first
# collective, seconds the training thread waited for a CPU in between), wall times of this rank's clock.
STAMPS_AT = 512
STAMPS = 16
_STAMP = struct.Struct("<qddd")
_STAMP_RING_AT = 528


@dataclass(frozen=True)
class Snapshot:
    """One consistent reading of a heartbeat."""

    version: int
    flags: int
    t_update: float
    seq_enter: int
    fp_enter: int
    seq_leave: int
    step: int
    phase: str
    last_dur: float
    n_steps: int
    dur_sum: float
    busy_sum: float
    coll_sum: float
    pid: int
    pos_enter: int = 0  # position (native count) of the latest traced collective; 0 = not on a watched group
    cseq: int = 0  # collectives issued so far on the watched groups (C++ sequence numbers, summed)
    t_cseq: float = 0.0  # wall time cseq last changed
    arrivals: tuple = ()  # ((step, wall time its first collective was issued), ...), oldest first (sampled)
    stamps: tuple = ()  # ((step, left the previous sync, reached the first collective, waited for a CPU in
    # between), ...), oldest first

    @property
    def in_coll(self) -> bool:
        return bool(self.flags & IN_COLL)

    @property
    def in_side(self) -> bool:
        return bool(self.flags & IN_SIDE)

    @property
    def coll_error(self) -> bool:
        return bool(self.flags & COLL_ERROR)

    @property
    def off_watch(self) -> bool:
        return bool(self.flags & OFF_WATCH)

    @property
    def counted(self) -> bool:
        return bool(self.flags & COUNTED)

    @property
    def closed(self) -> bool:
        return bool(self.flags & CLOSED)


def default_path(run_id: str, rank: int) -> Path:
    base = (
        Path("/dev/shm")
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
        else Path(os.environ.get("TMPDIR", "/tmp"))
    )
    return base / f"scout-hb-{run_id}-r{rank}-{os.getpid()}"


class _Phase:
    """Returned by Heartbeat.phase(): the phase is already set; used as a context manager it restores the
    previous phase on exit."""

    __slots__ = ("hb", "prev")

    def __init__(self, hb: "Heartbeat", prev: str):
        self.hb, self.prev = hb, prev

    def __enter__(self):
        return self.hb

    def __exit__(self, *exc):
        if not self.hb._mm.closed:  # a phase left after the observer was stopped (the generation ending) writes nothing
            self.hb._set_phase(self.prev)


class Heartbeat:
    """Writer side. Not thread-safe by design: the thread that created it (the training thread) is the only
    writer; the tracer passes other threads' side-group collectives through without touching it."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap):
        self.path, self._fd, self._mm = path, fd, mm
        self._words = memoryview(mm).cast("Q")
        self._v = 0
        self.owner = threading.get_ident()  # the only thread that may write
        self._flags = 0
        self._seq_enter = self._fp_enter = self._seq_leave = 0
        self._step, self._phase = 0, "idle"
        self._last_dur = self._dur_sum = self._busy_sum = self._coll_sum = 0.0
        self._n_steps = 0
        self._t_enter = self._t_side = self._t_leave = 0.0
        # waiting intervals since the last step: [start, end]; end None while an async collective is in flight
        # (its completion callback, on whatever thread completes the work, fills it in: one list-item store)
        self._waits: list[list] = []
        self._last_step_t: float | None = None
        self._pos_enter = 0
        self._nv = 0  # the native area's version (its writer: the counting thread)
        self._n_arrivals = 0
        self._sv = 0  # the stamps area's version (its writer: the training thread)
        self._n_stamps = 0
        self._stamped = -1  # the newest step stamped (one stamp per step)
        # (time, native count) when this rank left the last synchronisation (set by StepStamps' hooks); None
        # once it reached the next collective (`stamp`), and before the first sync
        self.left: tuple[float, int, float] | None = None  # (time, native count, run-queue wait so far)
        self.cpu_wait = RunQueueWait()  # the training thread's wait for a CPU (observer/cpuwait.py), for the stamps
        # A synchronous traced collective between two steps' work (a logged loss gathered after the optimizer
        # step, as the HF Trainer and Lightning do every logging step): every rank leaves it together, so this
        # step's compute goes on after it. `_arrived`: (left, arrived, waited, seq) of the traced collective
        # entered, settled when it returns; `_acc`: (span, CPU wait) of the step's segments before it, added to
        # its one stamp; `count_fn`: the native count (StepStamps'), for the segment that starts at its return.
        self._arrived: tuple | None = None
        self._acc = (0.0, 0.0)
        self.count_fn = None
        _IDENT.pack_into(mm, 104, os.getpid(), MAGIC)
        self._write_all(time.time())

    @classmethod
    def create(cls, path: str | os.PathLike) -> "Heartbeat":
        path = Path(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, SIZE)
        return cls(path, fd, mmap.mmap(fd, SIZE))

    # ---- writes --------------------------------------------------------------------------------------------

    def _write_coll(self, now: float) -> None:
        v = self._v
        self._words[0] = v + 1
        _COLL.pack_into(self._mm, 8, self._flags, now, self._seq_enter, self._fp_enter, self._seq_leave)
        self._words[16] = self._pos_enter
        self._words[0] = self._v = v + 2

    def native(self, count: int, t: float, arrival_step: int | None = None) -> None:
        """The counting thread's write (observer/counts.py), the only writer of this area: the watched groups'
        native collective count, when it changed, and, at the first collective issued after a step boundary,
        that step's arrival time."""
        try:
            words = self._words
            v = self._nv
            words[NATIVE_AT // 8] = v + 1
            if arrival_step is not None:
                i = self._n_arrivals
                _ARRIVAL.pack_into(self._mm, _RING_AT + 16 * (i % ARRIVALS), arrival_step, t)
                self._n_arrivals = i + 1
            _NATIVE.pack_into(self._mm, NATIVE_AT + 8, count, t, self._n_arrivals)
            words[NATIVE_AT // 8] = self._nv = v + 2
        except (ValueError, IndexError, TypeError):  # closed meanwhile
            pass

    def stamp(self, t_left: float, t_arrived: float, waited: float = 0.0) -> None:
        """This rank reached step (its current step + 1)'s first collective at `t_arrived`, having left the
        previous step's synchronisation at `t_left`, its training thread waiting `waited` seconds for a CPU in
        between (observer/stamps.py). Training thread only; once per step."""
        self.left = None
        acc, self._acc = self._acc, (0.0, 0.0)
        t_left, waited = t_left - acc[0], waited + acc[1]  # earlier segments of this step (see `_settle`)
        step = self._step + 1
        if step == self._stamped:
            return
        self._stamped = step
        try:
            v = self._sv
            self._words[STAMPS_AT // 8] = v + 1
            i = self._n_stamps
            _STAMP.pack_into(
                self._mm, _STAMP_RING_AT + _STAMP.size * (i % STAMPS), step, t_left, t_arrived, max(0.0, waited)
            )
            self._n_stamps = i + 1
            self._words[STAMPS_AT // 8 + 1] = i + 1
            self._words[STAMPS_AT // 8] = self._sv = v + 2
        except (ValueError, IndexError, TypeError):  # closed meanwhile
            pass

    def _write_all(self, now: float) -> None:
        v = self._v
        self._words[0] = v + 1
        _COLL.pack_into(self._mm, 8, self._flags, now, self._seq_enter, self._fp_enter, self._seq_leave)
        _STEP.pack_into(
            self._mm,
            48,
            self._step,
            _PHASE_ID[self._phase],
            self._last_dur,
            float(self._n_steps),
            self._dur_sum,
            self._busy_sum,
            self._coll_sum,
        )
        self._words[16] = self._pos_enter
        self._words[0] = self._v = v + 2

    def enter(self, seq: int, fp: int, pos: int = 0) -> None:
        """The trainer enters collective number `seq` with fingerprint `fp`; `pos`: its position among the
        watched groups' native collectives (observer/counts.py), 0 off them (a save's group): then the latest
        watched position is kept and OFF_WATCH says `fp` is not its (verdicts.position_mismatch)."""
        now = time.time()
        if pos and self.left is not None and threading.get_ident() == self.owner:
            # the first traced training collective since this rank left the sync: its arrival, exactly (FSDP2's
            # first all-gather, a Python all_reduce), stamped when it returns (`_settle`)
            self._arrived = (self.left[0], now, self.cpu_wait.seconds() - self.left[2], seq)
            self.left = None
        self._t_enter = now
        self._seq_enter, self._fp_enter, self._pos_enter = seq, fp, pos or self._pos_enter
        self._flags = (self._flags | IN_COLL) & ~OFF_WATCH if pos else self._flags | IN_COLL | OFF_WATCH
        self._write_coll(now)

    def leave(self, seq: int, work=None) -> None:
        """Collective `seq` returned. `work`: the Work of an async_op call, whose completion (not this return)
        ends the rank's wait: DDP's and FSDP2's collectives are async, and the fast ranks wait for their
        completion later, inside backward or the next forward."""
        self._settle(seq, synchronous=work is None)
        box = self.leave_open(seq)
        if work is None:
            box[1] = self._t_leave
            return
        try:
            work.get_future().add_done_callback(lambda f: self._done(box, f))
        except Exception:  # a backend without futures: the wait ends when the call returns
            box[1] = self._t_leave

    def discard(self) -> None:
        """No stamp this step (StepStamps): its earlier segments are dropped, not added to the next step's."""
        self._acc = (0.0, 0.0)

    def _settle(self, seq: int, synchronous: bool) -> None:
        """Collective `seq`, whose entry was this step's arrival, returned. Async (FSDP2's, a traced DDP hook's):
        the fast ranks wait for it later, so its entry is the arrival: stamped now. Synchronous (a Python
        all_reduce or gather, completed on return): every rank leaves it together, as from the optimizer step,
        so the step's compute goes on from here and is stamped at its next arrival, the two segments added:
        without that, a collective right after the optimizer step (a logged loss) ended every step's
        measure there and a rank slow anywhere after it (its data loader, forward, backward) was never seen."""
        arrived = self._arrived
        if arrived is None or arrived[3] != seq or threading.get_ident() != self.owner:
            return
        self._arrived = None
        count = self.count_fn
        if synchronous and count is not None:
            self._acc = (self._acc[0] + arrived[1] - arrived[0], self._acc[1] + arrived[2])
            self.left = (time.time(), count(), self.cpu_wait.seconds())
        else:
            self.stamp(arrived[0], arrived[1], arrived[2])

    def leave_open(self, seq: int) -> list:
        """Collective `seq` was issued (async) and returned; the caller ends the rank's wait for it by calling
        `completed(box, failed)` from the completion callback it registers anyway (DDP's comm hook chains one
        with `then`): one Python callback per collective instead of two, which is most of what tracing an
        async collective costs."""
        self._settle(seq, synchronous=False)
        now = self._t_leave = time.time()
        box = [self._t_enter, None]
        waits = self._waits
        waits.append(box)
        if len(waits) > 4096:  # no step() calls to drain it: keep only what may still be open
            self._waits = [b for b in waits if b[1] is None][-1024:]
        self._seq_leave = seq
        self._flags &= ~IN_COLL
        self._write_coll(now)
        return box

    def completed(self, box: list, failed: bool = False) -> None:
        """The end of an async collective's wait (any thread): one list-item store; a failure marks this rank a
        victim with one aligned word store outside the seqlock (see `_done`)."""
        box[1] = time.time()
        if failed:
            try:
                self._words[ASYNC_ERROR_WORD] = 1
            except (ValueError, IndexError):  # closed meanwhile
                pass

    def _done(self, box: list, fut) -> None:
        """Completion callback of an async collective, on whichever thread completes it: one list-item store
        for the wait's end; a failed collective (a peer died) marks this rank a victim with one aligned word
        store outside the seqlock, since this thread is not the heartbeat's writer."""
        try:
            fut.value()
        except Exception:
            self.completed(box, True)
        else:
            box[1] = time.time()

    def side(self, inside: bool) -> None:
        """Enter/leave a collective on a side group: shows the rank is waiting without advancing the sequence."""
        now = time.time()
        if inside:
            self._flags |= IN_SIDE
            self._t_side = now
        else:
            self._flags &= ~IN_SIDE
            self._waits.append([self._t_side, now])  # waiting is waiting, whatever the group
        self._write_coll(now)

    def mark_counted(self) -> None:
        """The watched model is a DDP module whose all-reduces are counted, not traced (COUNTED)."""
        self._flags |= COUNTED
        self._write_coll(time.time())

    def error(self) -> None:
        """A traced collective raised: marks this rank as a victim, so its exit is not counted as a crash."""
        self._flags |= COLL_ERROR
        self._write_coll(time.time())

    def step(self, n: int, duration_s: float | None = None) -> None:
        """Step `n` is done. Its busy time (duration minus the time spent waiting for collectives to complete:
        the union of the waiting intervals, async ones up to their completion) is what the straggler rule
        compares: in synchronous training every rank's wall time per step is the same, but a straggler's
        compute between one collective and its arrival at the next is longer. (The training thread's wait for a
        CPU is not taken out here, unlike in the step stamps: part of it falls inside the collectives' waiting
        intervals, where it is out already, and which part cannot be told without a read at every collective.)"""
        now = time.time()
        if duration_s is None and self._last_step_t is not None:
            duration_s = max(0.0, now - self._last_step_t)
        if duration_s is not None:
            waited, self._waits = waited_within(self._waits, now - duration_s, now)
            self._last_dur = duration_s
            self._n_steps += 1
            self._dur_sum += duration_s
            self._coll_sum += waited
            self._busy_sum += max(0.0, duration_s - waited)
        else:
            self._waits = [b for b in self._waits if b[1] is None]
        self._last_step_t = now
        self._step = n
        if self._phase == "idle":
            self._phase = "step"
        self._write_all(now)

    def _set_phase(self, name: str) -> None:
        if name not in _PHASE_ID:
            raise ValueError(f"unknown phase {name!r}; one of {', '.join(PHASES)}")
        self._phase = name
        self._write_all(time.time())

    def phase(self, name: str) -> _Phase:
        """Set the phase now; `with hb.phase("forward"):` restores the previous phase afterwards."""
        prev = self._phase
        self._set_phase(name)
        return _Phase(self, prev)

    @property
    def seq(self) -> int:
        return self._seq_enter

    def close(self, unlink: bool = True) -> None:
        """Marks the record closed (a clean exit, not a crash) and unmaps it."""
        if self._mm.closed:
            return
        self._flags |= CLOSED
        self._phase = "idle"
        self._write_all(time.time())
        self._words.release()
        self._mm.close()
        os.close(self._fd)
        self.cpu_wait.close()
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def waited_within(waits: list[list], t0: float, t1: float) -> tuple[float, list[list]]:
    """The length of the union of the waiting intervals inside [t0, t1] (an open one counts up to t1), and the
    intervals still open (kept for the next step, where they are clipped to its start)."""
    spans = sorted((max(s, t0), min(t1, e if e is not None else t1)) for s, e in list(waits))
    total, end = 0.0, t0
    for s, e in spans:
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total, [b for b in waits if b[1] is None]


class HeartbeatReader:
    """Reader side (the observer). Keeps the file mapped so it stays readable after the trainer dies."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), SIZE, access=mmap.ACCESS_READ)
        if _IDENT.unpack_from(self._mm, 104)[1] != MAGIC:
            raise ValueError(f"{self.path}: not a scout-ckpt heartbeat")
        self._words = memoryview(self._mm).cast("Q")
        self._last: Snapshot | None = None

    def snapshot(self, retries: int = 1000) -> Snapshot:
        """The newest consistent record. A writer stopped (SIGSTOP, SIGKILL) in the middle of an update leaves
        the version odd for good: then the last consistent record this reader saw is returned."""
        native = self._native(retries)
        stamps = self._stamps(retries)
        for _ in range(retries):
            v1 = self._words[0]
            if v1 & 1:
                continue
            vals = _ALL.unpack_from(self._mm, 0)
            pos = self._words[16]
            if self._words[0] == v1 and vals[0] == v1:
                (
                    v,
                    flags,
                    t_update,
                    seq_enter,
                    fp_enter,
                    seq_leave,
                    step,
                    phase,
                    last_dur,
                    n_steps,
                    dur_sum,
                    busy_sum,
                    coll_sum,
                    pid,
                    _magic,
                ) = vals
                if self._words[ASYNC_ERROR_WORD]:
                    flags |= COLL_ERROR
                self._last = Snapshot(
                    v,
                    flags,
                    t_update,
                    seq_enter,
                    fp_enter,
                    seq_leave,
                    step,
                    PHASES[phase] if phase < len(PHASES) else "?",
                    last_dur,
                    int(n_steps),
                    dur_sum,
                    busy_sum,
                    coll_sum,
                    pid,
                    pos,
                    *native,
                    stamps,
                )
                return self._last
        if self._last is None:
            raise RuntimeError(f"{self.path}: heartbeat never consistent (writer stopped mid-update)")
        return self._last

    def _native(self, retries: int) -> tuple:
        """(cseq, t_cseq, arrivals) from the counting thread's area (its own seqlock); the last consistent
        reading if its writer stopped mid-update."""
        at = NATIVE_AT // 8
        for _ in range(retries):
            v1 = self._words[at]
            if v1 & 1:
                continue
            count, t, n = _NATIVE.unpack_from(self._mm, NATIVE_AT + 8)
            ring = [
                _ARRIVAL.unpack_from(self._mm, _RING_AT + 16 * (i % ARRIVALS)) for i in range(max(0, n - ARRIVALS), n)
            ]
            if self._words[at] == v1:
                self._last_native = (count, t, tuple(ring))
                return self._last_native
        return getattr(self, "_last_native", (0, 0.0, ()))

    def _stamps(self, retries: int) -> tuple:
        """The ring of step stamps (its own seqlock); the last consistent reading if its writer stopped."""
        at = STAMPS_AT // 8
        for _ in range(retries):
            v1 = self._words[at]
            if v1 & 1:
                continue
            n = self._words[at + 1]
            ring = tuple(
                _STAMP.unpack_from(self._mm, _STAMP_RING_AT + _STAMP.size * (i % STAMPS))
                for i in range(max(0, n - STAMPS), n)
            )
            if self._words[at] == v1:
                self._last_stamps = ring
                return ring
        return getattr(self, "_last_stamps", ())

    def close(self) -> None:
        self._words.release()
        self._mm.close()
