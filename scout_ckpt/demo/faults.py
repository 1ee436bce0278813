"""`--inject` specs (docs/operations.md, "The demo": `KIND:key=value:...`) and the mechanics of each fault.

Parsing has no torch import: the CLI validates specs before it starts anything. The mechanics run inside the
workers (crash, sdc, hang, slow, param, drift, and bitflip, which rank 0 applies on disk right after the
step is committed, so a restart or the final certification must catch it).

Transient faults (crash, hang, bitflip, param, drift) fire once per run, in the first generation that reaches their
step (a `fired-*.json` record under ROOT/demo/ says so), so the restarted job does not meet them again; sdc is
persistent, as a failing part is, until a save finds it: the Checkpointer then ends the generation
(LiveStateCorrupt), and the restarted generation runs without it, as a job rescheduled away from the failing part
would (`drain` records that); slow lasts as long as the job.

`param:rank=R:step=S` flips a bit of element 0 of rank R's own piece of a weight (its shard under FSDP) right
before the first save at or after step S: after that save step's optimizer step *and* after the sphere retraction
of `--constraint sphere` (the fired record holds both the requested and the actual step). The timing is the point:
a retraction rescales every constrained matrix back to its radius, so a flip that lands before the next step's
retraction is either rescaled away (the sphere invariant then sees a matrix of the right norm; only its shape is
wrong) or, for a high exponent bit, turns the next forward pass into NaNs on every rank, which the `finite`
invariant catches but can no longer attribute. A flip between the last retraction and the save is what a
model-intrinsic invariant can see and attribute, as it would see corruption of the weights while a save is being
taken: the corrupted shard alone holds more than the whole sphere's squared radius, so the check names the rank
that holds it.

`drift:rank=R:step=S[:amount=A]` makes rank R's online mixture weights drift from its peers' after the mixer update
of step S (needs `--mixing online`): weight 0 is scaled by (1 + A) and the vector renormalised, so it stays on the
simplex (the simplex invariant cannot tell) and only a replica comparison (save-time consensus) names the rank.
The mixer's later updates are multiplicative and identical on every rank, so the difference persists.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from scout_ckpt.errors import BadInput
from scout_ckpt.format.layout import atomic_write_json

MARKER_DIR = "demo"  # under ROOT: the demo's own files (worker logs, results, injection records)

SAVE_POINTS = ("before_write", "during_write", "after_write", "before_rename", "after_rename", "after_commit")
COORDINATOR_POINTS = ("before_rename", "after_rename")  # the manifest and the rename are the coordinator's

# kind -> (required keys, optional keys with defaults)
KINDS: dict[str, tuple[tuple[str, ...], dict[str, object]]] = {
    "crash": (("rank", "step"), {"at": "during_write"}),
    "bitflip": (("step",), {"file": None, "bit": None}),
    "sdc": (("rank", "step"), {"layer": "blocks.1.mlp.fc1", "elem": 0}),
    "hang": (("rank", "step"), {}),
    "slow": (("rank", "factor"), {}),
    "param": (("rank", "step"), {"name": None, "bit": 30}),
    "drift": (("rank", "step"), {"amount": 0.25}),
}
_INT_KEYS = {"rank", "step", "bit", "elem"}
_FLOAT_KEYS = {"factor", "amount"}


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    opts: dict = field(default_factory=dict)

    @property
    def spec(self) -> str:
        parts = [self.kind] + [f"{k}={v}" for k, v in (("rank", self.rank), ("step", self.step)) if v is not None]
        parts += [f"{k}={v}" for k, v in sorted(self.opts.items()) if v is not None]
        return ":".join(parts)

    def to_json(self) -> dict:
        return {"kind": self.kind, "rank": self.rank, "step": self.step, **self.opts, "spec": self.spec}


def parse(spec: str) -> Fault:
    """One `KIND:key=value:...` spec; BadInput with a one-line message otherwise."""
    kind, *pairs = spec.strip().split(":")
    if kind not in KINDS:
        raise BadInput(f"--inject {spec!r}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    required, optional = KINDS[kind]
    values: dict[str, object] = {}
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        if not eq or not key or not raw:
            raise BadInput(f"--inject {spec!r}: expected key=value, got {pair!r}")
        if key not in required and key not in optional:
            raise BadInput(f"--inject {spec!r}: {kind} takes {', '.join(required + tuple(optional))}, not {key!r}")
        if key in values:
            raise BadInput(f"--inject {spec!r}: {key} given twice")
        values[key] = _value(spec, key, raw)
    missing = [k for k in required if k not in values]
    if missing:
        raise BadInput(f"--inject {spec!r}: {kind} needs {', '.join(k + '=' for k in missing)}")
    if kind == "crash" and values.get("at", "during_write") not in SAVE_POINTS:
        raise BadInput(f"--inject {spec!r}: at= must be one of {', '.join(SAVE_POINTS)}")
    if kind == "crash" and values.get("at") in COORDINATOR_POINTS and values["rank"] != 0:
        raise BadInput(f"--inject {spec!r}: only rank 0 (the coordinator) reaches {values['at']}")
    if kind == "slow" and not values["factor"] >= 1.0:
        raise BadInput(f"--inject {spec!r}: factor must be >= 1")
    if kind == "drift" and "amount" in values and not 0.0 < values["amount"] <= 100.0:
        raise BadInput(f"--inject {spec!r}: amount must be in (0, 100]")
    if "bit" in values and not values["bit"] < (32 if kind == "param" else 8):
        raise BadInput(f"--inject {spec!r}: bit must be below {32 if kind == 'param' else 8}")
    opts = {**optional, **{k: v for k, v in values.items() if k not in ("rank", "step")}}
    return Fault(kind, values.get("rank"), values.get("step"), opts)


def _value(spec: str, key: str, raw: str):
    try:
        if key in _INT_KEYS:
            v = int(raw)
            if (v < 0 and key != "elem") or (key == "step" and v < 1):
                raise ValueError
            return v
        if key in _FLOAT_KEYS:
            return float(raw)
    except ValueError:
        raise BadInput(
            f"--inject {spec!r}: {key}={raw!r} is not a valid {'step' if key == 'step' else 'number'}"
        ) from None
    return raw


def parse_all(
    specs: list[str] | tuple[str, ...] | None, ranks: int | None = None, steps: int | None = None
) -> list[Fault]:
    """Parse every spec and check ranks/steps against the job's size."""
    faults = [parse(s) for s in (specs or [])]
    for f in faults:
        if ranks is not None and f.rank is not None and f.rank >= ranks:
            raise BadInput(f"--inject {f.spec!r}: rank {f.rank} does not exist in a {ranks}-rank job")
        if steps is not None and f.step is not None and f.step > steps:
            raise BadInput(f"--inject {f.spec!r}: step {f.step} is beyond --steps {steps}")
    return faults


