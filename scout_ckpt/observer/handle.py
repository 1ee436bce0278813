"""The training side's handle on the observer: `Observer.start` (every rank, after init_process_group) writes
the JSON config, starts the observer process in its own session, installs the collective tracer and the stack-dump
handler; `attach` makes a model's own collectives visible; `step`/`phase` publish progress; `stop` closes cleanly.
The config and the side channel are JSON only (a health source is named, never pickled)."""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scout_ckpt.errors import ScoutError
from scout_ckpt.format.layout import atomic_write_json
from scout_ckpt.observer import stacks as stacks_mod
from scout_ckpt.observer.channel import channel_dir, final_settle_s, load_factory, read_json  # noqa: F401
from scout_ckpt.observer.heartbeat import Heartbeat, default_path

log = logging.getLogger("scout_ckpt.observer")

# The observer running in this process (one per process: it watches the process's one heartbeat and wraps the
# process's collectives). A second Checkpointer in the same process (a teacher and a student, a second ROOT for
# evaluation state) shares it instead of starting another: Observer.running().
_RUNNING: list["Observer"] = []


class Observer:
    """Started by every rank after init_process_group (collective in the sense that every rank must start one);
    owns the heartbeat, the stack-dump handler, the collective tracer and the observer process."""

    def __init__(
        self,
        cfg: dict,
        heartbeat: Heartbeat,
        dumper: stacks_mod.StackDumper,
        proc: subprocess.Popen,
        tracer,
        ddp_hook=None,
        counter=None,
    ):
        self.cfg, self.heartbeat, self._dumper, self.proc, self.tracer = cfg, heartbeat, dumper, proc, tracer
        self.counter = counter
        self.channel = Path(cfg["channel"])
        self.rank = cfg["rank"]
        # (hook, state): None/False = no hook (counted), "traced" = the observer's traced hook, else the user's
        self._ddp_hook = ddp_hook or (None, None)
        self.attached: str | None = None
        self.stamps: Any = None  # StepStamps (observer/stamps.py, imported with torch), registered by `attach`

    @classmethod
    def start(
        cls,
        root: str | os.PathLike,
        *,
        rank: int,
        world_size: int,
        run_id: str,
        stall_s: float = 60.0,
        action: str = "report",
        poll_s: float = 0.25,
        health_source=None,
        store=None,
        exchange_s: float = 0.5,
        trace: bool = True,
        ignore_groups=(),
        straggler: dict | None = None,
        health_poll_s: float = 10.0,
        linger_s: float = 4.0,
        ready_timeout_s: float = 60.0,
        local_rank: int | None = None,
        ddp_comm_hook=None,
        ddp_comm_state=None,
        count_hz: float = 25.0,
    ) -> "Observer":
        """Start this rank's observer. `health_source`: where hardware health comes from, described by name
        (the observer process builds it; nothing is pickled): "module:factory" or {"factory": "module:factory",
        "kwargs": {...JSON...}}, the factory returning an object with poll() -> list[dict] (default: NVML for
        GPU `local_rank`, quiet without one). `store`: an optional c10d Store used to check that every rank
        uses the same side-channel directory. `ignore_groups`: process groups whose collectives are not training
        collectives (the checkpointer's side groups). `ddp_comm_hook`: None (the default) registers no DDP comm
        hook: DDP's all-reduces are counted natively (observer/counts.py); "traced" registers the observer's
        traced hook (every bucket fingerprinted, at a cost per step, see observer/ddp.py); a callable is the
        user's own hook (with `ddp_comm_state`), registered by `attach`. `count_hz`: how often the watched
        groups' native collective counts are sampled (0: only at step boundaries)."""
        if action not in ("report", "abort"):
            raise ScoutError(f"observer action must be report or abort (got {action!r})")
        health = health_spec(health_source)
        channel = channel_dir(root, run_id)
        channel.mkdir(parents=True, exist_ok=True)
        if store is not None:
            _check_same_channel(store, run_id, rank, world_size, channel, ready_timeout_s)
        status = channel / f"status-{rank}.json"
        status.unlink(missing_ok=True)
        hb = Heartbeat.create(default_path(run_id, rank))
        dumper = stacks_mod.StackDumper(channel / f"stacks-{rank}.log")
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
        from scout_ckpt.observer.hierarchy import job_config

        cfg = {
            "hier": job_config(rank, world_size, run_id, ready_timeout_s),
            "root": str(Path(root).resolve()),
            "rank": rank,
            "world_size": world_size,
            "run_id": run_id,
            "channel": str(channel.resolve()),
            "trainer_pid": os.getpid(),
            "heartbeat": str(hb.path),
            "stall_s": stall_s,
            "action": action,
            "poll_s": poll_s,
            "exchange_s": exchange_s,
            "straggler": straggler or {},
            "health_poll_s": health_poll_s,
            "linger_s": linger_s,
            "local_rank": local_rank,
            "signal": int(dumper.sig),
            "health": health,
        }
        cfg_path = channel / f"observer-{rank}.json"
        atomic_write_json(cfg_path, cfg)
        proc = _spawn(cfg_path, channel / f"observer-{rank}.log", site=health is not None)
        tracer = counter = None
        try:  # the hooks are installed while the observer process starts, then its first status is awaited
            if trace:
                from scout_ckpt.observer.fingerprints import CollectiveTracer

                tracer = CollectiveTracer.install(hb, ignore=ignore_groups)
            counter = _start_counter(hb, ignore_groups, count_hz)
            if tracer is not None:
                tracer.counter = counter
            if not _wait_for(
                lambda: (read_json(status) or {}).get("observer_pid") == proc.pid, 30.0, lambda: proc.poll() is not None
            ):
                raise ScoutError(
                    f"observer of rank {rank} did not start (exit code {proc.poll()}); "
                    f"see {channel / f'observer-{rank}.log'}"
                )
        except BaseException:
            if counter is not None:
                counter.stop()
            if tracer is not None:
                tracer.uninstall()
            proc.kill()
            proc.wait()
            dumper.close()
            hb.close()
            raise
        obs = cls(cfg, hb, dumper, proc, tracer, (ddp_comm_hook, ddp_comm_state), counter)
        _RUNNING.append(obs)
        _watch_uncaught(obs._on_uncaught)
        atexit.register(obs._at_exit)
        missing = obs.wait_peers(ready_timeout_s)
        if missing:
            log.warning(
                "observer: no status from rank(s) %s after %.0fs in %s (is ROOT shared by every host?)",
                missing,
                ready_timeout_s,
                channel,
            )
        return obs

    def wait_peers(self, timeout_s: float) -> list[int]:
        """Waits until every rank's observer has published a status; returns the ranks still missing."""
        ws = self.cfg["world_size"]
        paths = [self.channel / f"status-{r}.json" for r in range(ws)]
        _wait_for(lambda: all(p.exists() for p in paths), timeout_s)
        return [r for r, p in enumerate(paths) if not p.exists()]

    def attach(self, model, optimizer=None) -> str:
        """Make `model`'s own collectives visible (called by the Checkpointer, on every rank, on the model and
        optimizer it is given): its process groups (DDP's, FSDP2's meshes') are counted natively
        (observer/counts.py); with `ddp_comm_hook` "traced" or a callable, a DDP module also gets that comm hook
        (observer/ddp.py). The model's forward and the optimizer's step get the step-stamp hooks
        (observer/stamps.py: when this rank left each step's synchronisation and reached the next collective,
        what the straggler rule compares); they are removed by `stop`.
        Returns what was done: "counted" (DDP, no hook), "fsdp2", "not_ddp", "registered", "user_hook",
        "builtin_hook", or "not_traced" when tracing is off and a hook was asked for."""
        hook, state = self._ddp_hook
        if self.counter is not None:
            from scout_ckpt.observer.counts import model_groups

            self.counter.watch(*model_groups(model))
            if self.stamps is None:
                from scout_ckpt.observer.stamps import StepStamps

                self.stamps = StepStamps(self.heartbeat, self.counter, model, optimizer)
        if hook in (None, False):
            from scout_ckpt.observer.ddp import kind_of

            self.attached = kind_of(model)
            if self.attached == "counted" and self.stamps is not None:
                self.heartbeat.mark_counted()  # the judge measures its stragglers by the stamps (stragglers.py)
        elif self.tracer is None:
            self.attached = "not_traced"
        else:
            from scout_ckpt.observer.ddp import attach

            self.attached = attach(model, None if hook == "traced" else hook, state, tracer=self.tracer)
        log.info("observer of rank %d: attach -> %s", self.rank, self.attached)
        return self.attached

    def _on_uncaught(self, exc) -> None:
        """The trainer is dying of an uncaught exception: publish its last native count (the sampler may not
        get another turn), and if the exception is a collective's failure (a peer died or mismatched), mark
        this rank a victim, as a traced collective's failure does; a DDP all-reduce fails inside backward,
        where no tracer sees it."""
        try:
            if self.counter is not None:
                self.counter.sample()
            if _collective_failure(exc):
                self.heartbeat.error()
        except Exception:
            pass

    @property
    def pid(self) -> int:
        return self.proc.pid

    def step(self, n: int, duration_s: float | None = None) -> None:
        self.heartbeat.step(n, duration_s)
        if self.counter is not None:
            self.counter.boundary(n)
        if self.stamps is not None and self.stamps.on_boundary:
            self.stamps.leave()

    def phase(self, name: str):
        return self.heartbeat.phase(name)

    def _at_exit(self) -> None:
        """A normal interpreter exit without Checkpointer.close() is a clean end, not a crash; an exit through an
        uncaught exception is not (its heartbeat stays open, so the observers judge it). A forked child that
        exits through the interpreter (os.fork, then sys.exit) inherited this handler: it must not close the
        trainer's heartbeat nor stop the trainer's observer."""
        if os.getpid() != self.cfg["trainer_pid"]:
            return
        if not _UNCAUGHT:
            self.stop()

    @classmethod
    def running(cls) -> "Observer | None":
        """The observer this process already runs (started by another Checkpointer), or None."""
        return _RUNNING[-1] if _RUNNING else None

    def ignore(self, *groups) -> None:
        """More process groups whose collectives are not training collectives (a second Checkpointer's side
        groups, when it shares this observer)."""
        if self.tracer is not None:
            self.tracer.ignore(*groups)
        if self.counter is not None:
            self.counter.ignore(*groups)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Clean shutdown: the closed heartbeat tells the observer (and its peers) this is no crash."""
        if self in _RUNNING:
            _RUNNING.remove(self)
        atexit.unregister(self._at_exit)
        _UNCAUGHT_CALLBACKS[:] = [cb for cb in _UNCAUGHT_CALLBACKS if cb != self._on_uncaught]
        if self.stamps is not None:
            self.stamps.remove()
            self.stamps = None
        if self.counter is not None:
            self.counter.stop()
            self.counter = None
        if self.tracer is not None:
            self.tracer.uninstall()
            self.tracer = None
        self.heartbeat.close(unlink=True)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            if self.cfg["rank"] == 0:  # it may stay to settle earlier runs (daemon._settle_before_exit)
                timeout_s = max(timeout_s, final_settle_s(self.cfg) + 2.0)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dumper.close()


def _spawn(cfg_path: Path, log_path: Path, site: bool) -> subprocess.Popen:
    """The observer process, in a session of its own (torchrun's kill of the worker group must not reach it).
    Its import path is the trainer's own (so it runs the same scout_ckpt), with this package's parent first:
    then `-S` can skip site's start-up (the .pth files an environment accumulates cost a tenth of a second and
    more on a loaded host). A named health source may live in a package only site's .pth files make
    importable: then site runs as usual."""
    import scout_ckpt

    here = str(Path(scout_ckpt.__file__).resolve().parent.parent)
    path = [here] + [p for p in sys.path if p and p != here]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    argv = [sys.executable, *(() if site else ("-S",)), "-m", "scout_ckpt.observer.daemon", str(cfg_path)]
    with open(log_path, "ab") as errlog:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=errlog,
            stderr=errlog,
            env=env,
            start_new_session=True,
            close_fds=True,
        )


_UNCAUGHT: list = []
_UNCAUGHT_CALLBACKS: list = []


def _start_counter(hb, ignore_groups, hz: float):
    """The native collective counter on WORLD (the model's groups are added by `attach`); None without a
    default group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    from scout_ckpt.observer.counts import CollectiveCounter

    return CollectiveCounter(hb, [dist.group.WORLD], hz=hz, ignore=ignore_groups).start()


_FAILURE_WORDS = (
    "gloo",
    "nccl",
    "connection closed by peer",
    "connection reset by peer",
    "process group",
    "timed out",
    "watchdog",
)


def _collective_failure(exc) -> bool:
    """A collective failed under this rank (torch's DistError family, or the runtime errors gloo and NCCL
    raise), as opposed to a bug of its own."""
    try:
        import torch.distributed as dist

        if isinstance(exc, getattr(dist, "DistError", ())):
            return True
    except ImportError:
        return False
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _FAILURE_WORDS)


