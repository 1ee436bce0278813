"""The Checkpointer's grouped options: frozen dataclasses, a docstring per field, checks in `__post_init__`.

Why dataclasses: a misspelled key or a bad value fails at construction, on every rank alike, with one line naming
the field (`BadOption`), instead of deep inside a component (a TypeError in the observer's start, a bad replay
interval at the first step).

One spelling per group at the Checkpointer: the dataclass tunes it, a bool switches it (`replay=False`); True is
the default and means the dataclass's defaults wherever the job can use them. A dict is refused there with one
line naming the dataclass: a dict comes only from a config file (Lightning's YAML, a TorchTitan config, a JSON
flag), and the code that reads the file converts it, with `XOptions.from_dict` (unknown keys refused in one line)
or `from_config` for a whole table of Checkpointer options.

`as_replay`/`as_observer`/`as_shard_evidence`/`as_local`/`as_fleet` give the components their internal form (None:
the defaults where they apply), from what `check_group` has let through.

No torch and nothing above `errors` is imported here: every wing may read these.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from scout_ckpt.errors import BadOption

# Replay (one rotation target every this many steps between saves: earlier detection; the sweep at each save is
# what certifies, so this interval never delays a certificate) and the optimizer window it replays.
DEFAULT_REPLAY_INTERVAL = 10
DEFAULT_OPT_ELEMS = 1 << 16  # elements per round, over all tensors (256 KiB of fp32 per replayed quantity)


def _positive(
    owner: str, name: str, value, *, integer: bool = False, allow_zero: bool = False, allow_none: bool = False
) -> None:
    if value is None and allow_none:
        return
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or (not integer and not math.isfinite(value)):
        raise BadOption(f"{owner}.{name} must be {'an integer' if integer else 'a number'} (got {value!r})")
    if value < 0 or (value == 0 and not allow_zero):
        raise BadOption(f"{owner}.{name} must be {'>= 0' if allow_zero else '> 0'} (got {value!r})")


def _choice(owner: str, name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise BadOption(f"{owner}.{name} must be one of {', '.join(map(repr, choices))} (got {value!r})")


class _FromDict:
    """`from_dict`, shared by the option dataclasses: the one place a dict (a config file's table) becomes options."""

    OWNER: ClassVar[str] = ""
    NESTED: ClassVar[dict[str, type]] = {}

    @classmethod
    def from_dict(cls, values: Mapping):
        """The options a config file's table gives (YAML, JSON, TOML): the same keys as the fields; an unknown key
        or a value of the wrong shape fails with one line naming it (BadOption). A nested group's table becomes its
        own dataclass (ObserverOptions' `straggler`).

        Args:
            values: {field name: value}.
        """
        if not isinstance(values, Mapping):
            raise BadOption(f"{cls.OWNER} must be a table of options (got {type(values).__name__})")
        fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(values) - fields)
        if unknown:
            raise BadOption(f"{cls.OWNER}: unknown option {unknown[0]!r} (known: {', '.join(sorted(fields))})")
        kwargs = dict(values)
        for key, sub in cls.NESTED.items():
            if isinstance(kwargs.get(key), Mapping):
                kwargs[key] = sub.from_dict(kwargs[key])  # type: ignore[attr-defined]
        return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class ReplayOptions(_FromDict):
    """SDC replay of the model's blocks (and the optimizer's elementwise update) across ranks (replay/)."""

    OWNER: ClassVar[str] = "replay"

    interval: int | None = None
    """One rotation target is replayed every `interval` steps between saves; every target is swept at a save.
    None (auto): every DEFAULT_REPLAY_INTERVAL steps until the save period P is known, then every
    max(DEFAULT_REPLAY_INTERVAL, P // 2) steps (the sweep certifies; the rotation is an early warning, kept to about one round per interval)."""
    targets: tuple[str, ...] | None = None
    """Which targets to replay (module names, or "optimizer"); None: every replayable block, embedding and head."""
    deterministic: bool = True
    """Run replays with deterministic kernels, so that healthy replicas agree bit for bit."""
    peers: str = "auto"
    """Who replays: "auto" (the replica group with 3+ members, else the world), "replicas" or "world"."""
    opt_elems: int = DEFAULT_OPT_ELEMS
    """Optimizer elements replayed per round, over all tensors."""
    save_every: int | None = None
    """The save cadence, when the script knows it (the sweep is prepared for those steps); None: learnt."""
    straggler_rounds: int = 3
    """Rounds a replay-timing straggler must be confirmed over before it is reported."""
    live_check: bool = True
    """Compare the replays with the output the source rank's live step produced (a fault of the live step only);
    costs the sweep's source one copy of the targets' parameters per save, sent to the peers."""
    self_check: bool = True
    """Every rank replays its own capture of the save step and compares it with its own live outputs and gradients
    (a fault of any rank's live step, caught at that save; needs live_check); costs every rank a copy of the
    targets' parameters at the save step and one more replay per target per save. False: only the rotating
    source's live step is checked at each save."""
    sweep: str = "ring"
    """How a save's sweep checks the module targets. "ring" (with live_check and self_check on): every rank's
    capture is replayed by its successor and compared with the live step it came from, one replay per target per
    rank (replay/ring.py). "broadcast": every peer replays the rotating source's capture (compared with each
    other) and then its own (the self-check): two replays per target on most ranks."""

    def __post_init__(self):
        _positive("replay", "interval", self.interval, integer=True, allow_none=True)
        if self.targets is not None:
            if isinstance(self.targets, str) or not all(isinstance(t, str) for t in self.targets):
                raise BadOption(f"replay.targets must be a list of names (got {self.targets!r})")
            object.__setattr__(self, "targets", tuple(self.targets))
        if not isinstance(self.deterministic, bool):
            raise BadOption(f"replay.deterministic must be True or False (got {self.deterministic!r})")
        _choice("replay", "peers", self.peers, ("auto", "replicas", "world"))
        _positive("replay", "opt_elems", self.opt_elems, integer=True)
        _positive("replay", "save_every", self.save_every, integer=True, allow_none=True)
        _positive("replay", "straggler_rounds", self.straggler_rounds, integer=True)
        if not isinstance(self.live_check, bool):
            raise BadOption(f"replay.live_check must be True or False (got {self.live_check!r})")
        if not isinstance(self.self_check, bool):
            raise BadOption(f"replay.self_check must be True or False (got {self.self_check!r})")
        _choice("replay", "sweep", self.sweep, ("ring", "broadcast"))

    def runner_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of replay.ReplayRunner."""
        out = dataclasses.asdict(self)
        out["targets"] = list(self.targets) if self.targets is not None else None
        return out


@dataclasses.dataclass(frozen=True)
class StragglerRule(_FromDict):
    """When a rank is a straggler: its time per step against the others' median, by k x 1.4826 x MAD with
    absolute and relative floors, over windows, confirmed over rounds (observer/stragglers.py)."""

    OWNER: ClassVar[str] = "observer.straggler"

    window_s: float = 1.0
    """Length of one comparison window, seconds."""
    min_steps: int = 3
    """Steps a window needs before it is judged."""
    rounds: int = 3
    """Consecutive windows that must name the same rank before it is reported."""
    k: float = 3.0
    """How many scaled MADs above the median a rank's time must be."""
    abs_floor_s: float = 0.01
    """The excess must also be at least this many seconds per step (with 2 ranks: over the faster rank)."""
    rel_floor: float = 0.5
    """... and at least this fraction of the median (with 2 ranks: of the faster rank's time)."""

    def __post_init__(self):
        _positive("observer.straggler", "window_s", self.window_s)
        _positive("observer.straggler", "min_steps", self.min_steps, integer=True)
        _positive("observer.straggler", "rounds", self.rounds, integer=True)
        _positive("observer.straggler", "k", self.k)
        _positive("observer.straggler", "abs_floor_s", self.abs_floor_s, allow_zero=True)
        _positive("observer.straggler", "rel_floor", self.rel_floor, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class ObserverOptions(_FromDict):
    """The out-of-band observer: one process per rank that reports hangs, stragglers, crashes, desyncs and
    hardware health to the ledger (observer/). On by default (`observer=True`), at every world size: a 1-rank
    job has no peer to compare for hangs and stragglers, but its crash is still recorded. `observer=False` is
    the opt-out."""

    OWNER: ClassVar[str] = "observer"
    NESTED: ClassVar[dict[str, type]] = {"straggler": StragglerRule}

    stall_s: float = 60.0
    """A rank whose progress stopped this long is a hang candidate."""
    action: str = "report"
    """On a confirmed hang: "report" (events, stacks) or "abort" (also end the generation so torchrun restarts)."""
    poll_s: float = 0.25
    """How often each observer reads its rank's progress."""
    exchange_s: float = 0.5
    """How often the observers exchange what they saw over their own side channel."""
    trace: bool = True
    """Trace the training process groups' collectives (sequence numbers and fingerprints)."""
    straggler: StragglerRule = dataclasses.field(default_factory=StragglerRule)
    """The straggler rule."""
    health_source: Any = None
    """Where hardware health comes from: None (NVML for the rank's GPU, quiet without one), "module:factory", or
    {"factory": "module:factory", "kwargs": {...}}."""
    health_poll_s: float = 10.0
    """How often hardware health is polled."""
    linger_s: float = 4.0
    """How long an observer outlives its rank to record how it ended."""
    ready_timeout_s: float = 60.0
    """How long start-up waits for every rank's observer to be ready."""
    local_rank: int | None = None
    """The GPU whose health this rank's observer watches; None: LOCAL_RANK."""
    ddp_comm_hook: Any = None
    """None: DDP's all-reduces are counted natively; "traced": the observer's traced hook; a callable: the user's
    own hook, registered by the observer (with `ddp_comm_state`)."""
    ddp_comm_state: Any = None
    """The state passed to a user's `ddp_comm_hook`."""
    count_hz: float = 25.0
    """How often the watched groups' native collective counts are sampled (0: only at step boundaries)."""
    store: Any = None
    """An optional c10d Store used to check that every rank uses the same side-channel directory."""

    def __post_init__(self):
        _positive("observer", "stall_s", self.stall_s)
        _choice("observer", "action", self.action, ("report", "abort"))
        _positive("observer", "poll_s", self.poll_s)
        _positive("observer", "exchange_s", self.exchange_s)
        if not isinstance(self.trace, bool):
            raise BadOption(f"observer.trace must be True or False (got {self.trace!r})")
        if not isinstance(self.straggler, StragglerRule):
            raise BadOption(
                f"observer.straggler must be a StragglerRule (got {type(self.straggler).__name__}; "
                "ObserverOptions.from_dict converts a config file's table)"
            )
        _positive("observer", "health_poll_s", self.health_poll_s)
        _positive("observer", "linger_s", self.linger_s, allow_zero=True)
        _positive("observer", "ready_timeout_s", self.ready_timeout_s)
        _positive("observer", "local_rank", self.local_rank, integer=True, allow_zero=True, allow_none=True)
        if not (self.ddp_comm_hook in (None, "traced") or callable(self.ddp_comm_hook)):
            raise BadOption(f"observer.ddp_comm_hook must be None, 'traced' or a callable (got {self.ddp_comm_hook!r})")
        _positive("observer", "count_hz", self.count_hz, allow_zero=True)

    def start_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of observer.Observer.start (the straggler rule as the dict it takes)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["straggler"] = dataclasses.asdict(self.straggler)
        return out


@dataclasses.dataclass(frozen=True)
class ShardEvidenceOptions(_FromDict):
    """Evidence for single-owner shards (FSDP2, HSDP): cross-rank replay of each shard's optimizer update and the
    at-rest check between the optimizer step and the save (save/evidence/shard.py)."""

    OWNER: ClassVar[str] = "shard_evidence"

    at_rest_every: int | None = None
    """Sign the shards after every `at_rest_every`-th optimizer step; None: learn the save cadence and sign the
    steps that precede a save."""
    chunk: int = 4096
    """Elements per unit of the update replay."""
    per_step: int = 4
    """Units each rank checks per step."""
    cycle: int | None = None
    """If given, every unit is checked within `cycle` steps (per_step is raised; the cost grows as model/cycle)."""
    peers: int = 2
    """Verifiers per owner besides itself (2 attributes persistent faults on 3+ ranks)."""
    seed: int = 0
    """The unit permutation's seed (the same on every rank)."""
    start_step: int = 0
    """The step the schedule counts from."""
    background: bool = True
    """Run the cross-checks on a background thread."""

    def __post_init__(self):
        _positive("shard_evidence", "at_rest_every", self.at_rest_every, integer=True, allow_none=True)
        _positive("shard_evidence", "chunk", self.chunk, integer=True)
        _positive("shard_evidence", "per_step", self.per_step, integer=True)
        _positive("shard_evidence", "cycle", self.cycle, integer=True, allow_none=True)
        _positive("shard_evidence", "peers", self.peers, integer=True)
        _positive("shard_evidence", "seed", self.seed, integer=True, allow_zero=True)
        _positive("shard_evidence", "start_step", self.start_step, integer=True, allow_zero=True)
        if not isinstance(self.background, bool):
            raise BadOption(f"shard_evidence.background must be True or False (got {self.background!r})")

    def replay_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of replay.shard_optimizer.ShardUpdateReplay (all but at_rest_every)."""
        out = dataclasses.asdict(self)
        out.pop("at_rest_every")
        return out


@dataclasses.dataclass(frozen=True)
class StorageOptions:
    """Where the checkpoints and the ledger live (docs/storage.md)."""

    ledger_dir: str | None = None
    """For an object-store ROOT (`s3://bucket/prefix`): the local or shared POSIX directory of the ledger."""
    storage_options: Mapping[str, Any] | None = None
    """fsspec options for an object-store ROOT (s3fs: {"client_kwargs": {"endpoint_url": ...}})."""
    ledger_journal: str | None = None
    """The ledger's SQLite journal mode: "auto" (WAL on a local disk, the rollback journal on a network or FUSE
    filesystem), "wal" or "delete"; None: SCOUT_CKPT_LEDGER_JOURNAL, else auto."""

    def __post_init__(self):
        if self.ledger_dir is not None:
            object.__setattr__(self, "ledger_dir", str(self.ledger_dir))
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise BadOption(f"storage.storage_options must be a dict (got {type(self.storage_options).__name__})")
        if self.ledger_journal is not None:
            journal = self.ledger_journal.lower() if isinstance(self.ledger_journal, str) else self.ledger_journal
            _choice("storage", "ledger_journal", journal, ("auto", "wal", "delete"))
            object.__setattr__(self, "ledger_journal", journal)


@dataclasses.dataclass(frozen=True)
class LocalTierOptions(_FromDict):
    """The fast tier (save/local_tier.py): frequent saves of each rank's own state to node-local storage, each
    copied to the same local rank on the next node(s) and certified with the same evidence as a durable save.

    Cadence: `ckpt.step(step, state)` saves to this tier when `step % every == 0`. The per-step hook is the
    place because every training loop already calls it after each optimizer step with the step number the
    state has reached; a script that forgets the tier's own `if` cannot save at the wrong step, and one that
    passes no state to step() gets one WARNING instead of silently no fast tier. A durable `save(step)` at a
    step the local tier also saved keeps both (separate ledger table and directory); at load the durable one
    wins."""

    OWNER: ClassVar[str] = "local"

    dir: str = ""
    """Node-local directory (e.g. /dev/shm/ckpt or a local NVMe path; the same string on every node, its own
    storage on each). Steps go to DIR/RUN_ID/step-NNNNNNNN/rank-R.pt, peer copies beside them."""
    every: int = 0
    """Save to the local tier every `every` steps (step % every == 0)."""
    keep: int = 2
    """Certified local steps kept; a rejected one is removed at the next local commit."""
    replicas: int = 1
    """Peer copies of each rank's file, on the next `replicas` nodes of the ring (capped at nodes - 1; 0: none,
    and losing a node loses its steps)."""

    def __post_init__(self):
        if not isinstance(self.dir, str) or not self.dir:
            if hasattr(self.dir, "__fspath__"):
                object.__setattr__(self, "dir", str(self.dir))
            else:
                raise BadOption(f"local.dir must be a non-empty path (got {self.dir!r})")
        _positive("local", "every", self.every, integer=True)
        _positive("local", "keep", self.keep, integer=True)
        _positive("local", "replicas", self.replicas, integer=True, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class FleetOptions(_FromDict):
    """The fleet record (docs/fleet.md): attributed verdicts, with the hardware they name, appended to a store
    shared by jobs, from a background thread of the coordinator."""

    OWNER: ClassVar[str] = "fleet"

    path: str = ""
    """The fleet store: an SQLite file on a filesystem every job can reach (created when missing; its directory
    must exist)."""
    interval_s: float = 2.0
    """Seconds between the recorder's rounds (a save's verdict is copied at once)."""
    on_suspect: str = "warn"
    """At start-up, a rank whose device is a persistent suspect in the store: "warn" (an ERROR line naming the
    evidence) or "exit" (the same line, then the process exits with EXIT_SUSPECT_DEVICE, which a launcher maps
    to "replace this node")."""

    def __post_init__(self):
        if hasattr(self.path, "__fspath__"):
            object.__setattr__(self, "path", str(self.path))
        if not isinstance(self.path, str) or not self.path:
            raise BadOption(f"fleet.path must be a non-empty path (got {self.path!r})")
        _positive("fleet", "interval_s", self.interval_s)
        _choice("fleet", "on_suspect", self.on_suspect, ("warn", "exit"))


# The exit code of a rank that refuses to train on a persistent suspect device (fleet.on_suspect="exit"): not
# 0, 1, 2 (the CLI's), 130 (interrupted) or a signal's 128+N; a launcher or scheduler maps it to "replace this node".
EXIT_SUSPECT_DEVICE = 87
FLEET_ENV = "SCOUT_CKPT_FLEET"


# ---- the Checkpointer's spelling, and the components' internal form --------------------------------------------

# The groups of Checkpointer keyword options, their dataclasses, and their default (True: on by the dataclass's
# defaults wherever the job can use them; the fast tier has no default directory, so it is off by default).
GROUPS: dict[str, type] = {
    "replay": ReplayOptions,
    "observer": ObserverOptions,
    "shard_evidence": ShardEvidenceOptions,
    "local": LocalTierOptions,
    "fleet": FleetOptions,
}


def check_group(name: str, value) -> None:
    """The Checkpointer's one spelling of a grouped option: True, False or the group's dataclass (`fleet` also a
    path, `local` only False or options: the fast tier needs a directory). Anything else (a dict, None, a string)
    fails with one line naming the dataclass to use, and `from_dict` for a config file's table."""
    cls = GROUPS[name]
    if isinstance(value, cls) or value is False:
        return
    if value is True and name != "local":
        return
    if name == "fleet" and (isinstance(value, str) or hasattr(value, "__fspath__")):
        return
    if value is True:
        raise BadOption("local=True names no directory: pass LocalTierOptions(dir=..., every=...), or False (off)")
    got = "a dict" if isinstance(value, Mapping) else repr(value) if value is None else type(value).__name__
    forms = "True, False, a path" if name == "fleet" else "True, False" if name != "local" else "False"
    hint = f"; {cls.__name__}.from_dict converts a config file's table" if isinstance(value, Mapping) else ""
    article = "an" if cls.__name__[0] in "AEIOU" else "a"
    raise BadOption(f"{name} must be {forms} or {article} {cls.__name__} (got {got}{hint})")


