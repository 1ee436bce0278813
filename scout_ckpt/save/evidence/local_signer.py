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

import torch
import xxhash

from scout_ckpt.consensus.signatures import replica_signatures

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
    them ("<param>:<state key>"; unnamed parameters "<group>.<index>"), cached between passes."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: dict[int, str], include_state: bool = True):
        self.optimizer, self.param_names, self.include_state = optimizer, names, include_state
        self._state: object = None  # the optimizer's state mapping the cache was built from (a load replaces it)
        # per parameter: (param, its state dict or None, state keys, local tensors) in order; then flat lists
        self._params: list[tuple] = []
        self._names: list[str] = []
        self._tensors: list[torch.Tensor] = []
        self._views: list = []
        self._ptrs: list[int] = []

    def _valid(self) -> bool:
        state = self.optimizer.state
        if state is not self._state:
            return False
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if len(params) != len(self._params):
            return False
        at = 0
        for p, (p0, st0, keys, locs) in zip(params, self._params):
            if p is not p0:
                return False
            st = state.get(p) if self.include_state else None
            if self.include_state and (st is not st0 or (st is not None and len(st) != len(keys) + locs[1])):
                return False
            if local_tensor(p) is not locs[0][0]:
                return False
            for k, loc in zip(keys, locs[0][1:]):
                v = st.get(k) if st is not None else None
                if not isinstance(v, torch.Tensor) or local_tensor(v) is not loc:
                    return False
            for loc in locs[0]:
                if loc.data_ptr() != self._ptrs[at]:
                    return False
                at += 1
        return True

    def _build(self) -> None:
        state = self.optimizer.state
        self._state = state
        self._params, self._names, self._tensors = [], [], []
        for gi, g in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(g["params"]):
                name = self.param_names.get(id(p), f"{gi}.{pi}")
                locs = [local_tensor(p)]
                self._names.append(name)
                st = state.get(p) if self.include_state else None
                keys = []
                others = 0  # non-tensor entries of the state (counted, so that a new one invalidates the cache)
                if st is not None:
                    for k in sorted(st):
                        if isinstance(st[k], torch.Tensor):
                            keys.append(k)
                            locs.append(local_tensor(st[k]))
                            self._names.append(f"{name}:{k}")
                        else:
                            others += 1
                self._params.append((p, st, keys, (locs, others)))
                self._tensors.extend(locs)
        self._views = [byte_view(t) for t in self._tensors]
        self._ptrs = [t.data_ptr() for t in self._tensors]

    def current(self) -> tuple[list[str], list[torch.Tensor]]:
        """(names, local tensors) as they are now; the same list objects while nothing changed."""
        if not self._valid():
            self._build()
        return self._names, self._tensors

    def sign(self, idx: list[int] | None = None) -> tuple[list[str], list]:
        """(names, signatures) of every tensor, or of those at `idx` (signatures in `idx` order)."""
        names, tensors = self.current()
        if idx is None:
            return names, sign_tensors(tensors, self._views)
        return names, sign_tensors([tensors[i] for i in idx], [self._views[i] for i in idx])


__all__ = ["LocalTensors", "byte_view", "local_tensor", "sign_tensors"]