class Injector:
    """The worker-side mechanics for one rank of one generation."""

    def __init__(
        self,
        faults: list[Fault],
        rank: int,
        generation: int,
        root: str | os.PathLike,
        save_every: int | None = None,
        steps: int | None = None,
    ):
        self.rank, self.generation, self.root = rank, generation, Path(root)
        self.save_every, self.steps = save_every, steps
        self.faults = [f for f in faults if f.rank is None or f.rank == rank]
        self._slow = next((f.opts["factor"] for f in self.faults if f.kind == "slow"), 1.0)
        self._slow_fired = False

    def _mine(self, kind: str, step: int) -> list[Fault]:
        """This rank's transient faults of `kind` due at `step` that no earlier generation fired: a crash or a
        hang happens once per run, in the first generation that reaches its step, not again after the restart."""
        due = [f for f in self.faults if f.kind == kind and self.due_step(f) == step]
        return [f for f in due if not any((self.root / MARKER_DIR).glob(f"fired-{_slug(f)}-gen*.json"))]

    def _struck_before(self, f: Fault) -> bool:
        """An earlier generation ended on this fault: its part was drained at the restart."""
        return any((self.root / MARKER_DIR).glob(f"drained-{_slug(f)}-gen*.json"))

    def drain(self) -> None:
        """The generation ends because a save found the live state bad: this rank's persistent faults that fired
        are drained, so the restarted job runs on healthy parts."""
        for f in self.faults:
            if f.kind == "sdc" and any(
                (self.root / MARKER_DIR).glob(f"fired-{_slug(f)}-gen{self.generation}-rank{self.rank}.json")
            ):
                atomic_write_json(
                    self.root / MARKER_DIR / f"drained-{_slug(f)}-gen{self.generation}.json",
                    {"spec": f.spec, "rank": self.rank, "generation": self.generation, "time": time.time()},
                )

    def due_step(self, f: Fault) -> int | None:
        """The step at which `f` fires: its own, but a `param` flip waits for the first save at or after it."""
        if f.kind != "param" or not self.save_every or f.step is None:
            return f.step
        nxt = -(-f.step // self.save_every) * self.save_every
        return min(nxt, self.steps) if self.steps else nxt

    # ---- save-time faults (the Checkpointer's fault_hook) ---------------------------------------------------

    def fault_hook(self, point: str, step: int) -> None:
        for f in self._mine("crash", step):
            # A rank that writes no .distcp data (DCP de-duplicates replicated tensors) never reaches
            # "during_write": it dies at "after_write" instead, still before anything is committed.
            if f.opts["at"] == point or (point == "after_write" and f.opts["at"] == "during_write"):
                self._fired(f, step, point=point)
                os.kill(os.getpid(), signal.SIGKILL)
        if point == "after_commit" and self.rank == 0:
            for f in self._mine("bitflip", step):
                self._fired(f, step, **flip_file_bit(self.root, step, f.opts.get("file"), f.opts.get("bit")))

    # ---- training-time faults ---------------------------------------------------------------------------------

    def _fired(self, f: Fault, step: int, **detail) -> None:
        """Record that a fault fired (the campaign measures detection latency from this time)."""
        name = f"fired-{_slug(f)}-gen{self.generation}-rank{self.rank}.json"
        atomic_write_json(
            self.root / MARKER_DIR / name,
            {
                "kind": f.kind,
                "spec": f.spec,
                "rank": self.rank,
                "step": step,
                "generation": self.generation,
                "time": time.time(),
                **detail,
            },
        )

    def before_step(self, step: int, model) -> None:
        """At the start of step `step`: turn on a persistent SDC; block forever for a hang."""
        from scout_ckpt.demo.model import sdc_target, set_sdc

        for f in self.faults:
            if f.kind == "sdc" and step >= f.step and sdc_target() != f.opts["layer"] and not self._struck_before(f):
                if f.opts["layer"] not in model.linear_names():
                    raise ValueError(
                        f"sdc layer {f.opts['layer']!r} is not a Linear of the model "
                        f"({', '.join(model.linear_names())})"
                    )
                set_sdc(f.opts["layer"], f.opts["elem"])
                self._fired(f, step, layer=f.opts["layer"])
        for f in self._mine("hang", step):
            self._fired(f, step)
            threading.Event().wait()  # before the step's first collective: every other rank stalls in it

    def slow_down(self, step: int, compute_s: float) -> None:
        if self._slow > 1.0:
            if not self._slow_fired:
                self._slow_fired = True
                self._fired(next(f for f in self.faults if f.kind == "slow"), step)
            time.sleep((self._slow - 1.0) * compute_s)

    def after_optimizer_step(self, step: int, model) -> None:
        """After step `step`'s optimizer step and sphere retraction: the `param` flip (see the module doc)."""
        for f in self._mine("param", step):
            name = flip_param_bit(model, f.opts.get("name"), f.opts["bit"])
            self._fired(f, step, param=name, bit=f.opts["bit"], requested_step=f.step)

    def after_mixing_update(self, step: int, mixer) -> None:
        """After step `step`'s mixer update: the `drift` of this rank's mixture weights."""
        for f in self._mine("drift", step):
            before = mixer.weights.tolist()
            drift_mixture(mixer, f.opts["amount"])
            self._fired(f, step, amount=f.opts["amount"], before=before, after=mixer.weights.tolist())


def _slug(f: Fault) -> str:
    return f.spec.replace(":", "_").replace("=", "")


def fired_records(root: str | os.PathLike) -> list[dict]:
    """Every fired-fault record of a run, oldest first."""
    import json

    out = []
    for path in (Path(root) / MARKER_DIR).glob("fired-*.json"):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda r: r.get("time", 0))