def from_config(values: Mapping[str, Any]) -> dict[str, Any]:
    """Checkpointer keyword options as a config file holds them (Lightning's YAML `checkpointer:` table, a JSON
    flag): each group's table becomes its dataclass (`from_dict`); every other value is passed on as it is, for
    the Checkpointer to check.

    Args:
        values: {Checkpointer keyword: value}.
    """
    if not isinstance(values, Mapping):
        raise BadOption(f"Checkpointer options must be a table (got {type(values).__name__})")
    return {
        k: GROUPS[k].from_dict(v) if k in GROUPS and isinstance(v, Mapping) else v  # type: ignore[attr-defined]
        for k, v in values.items()
    }


def _internal(name: str, cls, value):
    """None stays None (the component's default decides) and so does True (the defaults where they apply: what
    the Checkpointer's default True means); False is off; an instance is an explicit request."""
    if value is True:
        return None
    if value is None or value is False or isinstance(value, cls):
        return value
    check_group(name, value)  # raises: one line naming the dataclass
    raise AssertionError("unreachable")


def as_replay(value) -> ReplayOptions | bool | None:
    """The replay a component starts: None (on wherever the job can replay: 2+ ranks, something to replay; else
    one WARNING), False (off), ReplayOptions (asked for: a model with nothing to replay is refused). True means
    None."""
    return _internal("replay", ReplayOptions, value)