def _watch_uncaught(callback=None) -> None:
    """Chains sys.excepthook once, to note that the interpreter is ending through an uncaught exception (and to
    let each observer publish its last words)."""
    if callback is not None:
        _UNCAUGHT_CALLBACKS.append(callback)
    if getattr(sys.excepthook, "__scout__", False):
        return
    previous = sys.excepthook

    def hook(tp, value, tb):
        _UNCAUGHT.append(tp.__name__)
        for cb in list(_UNCAUGHT_CALLBACKS):
            cb(value)
        previous(tp, value, tb)

    hook.__scout__ = True
    sys.excepthook = hook


def health_spec(source) -> dict | None:
    """The JSON description of a health source: {"factory": "module:callable", "kwargs": {...}}. The observer
    process imports the factory by name and calls it; an object is refused (the side channel and the config are
    JSON only: a pickle read back from a shared directory would run whatever code it names)."""
    if source is None:
        return None
    if isinstance(source, str):
        source = {"factory": source}
    if (
        not isinstance(source, dict)
        or set(source) - {"factory", "kwargs"}
        or not isinstance(source.get("factory"), str)
        or ":" not in source["factory"]
    ):
        raise ScoutError(
            "observer health_source must be 'module:factory' or {'factory': 'module:factory', "
            f"'kwargs': {{...}}}} (got {type(source).__name__})"
        )
    kwargs = source.get("kwargs", {})
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError) as e:
        raise ScoutError(f"observer health_source kwargs must be JSON ({e})") from None
    if not isinstance(kwargs, dict):
        raise ScoutError("observer health_source kwargs must be a JSON object")
    return {"factory": source["factory"], "kwargs": kwargs}


def _wait_for(cond, timeout_s: float, abort=lambda: False, every: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if abort() or time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def _check_same_channel(store, run_id: str, rank: int, world_size: int, channel: Path, timeout_s: float) -> None:
    import datetime

    keys = [f"scout-observer/{run_id}/{r}" for r in range(world_size)]
    store.set(keys[rank], str(channel.resolve()))
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    dirs = {store.get(k).decode() for k in keys}
    if len(dirs) > 1:
        raise ScoutError(f"observer side channel differs between ranks: {sorted(dirs)} (ROOT must be shared)")
