"""Invariant specs: the check kinds, their parameters, which kinds vouch for single-owner shards, and parsing
the JSON-able or string-shorthand specs users configure (stored in policies and manifests, so parsing must be
strict and stable)."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any

from scout_ckpt.errors import BadInput


@dataclass(frozen=True)
class Param:
    default: Any = None
    required: bool = False
    kind: type = float


# Each kind: its parameters and the key its glob is stored under.
KINDS: dict[str, dict[str, Param]] = {
    "finite": {"params": Param("*", kind=str)},
    "frobenius_sphere": {"params": Param(required=True, kind=str), "radius": Param(required=True), "rtol": Param(1e-3)},
    "spectral_sphere": {
        "params": Param(required=True, kind=str),
        "radius": Param(required=True),
        "rtol": Param(1e-2),
        "iters": Param(100, kind=int),
        "seed": Param(0, kind=int),
    },
    "spectral_bound": {
        "params": Param(required=True, kind=str),
        "lo": Param(0.0),
        "hi": Param(math.inf),
        "rtol": Param(1e-2),
        "iters": Param(100, kind=int),
        "seed": Param(0, kind=int),
    },
    "oblique": {
        "params": Param(required=True, kind=str),
        "axis": Param("rows", kind=str),
        "radius": Param(1.0),
        "rtol": Param(1e-3),
    },
    "simplex": {"path": Param(required=True, kind=str), "atol": Param(1e-5)},
    "monotone": {"path": Param(required=True, kind=str), "strict": Param(False, kind=bool)},
}


# Whether a passing check of each kind vouches for a tensor's values where no replica exists to compare with
# (single-owner FSDP shards): a sphere, a spectral bound, an oblique or simplex constraint pins the values down
# tightly enough that a flipped exponent or mantissa bit breaks it. `finite` misses a huge but finite flipped
# exponent and `monotone` looks at one counter, so they never stand in for consensus. A spec may set
# `vouches=False`; `vouches=True` is refused for the kinds that cannot vouch.
VOUCHES: dict[str, bool] = {
    "finite": False,
    "frobenius_sphere": True,
    "spectral_sphere": True,
    "spectral_bound": True,
    "oblique": True,
    "simplex": True,
    "monotone": False,
}


@dataclass(frozen=True)
class Check:
    kind: str
    args: dict = field(hash=False)
    vouches_override: bool | None = None  # from the spec's `vouches`, if given

    @property
    def vouches(self) -> bool:
        """True if passing this check stands in for consensus on single-owner shards (see VOUCHES)."""
        return VOUCHES[self.kind] if self.vouches_override is None else self.vouches_override and VOUCHES[self.kind]

    @property
    def glob(self) -> str:
        return self.args.get("params") or self.args.get("path")

    @property
    def spec(self) -> dict:
        """The canonical JSON-able spec (what parse_specs reads back)."""
        spec = {"check": self.kind, **{k: (None if v == math.inf else v) for k, v in self.args.items()}}
        if self.vouches_override is not None:
            spec["vouches"] = self.vouches_override
        return spec

    @property
    def label(self) -> str:
        return f"{self.kind}({self.glob})"

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.glob) or fnmatch.fnmatchcase(name, "*." + self.glob)


# ---- parsing -----------------------------------------------------------------------------------------------


def _coerce(kind: str, key: str, value: Any, p: Param) -> Any:
    if value is None and p.kind is float and key == "hi":
        return math.inf
    try:
        if p.kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if p.kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if p.kind is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if not isinstance(value, str) or not value:
            raise ValueError(value)
        return value
    except (TypeError, ValueError):
        raise BadInput(f"invariant {kind}: {key}={value!r} is not a valid {p.kind.__name__}") from None


def _parse_one(spec: dict | str) -> Check:
    if isinstance(spec, str):
        head, *pairs = spec.split(":")
        d: dict[str, Any] = {"check": head.strip()}
        for pair in pairs:
            if "=" not in pair:
                raise BadInput(f"invariant spec {spec!r}: expected key=value, got {pair!r}")
            k, v = pair.split("=", 1)
            d[k.strip()] = v.strip()
        spec = d
    if not isinstance(spec, dict):
        raise BadInput(f"invariant spec must be a dict or a string, not {type(spec).__name__}")
    kind = spec.get("check")
    if kind not in KINDS:
        raise BadInput(f"unknown invariant check {kind!r} (known: {', '.join(KINDS)})")
    params = KINDS[kind]
    glob_key = "params" if "params" in params else "path"
    raw = dict(spec)
    raw.pop("check")
    vouches = _coerce(kind, "vouches", raw.pop("vouches"), Param(kind=bool)) if "vouches" in raw else None
    if vouches and not VOUCHES[kind]:
        raise BadInput(
            f"invariant {kind} cannot vouch for a tensor's values (vouches=true is only for "
            f"{', '.join(k for k, v in VOUCHES.items() if v)})"
        )
    for alias in ("params", "path"):  # either name is accepted for the glob
        if alias in raw and alias != glob_key:
            raw[glob_key] = raw.pop(alias)
    unknown = set(raw) - set(params)
    if unknown:
        raise BadInput(
            f"invariant {kind}: unknown parameter(s) {', '.join(sorted(unknown))} (allowed: {', '.join(params)})"
        )
    args = {}
    for key, p in params.items():
        if key in raw:
            args[key] = _coerce(kind, key, raw[key], p)
        elif p.required:
            raise BadInput(f"invariant {kind} needs {key}")
        else:
            args[key] = p.default
    for key in ("radius", "rtol", "atol", "lo"):
        if key in args and not (args[key] >= 0 and math.isfinite(args[key])):
            raise BadInput(f"invariant {kind}: {key} must be a finite number >= 0, got {args[key]}")
    if kind == "spectral_bound" and not args["lo"] <= args["hi"]:
        raise BadInput(f"invariant spectral_bound: lo={args['lo']} > hi={args['hi']}")
    if kind == "spectral_bound" and args["lo"] == 0 and args["hi"] == math.inf:
        raise BadInput("invariant spectral_bound needs lo or hi")
    if kind == "oblique" and args["axis"] not in ("rows", "cols"):
        raise BadInput(f"invariant oblique: axis must be rows or cols, got {args['axis']!r}")
    if "iters" in args and not 1 <= args["iters"] <= 10_000:
        raise BadInput(f"invariant {kind}: iters must be in 1..10000")
    return Check(kind, args, vouches)


def parse_specs(specs: list[dict | str] | None) -> list[Check]:
    """Checks from specs (dicts or "kind:key=value" strings); BadInput names the bad one."""
    if specs is None:
        return []
    if isinstance(specs, (str, dict)):
        specs = [specs]
    if not isinstance(specs, (list, tuple)):
        raise BadInput(f"invariants must be a list of specs, not {type(specs).__name__}")
    return [_parse_one(s) for s in specs]
