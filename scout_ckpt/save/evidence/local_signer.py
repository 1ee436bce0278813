"""The at-rest check's signatures of one rank's local tensors, cheap enough to take twice per optimizer step.

Why a module of its own: the at-rest interval check (at_rest.py) hashes every local parameter shard and optimizer
state tensor after each optimizer step and again before the next one. At the FSDP2 example's sizes (a few hundred
tensors of a few kilobytes) the per-tensor bookkeeping, not the hashing, was most of that cost: walking the
optimizer's state, DTensor unwrapping, `detach`, and the general path of `replica_signatures` (device, layout and
dtype checks per tensor, a torch tensor per result). Here the list of tensors is built once and re-validated per
pass by identity and data pointer (rebuilt when the optimizer's state or a parameter's storage changes: a load, a
lazily created state, a new param group), and each CPU tensor whose memory is its row-major bytes keeps a zero-copy
byte view, hashed directly with xxh3-64.

A signature here is compared only with an earlier signature of the same tensor on the same rank (never with a
replica's), so it need not match `replica_signatures`: xxh3-64 of the raw bytes for a dense CPU tensor (any bit
flip changes it but with probability 2^-64), else the tensor's `replica_signatures` row (a device tensor: the
additive signature, on the device).
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter

import torch
import xxhash

from scout_ckpt.consensus.signatures import replica_signatures

_EMPTY: dict = {}
# a same-size integer dtype to view a tensor's bytes through numpy (bfloat16 and the float8s have no numpy dtype)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the very object it holds: `to_local()` is an autograd call costing tens of
    microseconds, which over hundreds of tensors twice a step was most of the interval check's cost)."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    return t.to_local() if hasattr(t, "to_local") else t


def byte_view(t: torch.Tensor):
    """A zero-copy numpy view of a CPU tensor's row-major bytes, or None where its memory is not exactly those
    (strided, conjugate or negative bit, quantized, sparse) or its element size has no integer twin."""
    if not (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and t.element_size() in _INT_OF_SIZE
    ):
        return None
    d = t.detach()
    if d.dtype.is_complex:
        return None
    return d.view(_INT_OF_SIZE[d.element_size()]).numpy()


def sign_tensors(tensors: list[torch.Tensor], views: list | None = None) -> list:
    """One signature per tensor (see the module docstring); `views` are their byte views (None: made here)."""
    if views is None:
        views = [byte_view(t) for t in tensors]
    out: list = [None] * len(tensors)
    other = []
    for i, v in enumerate(views):
        if v is None:
            other.append(i)
        else:
            out[i] = xxhash.xxh3_64_intdigest(v)
    if other:
        rows = replica_signatures([tensors[i].detach() for i in other]).tolist()
        for i, row in zip(other, rows):
            out[i] = tuple(row)
    return out


class LocalTensors:
    """Each parameter's local shard, then its optimizer state tensors (sorted keys), named as the model names
    them ("<param>:<state key>"; unnamed parameters "<group>.<index>"), cached between passes.

    The cache holds what it was built from (the optimizer's state mapping, each parameter, each per-parameter state
    dict and state tensor, each DTensor's local tensor, each local tensor's data pointer) and is rebuilt when any of
    them is no longer the same object: a load replaces the state mapping, the first step creates the state, a
    new param group adds parameters, a storage swap (`p.data = ...`) moves a data pointer. The check is a few
    C-level maps over the lists (tens of microseconds for hundreds of tensors), not a walk in Python."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: dict[int, str], include_state: bool = True):
        self.optimizer, self.param_names, self.include_state = optimizer, names, include_state
        self._state: object = None  # the optimizer's state mapping the cache was built from (a load replaces it)
        self._key: tuple | None = None
        self._names: list[str] = []
        self._tensors: list[torch.Tensor] = []
        self._views: list = []
        # held, so that an id below cannot be reused by another object while the cache lives
        self._held: tuple = ()
        self._owners_keys_srcs: tuple[list, list, list] = ([], [], [])  # per state tensor: its dict, key, object
        self._dtensors: list = []  # the DTensors among the sources (their local tensor is checked by identity)

    def _snapshot(self) -> tuple:
        """What the cache depends on, as lists of ids and data pointers (compared with ==)."""
        state = self.optimizer.state
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        sts = list(map(state.get, params, repeat(_EMPTY))) if self.include_state else []
        owners, keys, srcs = self._owners_keys_srcs
        try:
            now = list(map(dict.__getitem__, owners, keys)) if owners else []
        except (KeyError, TypeError):
            now = None  # a state entry went away: rebuild
        dts = self._dtensors
        return (
            id(state),
            list(map(id, params)),
            list(map(id, sts)),
            list(map(len, sts)),
            None if now is None else list(map(id, now)),
            list(map(id, map(attrgetter("_local_tensor"), dts))) if dts else [],
            list(map(torch.Tensor.data_ptr, self._tensors)),
        )

    def _build(self) -> None:
        state = self.optimizer.state
        names, tensors, owners, keys, srcs, dts = [], [], [], [], [], []
        params = []
        for gi, g in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(g["params"]):
                params.append(p)
                name = self.param_names.get(id(p), f"{gi}.{pi}")
                names.append(name)
                tensors.append(local_tensor(p))
                if isinstance(getattr(p, "_local_tensor", None), torch.Tensor):
                    dts.append(p)
                st = (state.get(p) if self.include_state else None) or _EMPTY
                for k in sorted(st):
                    v = st[k]
                    if isinstance(v, torch.Tensor):
                        names.append(f"{name}:{k}")
                        tensors.append(local_tensor(v))
                        owners.append(st)
                        keys.append(k)
                        srcs.append(v)
                        if isinstance(getattr(v, "_local_tensor", None), torch.Tensor):
                            dts.append(v)
        self._names, self._tensors = names, tensors
        self._owners_keys_srcs = (owners, keys, srcs)
        self._dtensors = dts
        self._views = [byte_view(t) for t in tensors]
        self._held = (state, params, owners, srcs, dts)
        self._key = self._snapshot()

    def current(self) -> tuple[list[str], list[torch.Tensor]]:
        """(names, local tensors) as they are now; the same list objects while nothing changed."""
        if self._key is None or self._snapshot() != self._key:
            self._build()
        return self._names, self._tensors

    def sign(self, idx: list[int] | None = None, *, checked: bool = False) -> tuple[list[str], list]:
        """(names, signatures) of every tensor, or of those at `idx` (signatures in `idx` order). `checked`: the
        caller has just called `current()` (one validation per pass, not two)."""
        names, tensors = (self._names, self._tensors) if checked else self.current()
        if idx is None:
            return names, sign_tensors(tensors, self._views)
        return names, sign_tensors([tensors[i] for i in idx], [self._views[i] for i in idx])


__all__ = ["LocalTensors", "byte_view", "local_tensor", "sign_tensors"]
