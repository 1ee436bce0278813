"""Canonical bytes of a non-tensor value of the state: equal on every rank exactly when the values are equal,
whatever each process's hash seed (PYTHONHASHSEED differs per process, and with it the iteration order of a set of
strings), the order a set or dict was built in, or object addresses. What consensus (save_time.py) and the full
signatures (full.py) compare a non-tensor leaf by; flatten.py gives every such leaf of a state its encoding.

Why: replicas were compared by `repr`, and a set of strings in the state made a healthy rank look like silent data
corruption (a `consensus_attributed` or `consensus_inconclusive` verdict, an `sdc` event, the checkpoint rejected).

The encoding, by type (the type's qualified name comes first, so 1, 1.0 and True differ):
- None, bool, int, str: JSON (exact; IntEnum and StrEnum members as their int or str; what these have always
  been encoded as, so load signatures recorded in older manifests still match);
- float: its bits. JSON's shortest round-trip repr for every float but NaN (one string per double, -0.0 and 0.0
  apart: the encoding recorded before), a NaN by its 64 bits (sign and payload; a NaN equals itself);
- bytes, bytearray, memoryview: the bytes; a numpy array: dtype, shape and bytes; a numpy scalar: dtype, bytes;
- tuple, list: the elements' encodings in order; set, frozenset: the elements' encodings sorted; dict: the
  (key, value) encodings sorted by key encoding (insertion order is not compared); each element length-prefixed;
- complex, other enum members, torch.dtype, torch.device, range, slice, Ellipsis, decimal.Decimal,
  fractions.Fraction, datetime date/time/datetime/timedelta: their repr, which for these types is a function of
  the value alone (the encoding recorded before, too).

What cannot be compared: any other object (a class instance, a dataclass, a function, a numpy array of Python
objects, a datetime whose tzinfo has no repr of its own, a container holding one of these, containers nested
deeper than MAX_DEPTH). Its repr may hold an address, a hash-ordered set or nothing of its state, so equal
replicas could differ or different ones agree. Such a leaf becomes a `NotComparable` (with the reason) instead of
bytes: consensus leaves it out and records it in its evidence (`not_comparable`), load verification does not
sign it (mesh.full_signable lists it with the unsigned keys); it is never an SDC. Its bytes in the checkpoint are
still covered by the file digests.
"""

from __future__ import annotations

import datetime
import decimal
import enum
import fractions
import json
import math
import re
import struct
from collections.abc import Mapping
from typing import Any

import torch

MAX_DEPTH = 64  # containers nested deeper than this are not comparable (no recursion without bound)
_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")


class NotComparableError(TypeError):
    """A value that has no canonical encoding (the module docstring says which)."""


class NotComparable:
    """A non-tensor leaf of the state that has no canonical encoding: left out of consensus and of the load
    signatures, `why` recorded in the consensus evidence."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why

    def __repr__(self) -> str:
        return f"NotComparable({self.why!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, NotComparable) and other.why == self.why

    __hash__ = None  # type: ignore[assignment]  # unhashable, as equal-by-value objects must be (typeshed: a method)


# types whose repr is a function of the value alone (no address, no hash order)
_BY_REPR = (
    complex,
    enum.Enum,
    torch.dtype,
    torch.device,
    range,
    type(Ellipsis),
    decimal.Decimal,
    fractions.Fraction,
    datetime.date,
    datetime.time,
    datetime.timedelta,
)


def _head(obj: Any) -> bytes:
    typ = type(obj)
    return f"{typ.__module__}.{typ.__qualname__}:".encode()


def _float(x: float) -> bytes:
    if math.isnan(x):
        return b"nan:" + struct.pack(">d", x).hex().encode()
    return json.dumps(x).encode()


def _framed(parts: list[bytes]) -> bytes:
    """A count, then each part with its length: no two sequences of parts frame alike."""
    return struct.pack("<Q", len(parts)) + b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def _encode(obj: Any, depth: int) -> bytes:
    if depth > MAX_DEPTH:
        raise NotComparableError(f"nested deeper than {MAX_DEPTH}")
    head = _head(obj)
    if obj is None or isinstance(obj, (bool, int, str)):  # IntEnum and StrEnum members too, as always
        return head + json.dumps(obj).encode()
    if isinstance(obj, float):
        return head + _float(obj)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return head + bytes(obj)
    if type(obj).__module__ == "numpy":
        import numpy as np

        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise NotComparableError("a numpy array of Python objects")
            arr = np.ascontiguousarray(obj)
            return head + f"{arr.dtype.str}{arr.shape}:".encode() + arr.tobytes()
        if isinstance(obj, np.generic) and not obj.dtype.hasobject:
            return head + f"{obj.dtype.str}:".encode() + obj.tobytes()
    if isinstance(obj, (tuple, list)):
        return head + b"[" + _framed([_encode(x, depth + 1) for x in obj])
    if isinstance(obj, (set, frozenset)):
        return head + b"{" + _framed(sorted(_encode(x, depth + 1) for x in obj))
    if isinstance(obj, Mapping):
        pairs = sorted((_encode(k, depth + 1), _encode(v, depth + 1)) for k, v in obj.items())
        return head + b"<" + _framed([p for kv in pairs for p in kv])
    if isinstance(obj, slice) and not all(x is None or type(x) is int for x in (obj.start, obj.stop, obj.step)):
        return head + b"[" + _framed([_encode(x, depth + 1) for x in (obj.start, obj.stop, obj.step)])
    if isinstance(obj, (*_BY_REPR, slice)):
        text = repr(obj)
        if _ADDR.search(text):  # e.g. a datetime whose tzinfo is an object without a repr of its own
            raise NotComparableError(f"the repr of {type(obj).__qualname__} holds an object address")
        return head + text.encode()
    typ = type(obj)
    raise NotComparableError(f"{typ.__module__}.{typ.__qualname__} has no canonical encoding")


def leaf_bytes(obj: Any) -> bytes:
    """The canonical encoding of a non-tensor leaf (the module docstring): equal bytes on every rank exactly for
    equal values. NotComparableError for a value that has none."""
    return _encode(obj, 0)


def comparable_leaf(obj: Any) -> bytes | NotComparable:
    """`leaf_bytes(obj)`, or a NotComparable saying why there is none."""
    try:
        return leaf_bytes(obj)
    except NotComparableError as e:
        return NotComparable(str(e))
    except RecursionError:
        return NotComparable("nested too deeply")
    except ValueError as e:  # an int past Python's digit limit for str conversion
        return NotComparable(f"{type(obj).__qualname__}: {e}")