def as_observer(value) -> ObserverOptions | bool:
    """`observer=`: True or None (on, the defaults), False (off), ObserverOptions."""
    if value is None or value is True:
        return ObserverOptions()
    return _internal("observer", ObserverOptions, value)


def as_shard_evidence(value) -> ShardEvidenceOptions | bool | None:
    """The shard evidence a component starts: None (on for sharded layouts with a supported optimizer, else one
    WARNING), False (off), ShardEvidenceOptions (asked for, whatever the layout; an unsupported optimizer is
    refused). True means None."""
    return _internal("shard_evidence", ShardEvidenceOptions, value)


def as_local(value) -> LocalTierOptions | None:
    """`local=`: False (no fast tier) or LocalTierOptions."""
    if value is False or value is None:
        return None
    check_group("local", value)
    return value


def as_fleet(value, environ: Mapping[str, str] | None = None) -> FleetOptions | None:
    """`fleet=`: True (the store SCOUT_CKPT_FLEET names, else none), False (none, whatever the environment), a path
    (that store, the other fields default), FleetOptions."""
    import os

    if value is True or value is None:
        env = (os.environ if environ is None else environ).get(FLEET_ENV)
        return FleetOptions(path=env) if env else None
    check_group("fleet", value)
    if value is False:
        return None
    if isinstance(value, FleetOptions):
        return value
    return FleetOptions(path=str(value))


def as_storage(*, ledger_dir=None, storage_options=None, ledger_journal=None) -> StorageOptions:
    """The Checkpointer's storage keywords `ledger_dir=`, `storage_options=`, `ledger_journal=` (their one
    spelling), checked together."""
    flat = {
        k: v
        for k, v in (
            ("ledger_dir", ledger_dir),
            ("storage_options", storage_options),
            ("ledger_journal", ledger_journal),
        )
        if v is not None
    }
    return StorageOptions(**flat)


def check_scalars(*, keep, timeout_s, on_live_fault: str, consensus_exclude) -> None:
    """The Checkpointer's plain keyword options, checked like the grouped ones: BadOption naming the field."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise BadOption(f"keep must be an integer of at least 1 (got {keep!r})")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise BadOption(f"timeout_s must be a number > 0 (got {timeout_s!r})")
    if on_live_fault not in ("raise", "continue"):
        raise BadOption(f"on_live_fault must be 'raise' or 'continue' (got {on_live_fault!r})")
    if isinstance(consensus_exclude, str):
        raise BadOption(f"consensus_exclude must be a list of patterns, not one string ({consensus_exclude!r})")
