"""The training side's handle on the observer: `Observer.start` (every rank, after init_process_group) writes
the JSON config, starts the observer process in its own session, installs the collective tracer and the stack-dump
handler; `attach` makes a model's own collectives visible; `step`/`phase` publish progress; `stop` closes cleanly.
The config and the side channel are JSON only (a health source is named, never pickled)."""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from scout_ckpt.errors import ScoutError
from scout_ckpt.layout import REPORTS_DIR, atomic_write_json
from scout_ckpt.observer import stacks as stacks_mod
from scout_ckpt.observer.heartbeat import Heartbeat, default_path

log = logging.getLogger("scout_ckpt.observer")


def channel_dir(root: str | os.PathLike, run_id: str) -> Path:
    return Path(root) / REPORTS_DIR / ".observer" / run_id


def read_json(path: Path) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class Observer:
    """Started by every rank after init_process_group (collective in the sense that every rank must start one);
    owns the heartbeat, the stack-dump handler, the collective tracer and the observer process."""

    def __init__(self, cfg: dict, heartbeat: Heartbeat, dumper: stacks_mod.StackDumper, proc: subprocess.Popen,
                 tracer, ddp_hook=None):
        self.cfg, self.heartbeat, self._dumper, self.proc, self.tracer = cfg, heartbeat, dumper, proc, tracer
        self.channel = Path(cfg["channel"])
        self.rank = cfg["rank"]
        self._ddp_hook = ddp_hook or (None, None)  # (hook, state): None = the default, False = register none
        self.attached: str | None = None

    @classmethod
    def start(cls, root: str | os.PathLike, *, rank: int, world_size: int, run_id: str, stall_s: float = 60.0,
              action: str = "report", poll_s: float = 0.25, health_source=None, store=None,
              exchange_s: float = 0.5, trace: bool = True, ignore_groups=(), straggler: dict | None = None,
              health_poll_s: float = 10.0, linger_s: float = 4.0, ready_timeout_s: float = 60.0,
              local_rank: int | None = None, ddp_comm_hook=None, ddp_comm_state=None) -> "Observer":
        """Start this rank's observer. `health_source`: where hardware health comes from, described by name
        (the observer process builds it; nothing is pickled): "module:factory" or {"factory": "module:factory",
        "kwargs": {...JSON...}}, the factory returning an object with poll() -> list[dict] (default: NVML for
        GPU `local_rank`, quiet without one). `store`: an optional c10d Store used to check that every rank
        uses the same side-channel directory. `ignore_groups`: process groups whose collectives are not training
        collectives (the checkpointer's side groups). `ddp_comm_hook`/`ddp_comm_state`: the user's own DDP comm
        hook, registered by `attach` in place of the default (see observer/ddp.py for the rule); False registers
        none (DDP's gradient all-reduces then stay unseen)."""
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
        cfg = {"root": str(Path(root).resolve()), "rank": rank, "world_size": world_size, "run_id": run_id,
               "channel": str(channel.resolve()), "trainer_pid": os.getpid(), "heartbeat": str(hb.path),
               "stall_s": stall_s, "action": action, "poll_s": poll_s, "exchange_s": exchange_s,
               "straggler": straggler or {}, "health_poll_s": health_poll_s, "linger_s": linger_s,
               "local_rank": local_rank, "signal": int(dumper.sig),
               "health": health}
        cfg_path = channel / f"observer-{rank}.json"
        atomic_write_json(cfg_path, cfg)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        with open(channel / f"observer-{rank}.log", "ab") as errlog:
            proc = subprocess.Popen([sys.executable, "-m", "scout_ckpt.observer.daemon", str(cfg_path)],
                                    stdin=subprocess.DEVNULL, stdout=errlog, stderr=errlog, env=env,
                                    start_new_session=True, close_fds=True)
        tracer = None
        try:
            if not _wait_for(lambda: (read_json(status) or {}).get("observer_pid") == proc.pid, 30.0,
                             lambda: proc.poll() is not None):
                raise ScoutError(f"observer of rank {rank} did not start (exit code {proc.poll()}); "
                                 f"see {channel / f'observer-{rank}.log'}")
            if trace:
                from scout_ckpt.observer.fingerprints import CollectiveTracer

                tracer = CollectiveTracer.install(hb, ignore=ignore_groups)
        except BaseException:
            proc.kill()
            proc.wait()
            dumper.close()
            hb.close()
            raise
        obs = cls(cfg, hb, dumper, proc, tracer, (ddp_comm_hook, ddp_comm_state))
        _watch_uncaught()
        atexit.register(obs._at_exit)
        missing = obs.wait_peers(ready_timeout_s)
        if missing:
            log.warning("observer: no status from rank(s) %s after %.0fs in %s (is ROOT shared by every host?)",
                        missing, ready_timeout_s, channel)
        return obs

    def wait_peers(self, timeout_s: float) -> list[int]:
        """Waits until every rank's observer has published a status; returns the ranks still missing."""
        ws = self.cfg["world_size"]
        paths = [self.channel / f"status-{r}.json" for r in range(ws)]
        _wait_for(lambda: all(p.exists() for p in paths), timeout_s)
        return [r for r, p in enumerate(paths) if not p.exists()]

    def attach(self, model) -> str:
        """Make `model`'s own collectives visible (called by the Checkpointer on the model it is given): on a
        DDP module, registers the tracing comm hook (observer/ddp.py says how a user's own hook composes);
        FSDP2's collectives are seen without it. Returns what was done; "not_traced" when tracing is off."""
        hook, state = self._ddp_hook
        if self.tracer is None:
            self.attached = "not_traced"
        elif hook is False:
            self.attached = "hook_disabled"
        else:
            from scout_ckpt.observer.ddp import attach

            self.attached = attach(model, hook, state, tracer=self.tracer)
        log.info("observer of rank %d: attach -> %s", self.rank, self.attached)
        return self.attached

    @property
    def pid(self) -> int:
        return self.proc.pid

    def step(self, n: int, duration_s: float | None = None) -> None:
        self.heartbeat.step(n, duration_s)

    def phase(self, name: str):
        return self.heartbeat.phase(name)

    def _at_exit(self) -> None:
        """A normal interpreter exit without Checkpointer.close() is a clean end, not a crash; an exit through an
        uncaught exception is not (its heartbeat stays open, so the observers judge it)."""
        if not _UNCAUGHT:
            self.stop()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Clean shutdown: the closed heartbeat tells the observer (and its peers) this is no crash."""
        atexit.unregister(self._at_exit)
        if self.tracer is not None:
            self.tracer.uninstall()
            self.tracer = None
        self.heartbeat.close(unlink=True)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dumper.close()


_UNCAUGHT: list = []


def _watch_uncaught() -> None:
    """Chains sys.excepthook once, to note that the interpreter is ending through an uncaught exception."""
    if getattr(sys.excepthook, "__scout__", False):
        return
    previous = sys.excepthook

    def hook(tp, value, tb):
        _UNCAUGHT.append(tp.__name__)
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
    if not isinstance(source, dict) or set(source) - {"factory", "kwargs"} or not isinstance(
            source.get("factory"), str) or ":" not in source["factory"]:
        raise ScoutError("observer health_source must be 'module:factory' or {'factory': 'module:factory', "
                         f"'kwargs': {{...}}}} (got {type(source).__name__})")
    kwargs = source.get("kwargs", {})
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError) as e:
        raise ScoutError(f"observer health_source kwargs must be JSON ({e})") from None
    if not isinstance(kwargs, dict):
        raise ScoutError("observer health_source kwargs must be a JSON object")
    return {"factory": source["factory"], "kwargs": kwargs}


def load_factory(name: str):
    """'package.module:attr' -> the attribute (what the health spec names)."""
    module, _, attr = name.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


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
