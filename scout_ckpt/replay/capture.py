"""Capture one live invocation of a module: what went in, with which parameters, and the gradient that came back.

The hooks only read: inputs and parameters are detached clones, and the output's tensor hook returns None, so the
live autograd graph, .grad, parameters and RNG are exactly what they would be without them. Parameters are
cloned in the forward *pre*-hook, which runs after FSDP2's own (prepended) pre-forward hook has unsharded them:
the snapshot is the full parameter as the forward used it, under DDP, FSDP and HSDP alike.

Hooks go on the module its parent calls (a CheckpointWrapper or a per-block torch.compile wrapper included: their
hooks run eagerly around the live call); parameters are named and replayed on the unwrapped module.
A capture made with `params=False` (the save-boundary sweep) records no parameters: the sweep replays with the
parameters the module holds when the sweep runs, i.e. the state being saved, so no copy of the model is kept.

A capture made with `refs=True` (the sweep's, by default) keeps *references* to the live inputs and output
gradients instead of clones, with each tensor's `_version` (bumped by every in-place write). Autograd keeps most of
them alive for the backward anyway, so the copy bought nothing but time on the save step. A tensor written in
place after it was captured (by the module's own forward, a later layer, the optimizer) no longer holds what the
forward saw: `Invocation.intact()` is then False and the sweep does not replay that target (its coverage of the
checkpoint stays incomplete, never a pass). `mutated_in_forward` says the module wrote its own input (an in-place
activation on it): such a target needs clones (`refs=False`) to ever be replayable.

A capture made with `live=True` also signs what the live forward produced: the output as the module's caller
received it (after the forward hooks registered before the capture's own, which the replay runs too: execute.py),
hashed inside the capture's forward hook, before any later in-place write can change it. The replays of the same
invocation are compared with it (live.py): a fault that struck only the live step -- the step the checkpoint
carries -- shows as the source's live output disagreeing with every replay of it.

A capture made with `grads=True` (every rank's sweep capture, for the self-check: live.py) also signs what the
live backward computed for this invocation, inside the backward, before DDP's all-reduce or any accumulation:
- `grad_input[i]`, the gradient of each captured input that requires grad *through this module only*: a hook on
  the input tensor itself would see the sum over every use of it (a skip around the block, an encoder output fed
  to every decoder block), which no replay of one module computes; an identity view handed to the forward would
  isolate the share but change the order in which autograd sums the input's gradient (the live training's bits).
  So after the forward the capture walks the autograd graph the module's call built (nodes numbered since the
  call began), finds the edges that lead into each input, and hooks those nodes (hooks that only read): the
  module's share is the sum of what they send along those edges, added in the order they run -- the order the
  engine adds them in the replay's graph too. An input passed twice (the same tensor as two arguments) is not
  signed (the replay treats them as two tensors).
- `grad_param:NAME`, for the parameters named in `grad_params` (plain tensors: not FSDP2's or any DTensor's,
  whose gradient is reduce-scattered from an unsharded copy; not tied to a module outside the target, whose
  gradient is the sum of both uses): `Tensor.register_hook` on a leaf runs before its AccumulateGrad, so before
  DDP's reducer (a post-accumulate hook) averages it. When the module is called again in a forward before that
  backward has reached its parameters (a block reused, a second micro-batch before the first's backward), the
  hook would see the sum over the calls: its parameters' gradients are then not signed (`grad_note`).
Each is hashed as the hook receives it (the incoming gradient may become `.grad` and be written in place later).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from scout_ckpt.replay import determinism


def _clone(x: Any) -> Any:
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def _ref(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _is_hf_cache(x: Any) -> bool:
    """A transformers KV cache (cache_utils.Cache), without importing transformers."""
    return any(c.__name__ == "Cache" and (c.__module__ or "").startswith("transformers") for c in type(x).__mro__)


def _layer_idx(module: nn.Module) -> int | None:
    for m in module.modules():
        if isinstance(getattr(m, "layer_idx", None), int):
            return m.layer_idx
    return None


def _without_empty_cache(tree: Any, module: nn.Module) -> Any:
    """The captured arguments with a transformers KV cache that holds nothing yet for this block's layer (a training
    forward: every layer's entry is written by its own block, in that call) replaced by None. The cache is a live
    object the block's forward appends its keys and values to, so by the time of any replay it holds the live
    call's: a replay that is handed it attends over those and its own (the output's bits can survive the
    duplication, the keys' and values' gradients do not), and appends to the live cache again. With None the block
    computes exactly what the live call did on its empty entry. A cache with earlier entries for the layer is kept
    as it is (its state at the call cannot be rebuilt)."""
    idx = None

    def fix(x):
        nonlocal idx
        if x is None or isinstance(x, (torch.Tensor, bool, int, float, str)) or not _is_hf_cache(x):
            return x
        idx = _layer_idx(module) if idx is None else idx
        try:
            return None if idx is not None and int(x.get_seq_length(idx)) == 0 else x
        except Exception:  # noqa: BLE001 -- a cache of another shape: kept
            return x

    return tree_map(fix, tree)


def _full(t: torch.Tensor) -> torch.Tensor:
    # A parameter still sharded at forward time (no unshard hook ran): gather it. Collective, but every rank
    # captures the same target in the same step, so it is matched.
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@dataclass
class Invocation:
    """One forward/backward of a target, in a form that can be sent to peers and re-executed there."""

    args: tuple
    kwargs: dict
    requires_grad: tuple  # per flattened (args, kwargs) leaf: did the live input require grad
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    training: dict[str, bool]  # submodule name -> .training at capture time
    rng: torch.Tensor  # CPU generator state before the forward
    device_rng: torch.Tensor | None
    autocast: tuple | None  # (device_type, dtype) when the forward ran under autocast
    grad_outputs: list = field(default_factory=list)  # per flattened output leaf: its grad, or None
    held: list = field(default_factory=list)  # (live tensor, its _version when captured): refs=True
    mutated_in_forward: bool = False  # the module wrote one of its inputs in place
    live: torch.Tensor | None = None  # [n, 2] signatures of the live output's tensors (live=True)
    live_grads: dict = field(default_factory=dict)  # label -> [2] signature of a live gradient (grads=True)
    grad_note: str | None = None  # why some live gradients of this call are not signed

    def intact(self) -> bool:
        """Does every referenced live tensor still hold what was captured (no in-place write since)?"""
        return not self.mutated_in_forward and all(t._version == v for t, v in self.held)

    def to(self, device: torch.device | str) -> Invocation:
        def move(x):
            return x.to(device) if isinstance(x, torch.Tensor) else x

        return Invocation(
            tree_map(move, self.args),
            tree_map(move, self.kwargs),
            self.requires_grad,
            {k: move(v) for k, v in self.params.items()},
            {k: move(v) for k, v in self.buffers.items()},
            self.training,
            self.rng,
            self.device_rng,
            self.autocast,
            [move(g) for g in self.grad_outputs],  # `held` stays home: it is checked where the capture was made
            live=self.live,
            live_grads={k: move(v) for k, v in self.live_grads.items()},
            grad_note=self.grad_note,
        )


def current_state(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The module's parameters and buffers as they are now, full (a sharded DTensor is gathered: a collective on
    its mesh, which every rank reaches in the same order because the sweep walks the targets in one order).

    FSDP2's parameters (dim-0 shards on a 1-D mesh) are gathered together, one all_gather per module and dtype,
    not one `full_tensor()` each: per-tensor collectives were a third of an FSDP sweep."""
    named = list(module.named_parameters()) + [("buffer:" + n, b) for n, b in module.named_buffers()]
    full = gather_full([t for _, t in named])
    params = {n: t.detach() for (n, _), t in zip(named, full) if not n.startswith("buffer:")}
    buffers = {n[len("buffer:") :]: t.detach() for (n, _), t in zip(named, full) if n.startswith("buffer:")}
    return params, buffers