def flip_param_bit(model, name: str | None, bit: int) -> str:
    """Flip `bit` of element 0 of this rank's own piece of a parameter (the local shard under FSDP)."""
    import torch

    params = dict(model.named_parameters())
    if name is None:
        name = next(n for n, _ in model.sphere_params())
    p = params[name]
    local = p.to_local() if hasattr(p, "to_local") else p
    with torch.no_grad():
        flat = local.view(-1)
        if flat.numel():
            flat[:1].view(torch.int32).bitwise_xor_(1 << bit)
    return name


def drift_mixture(mixer, amount: float) -> None:
    """Scale weight 0 of an OnlineMixer by (1 + amount) and renormalise: still a distribution, no longer the
    peers' one."""
    w = mixer.weights.clone()
    w[0] *= 1.0 + amount
    mixer.weights = w / w.sum()


def flip_file_bit(root: str | os.PathLike, step: int, name: str | None = None, bit: int | None = None) -> dict:
    """Flip one bit in the middle of a committed `.distcp` file of `step`, in place (no new inode, no rename):
    what a bad disk sector or a stray write does. Returns what was flipped."""
    from scout_ckpt.format.layout import step_path

    d = step_path(root, step)
    files = sorted(d.glob("*.distcp"), key=lambda p: (-p.stat().st_size, p.name)) if name is None else [d / name]
    if not files or not files[0].exists():
        raise FileNotFoundError(f"{d}: no .distcp file to flip")
    path = files[0]
    size = path.stat().st_size
    offset = size // 2
    bit = 3 if bit is None else bit % 8
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))
        f.flush()
        os.fsync(f.fileno())
    return {"file": str(path.relative_to(root)), "offset": offset, "bit": bit}