def _dim0_sharded(t: torch.Tensor) -> bool:
    """A DTensor sharded on dim 0 of a 1-D mesh, evenly or as torch.chunk cuts it (FSDP2's layout)."""
    try:
        from torch.distributed.tensor import Shard
    except ImportError:  # a torch without DTensor
        return False
    pl = getattr(t, "placements", None)
    return (
        pl is not None
        and len(pl) == 1
        and type(pl[0]) is Shard
        and pl[0].dim == 0
        and t.device_mesh.ndim == 1
        and t.ndim >= 1
    )


def gather_full(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor full: plain tensors as they are; dim-0 shards of one 1-D mesh and dtype in ONE all_gather
    (each rank's shard padded to the torch.chunk size, cut back after); any other DTensor by full_tensor()."""
    out: list = [None] * len(tensors)
    batches: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if _dim0_sharded(t):
            batches.setdefault((id(t.device_mesh), t.dtype), []).append(i)
        else:
            out[i] = _full(t)
    for idx in batches.values():  # insertion order: the same on every rank
        mesh = tensors[idx[0]].device_mesh
        w = mesh.size()
        layout = []  # (index, global shape, rows per chunk, elements per row, offset)
        off = 0
        for i in idx:
            shape = tuple(tensors[i].shape)
            rest = 1
            for d in shape[1:]:
                rest *= d
            chunk = -(-shape[0] // w)
            layout.append((i, shape, chunk, rest, off))
            off += chunk * rest
        local0 = tensors[idx[0]].to_local()
        buf = torch.zeros(off, dtype=local0.dtype, device=local0.device)
        for i, shape, chunk, rest, at in layout:
            loc = tensors[i].to_local().detach().reshape(-1)
            buf[at : at + loc.numel()].copy_(loc)
        parts = [torch.empty_like(buf) for _ in range(w)]
        dist.all_gather(parts, buf, group=mesh.get_group())
        for i, shape, chunk, rest, at in layout:
            rows = [max(0, min(chunk, shape[0] - r * chunk)) for r in range(w)]
            out[i] = torch.cat([parts[r][at : at + n * rest] for r, n in enumerate(rows)]).view(shape)
    return out


def _signature(t: torch.Tensor) -> torch.Tensor:
    """replica_signatures([t])[0], a dense CPU tensor's without that function's per-call setup (one per gradient)."""
    from scout_ckpt.consensus.signatures import digest_row, holds_row_major, replica_signatures

    if type(t) is torch.Tensor and t.numel() and holds_row_major(t):
        import xxhash

        return torch.tensor(
            digest_row(xxhash.xxh3_128_intdigest(t.reshape(-1).view(torch.uint8).numpy())), dtype=torch.int64
        )
    return replica_signatures([t])[0]


def _next_sequence_nr() -> int:
    """The sequence number the next autograd node made on this thread gets (one throwaway node is made to read
    it: later nodes' numbers all shift by one, so their relative order -- the backward's -- is unchanged)."""
    return torch.zeros((), requires_grad=True).view(()).grad_fn._sequence_nr() + 1


def device_of(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return getattr(t, "device", torch.device("cpu"))
    return torch.device("cpu")


class ModuleCapture:
    """Arm on one module for one step; the first forward of the step (and its backward) is captured.

    module: where the hooks go (what the parent calls); inner: the unwrapped module whose parameters are snapshot
    and which replay re-executes (default: module itself); params: snapshot parameters and buffers; refs: keep
    references (with their versions) to the inputs and output gradients instead of clones; live: sign the live
    output (module docstring); gather (with params=False): take part in the gathers of parameters still sharded
    at forward time (tensor parallel) that another rank's params=True capture of the same call makes, so that
    its collectives are matched. `hook_ids` (pre, post): the ids of the module's other forward hooks that ran between
    the capture and the module's caller -- pre-hooks after the capture's, post-hooks before it, in the order the
    module held them at the captured call -- which the replay runs too (execute.py)."""

    def __init__(
        self,
        module: nn.Module,
        inner: nn.Module | None = None,
        *,
        params: bool = True,
        refs: bool = False,
        live: bool = False,
        gather: bool = False,
        grads: bool = False,
        grad_params: frozenset | None = None,
    ):
        self.module = module
        self.inner = inner if inner is not None else module
        self.params = params
        self.refs = refs
        self.live = live
        self.gather = gather
        self.grads = grads  # sign the live backward's gradients (module docstring)
        self.grad_params = grad_params or frozenset()
        self._grad_handles: list = []
        self._awaited: set[str] = set()  # live gradients hooked and not signed yet
        self._grad_inputs: list = []  # (k, input tensor) whose share of the gradient is signed
        self._seq0 = 0
        self.hook_ids: tuple[frozenset, frozenset] | None = None
        self.invocation: Invocation | None = None
        self._handles: list = []
        self._pending_output = False  # the captured forward has not returned yet
        self._sharded_forward = False

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        self.disarm()
        self.invocation = None
        self._pending_output = False
        self._awaited = set()
        self._handles = [
            self.module.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.module.register_forward_hook(self._post),
        ]
        self.hook_ids = None

    def disarm(self) -> None:
        for h in self._handles + self._grad_handles:
            h.remove()
        self._handles, self._grad_handles = [], []

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.invocation is not None:  # activation recompute or a second micro-batch: keep the first
            inv = self.invocation
            if (
                self._grad_handles
                and torch._C._current_graph_task_id() == -1
                and inv.grad_note is None
                and any(lab.startswith("grad_param:") for lab in self._awaited)
            ):
                # called again in a forward before the first call's backward reached its parameters: their hooks
                # would see the sum over both calls (a recompute runs inside the backward, and does not count)
                inv.grad_note = "the module ran again before its backward reached its parameters"
            return None
        leaves, _ = tree_flatten((args, kwargs))
        inner = self.inner
        dev = device_of(inner)
        autocast = None
        if torch.is_autocast_enabled(dev.type):
            autocast = (dev.type, torch.get_autocast_dtype(dev.type))
        keep = _ref if self.refs else _clone
        # parameters still sharded at forward time (tensor parallel): the live call computed sharded math, which
        # the replay of the full module rounds differently -- no live signature then (FSDP2 unshards first)
        self._sharded_forward = any(hasattr(t, "full_tensor") for t in inner.parameters())
        if self.gather and not self.params:  # matched with the source's snapshot below: the same order
            for t in [*inner.parameters(), *inner.buffers()]:
                if hasattr(t, "full_tensor"):
                    _full(t)
        self.invocation = Invocation(
            args=_without_empty_cache(tree_map(keep, args), inner),
            kwargs=_without_empty_cache(tree_map(keep, kwargs), inner),
            requires_grad=tuple(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves),
            params={n: _full(p).detach().clone() for n, p in inner.named_parameters()} if self.params else {},
            buffers={n: _full(b).detach().clone() for n, b in inner.named_buffers()} if self.params else {},
            training={n: m.training for n, m in inner.named_modules()},
            rng=torch.get_rng_state(),
            device_rng=torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None,
            autocast=autocast,
        )
        if self.refs:
            self.invocation.held = [(x, x._version) for x in leaves if isinstance(x, torch.Tensor)]
        pre = list(module._forward_pre_hooks)
        mine = self._handles[0].id
        self.hook_ids = (frozenset(pre[pre.index(mine) + 1 :]) if mine in pre else frozenset(), frozenset())
        self._pending_output = True
        self._grad_inputs = []
        if self.grads and self.live and not self._sharded_forward and torch.is_grad_enabled():
            if dev.type == "cuda" and not determinism.live_grads_reproducible():
                # atomics (attention's backward, index_add) make a healthy live backward differ from its replay
                self.invocation.grad_note = "live backward on CUDA without strict deterministic settings"
            else:
                self._hook_param_grads(self.invocation)
                ins = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
                twice = {id(x) for x in ins if sum(y is x for y in ins) > 1}
                self._grad_inputs = [(k, x) for k, x in enumerate(ins) if id(x) not in twice]
                self._seq0 = _next_sequence_nr()

    def _hook_param_grads(self, inv: Invocation) -> None:
        """Hooks that sign this call's parameters' live gradients (module docstring)."""
        for name, p in self.inner.named_parameters():
            if name in self.grad_params and p.requires_grad and not hasattr(p, "full_tensor"):
                self._grad_handles.append(p.register_hook(self._sign_hook(inv, f"grad_param:{name}")))
                self._awaited.add(f"grad_param:{name}")

    def _hook_input_grads(self, inv: Invocation, outs: list) -> None:
        """Hooks on the nodes of this call's graph that feed each input (module docstring): what they send into
        input k, summed in the order they run, is the module's share of its gradient, signed once all arrived."""
        if not self._grad_inputs:
            return
        seq0 = self._seq0
        # Nodes are compared by the id of their Python objects, which stay the same only while one is alive:
        # every node object met is held (`held`, `seen`) until the walk ends.
        grad_fns, held = {}, []
        for k, x in self._grad_inputs:
            if x.grad_fn is not None:
                held.append(x.grad_fn)
                grad_fns[(id(held[-1]), x.output_nr)] = k
            else:
                grad_fns[("leaf", id(x))] = k
        edges: dict[int, list] = {}  # input k -> [(node, edge index)]
        seen: dict[int, Any] = {}
        stack = [o.grad_fn for o in outs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen[id(node)] = node
            for j, (nxt, nr) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                var = getattr(nxt, "variable", None)
                key = ("leaf", id(var)) if var is not None else (id(nxt), nr)
                if key in grad_fns:
                    edges.setdefault(grad_fns[key], []).append((node, j))
                elif var is None and nxt._sequence_nr() >= seq0:  # made by this call: walk on
                    stack.append(nxt)
        for k, pairs in edges.items():
            label = f"grad_input[{k}]"
            self._awaited.add(label)
            state = {"left": len(pairs), "sum": None}
            by_node: dict[int, list[int]] = {}
            for node, j in pairs:
                by_node.setdefault(id(node), []).append(j)
            for node, _ in {id(n): (n, j) for n, j in pairs}.values():
                node.register_hook(self._edge_hook(inv, label, state, by_node[id(node)]))  # freed with the graph

    def _edge_hook(self, inv: Invocation, label: str, state: dict, idx: list[int]):
        sign = self._sign_hook(inv, label)

        def hook(grad_inputs, grad_outputs) -> None:
            for j in idx:
                g = grad_inputs[j]
                state["left"] -= 1
                if g is not None:
                    state["sum"] = g if state["sum"] is None else state["sum"] + g
            if state["left"] == 0 and state["sum"] is not None:
                sign(state["sum"])
            # never change the live gradient

        return hook

    def _sign_hook(self, inv: Invocation, label: str):
        def hook(grad: torch.Tensor) -> None:
            if label in inv.live_grads or label not in self._awaited:
                return  # a second backward through the same parameter (a later call): not this invocation's
            self._awaited.discard(label)
            if label.startswith("grad_param:") and inv.grad_note is not None:
                return
            try:
                inv.live_grads[label] = _signature(grad.detach())
            except Exception:  # noqa: BLE001 -- a gradient that cannot be signed is not checked, never a failed step
                pass
            # never change the live gradient

        return hook

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        inv = self.invocation
        if inv is None or not self._pending_output:
            return
        self._pending_output = False
        post = list(module._forward_hooks)
        mine = self._handles[1].id if len(self._handles) > 1 else None
        if self.hook_ids is not None:
            self.hook_ids = (self.hook_ids[0], frozenset(post[: post.index(mine)]) if mine in post else frozenset())
        if inv.held and not inv.intact():  # the forward itself wrote an input: the references are stale already
            inv.mutated_in_forward = True
        outs, _ = tree_flatten(output)
        if self.live and not self._sharded_forward:
            from scout_ckpt.consensus.signatures import replica_signatures

            tensors = [o.detach() for o in outs if isinstance(o, torch.Tensor)]
            try:
                inv.live = replica_signatures(tensors) if tensors else None
            except Exception:  # noqa: BLE001 -- a tensor that cannot be signed: no live check, never a failed step
                inv.live = None
        if self._grad_inputs:
            try:
                self._hook_input_grads(inv, outs)
            except Exception:  # noqa: BLE001 -- an unusual graph: its input gradients are not signed, never a failed step
                pass
            self._grad_inputs = []
        inv.grad_outputs = [None] * len(outs)
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and o.requires_grad:
                o.register_hook(self._grad_hook(inv, i))

    def _grad_hook(self, inv: Invocation, i: int):
        refs = self.refs

        def hook(grad: torch.Tensor) -> None:
            if inv.grad_outputs[i] is None:
                if refs:
                    inv.grad_outputs[i] = grad.detach()
                    inv.held.append((grad, grad._version))
                else:
                    inv.grad_outputs[i] = grad.detach().clone()
            # never change the live gradient

        return hook


__all__ = ["Invocation", "ModuleCapture", "current_state", "device_of", "gather_full"]
