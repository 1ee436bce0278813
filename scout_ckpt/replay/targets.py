"""Which modules of a real model replay covers: its embedding(s), every repeated block, its output head.

Training jobs rarely hand over the bare model: DDP holds it as `.module`, torch.compile as `_orig_mod`, activation
checkpointing wraps each block in a CheckpointWrapper (`_checkpoint_wrapped_module`), FSDP2 swaps classes in place
(`FSDPBlock` is still a `Block`). And the blocks sit wherever the model's author put them: `layers` (TorchTitan, as
a ModuleDict), `model.layers` (Hugging Face), `transformer.h` (GPT-2, nanoGPT), `blocks`. Looking only at top-level
`blocks`/`layers` made replay cover nothing of most real models while coverage still read `pass`.

So discovery walks the module tree with wrappers made transparent and names every target by its *user path*: the
dotted path the unwrapped model uses (`transformer.h.3`, never `module._orig_mod.transformer.h.3`), the same
whether the caller passed the DDP-wrapped model or `model.module`. Each target keeps two modules: the one the
parent actually calls (hooks go there, so they see the live call, wrappers included) and the unwrapped one (replay
re-executes that on a copy: eager, without checkpoint recompute, which computes the same values).

A model with no repeated blocks is an error at construction, never a silent pass: replay evidence that covers
nothing would certify nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from scout_ckpt.errors import NoTargets

# Child names a wrapper keeps its wrapped module under (DDP's `module` only counts on DDP/DataParallel).
_WRAPPER_CHILDREN = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
# Container names that hold a model's repeated blocks in the common code bases; anything else falls back to the
# largest container of same-class children.
BLOCK_NAMES = ("layers", "h", "blocks", "block", "layer", "resblocks")
HEAD_NAMES = ("lm_head", "head", "output", "embed_out", "classifier")
OPTIMIZER = "optimizer"


@dataclass(frozen=True)
class Site:
    """One module at a user path: `outer` is what the parent calls, `inner` the module with wrappers removed.
    `under_compile`: a torch.compile wrapper sits above `outer` (whole-model compile): dynamo inlines the call and
    does not run hooks added after compiling, so captures need the step run eagerly (see runner)."""

    path: str
    outer: nn.Module
    inner: nn.Module
    under_compile: bool = False


def _wrapped(m: nn.Module) -> nn.Module | None:
    """The module `m` wraps, or None when `m` is not a wrapper."""
    children = m._modules
    if len(children) == 1:
        ((name, child),) = children.items()
        if name in _WRAPPER_CHILDREN:
            return child
        if name == "module" and _is_data_parallel(m):
            return child
    return None


def _is_data_parallel(m: nn.Module) -> bool:
    return isinstance(m, (nn.DataParallel, nn.parallel.DistributedDataParallel))


def _has_compile(m: nn.Module) -> bool:
    """Is a torch.compile wrapper part of `m`'s wrapper chain (or is `m` compiled in place by `m.compile()`)?"""
    while True:
        if type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None:
            return True
        m = _wrapped(m)
        if m is None:
            return False


def unwrap(m: nn.Module) -> nn.Module:
    """`m` with DDP, torch.compile, activation-checkpoint and FSDP1 wrappers removed (FSDP2 wraps in place)."""
    while (inner := _wrapped(m)) is not None:
        m = inner
    return m


def runs_compiled(m: nn.Module) -> bool:
    """Does a call of `m` run compiled code (a torch.compile wrapper in its chain, or `m.compile()`)?"""
    return _has_compile(m)


def original_class(m: nn.Module) -> type:
    """The model author's class: FSDP2 swaps a module's class for a dynamic `FSDP<Name>` subclass."""
    cls = type(m)
    idx = getattr(cls, "_orig_cls_mro_index", None)
    return cls.__mro__[idx] if isinstance(idx, int) and "FSDP" in cls.__name__ else cls


def sites(model: nn.Module) -> dict[str, Site]:
    """Every module by user path, in registration order ("" is the unwrapped root)."""
    out: dict[str, Site] = {}

    def walk(outer: nn.Module, path: str, compiled: bool) -> None:
        inner = unwrap(outer)
        in_place = getattr(outer, "_compiled_call_impl", None) is not None  # module.compile(): hooks inside
        out[path] = Site(path, outer, inner, compiled or in_place)
        below = compiled or _has_compile(outer)
        for name, child in inner._modules.items():
            if child is not None:
                walk(child, f"{path}.{name}" if path else name, below)

    walk(model, "", False)
    return out


def tensor_parallel_io(m: nn.Module) -> bool:
    """Is `m` itself tensor-parallelized: does it carry the input/output hooks torch's tensor parallelism installs
    (`parallelize_module` with ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput/Output)?
    Its call turns plain tensors into DTensors and back, so what it receives and returns are shards that a replay
    of the whole layer on one rank (its parameters gathered full) cannot take. A block that *holds* such layers is
    replayed whole: its own inputs and outputs are plain tensors, and the copy it is replayed on carries no hooks."""
    hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]
    return any((getattr(h, "__module__", None) or "").startswith("torch.distributed.tensor") for h in hooks)


def tensor_parallel_targets(model: nn.Module) -> list[str]:
    """User paths of the modules discovery leaves out for `tensor_parallel_io` (for coverage's "not covered")."""
    return [p for p, s in sites(model).items() if p and tensor_parallel_io(s.outer)]


def user_path(model: nn.Module, raw: str) -> str:
    """A path as `model.named_modules()` spells it (wrapper components included) -> the user path."""
    m, parts = model, []
    for name in [p for p in raw.split(".") if p]:
        if name in m._modules and _wrapped(m) is m._modules[name]:
            m = m._modules[name]
            continue
        if name not in m._modules:
            raise KeyError(raw)
        m = m._modules[name]
        parts.append(name)
    return ".".join(parts)


# ---- discovery ----------------------------------------------------------------------------------------------------


def _homogeneous(site: Site) -> list[str] | None:
    """Child names of a ModuleList/ModuleDict/Sequential whose children (unwrapped) all share one class."""
    if not isinstance(site.inner, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return None
    kids = [(n, unwrap(c)) for n, c in site.inner._modules.items() if c is not None]
    if not kids or len({original_class(c) for _, c in kids}) != 1:
        return None
    if all(len(c._parameters) == 0 and len(c._modules) == 0 for _, c in kids):
        return None  # a list of activation functions is not a stack of layers
    return [n for n, _ in kids]


def _inside(path: str, containers: list[str]) -> bool:
    return any(path == c or path.startswith(c + ".") for c in containers)


def find_blocks(all_sites: dict[str, Site]) -> list[str]:
    """User paths of the repeated blocks: the children of every outermost container with a usual name
    (`layers`, `h`, `blocks`, ...), else of the largest container of same-class children (at least 2)."""
    named: list[str] = []
    for path, site in all_sites.items():
        leaf = path.rsplit(".", 1)[-1]
        if path and leaf in BLOCK_NAMES and not _inside(path, named) and _homogeneous(site):
            named.append(path)
    if not named:
        best, size = None, 1
        for path, site in all_sites.items():
            kids = _homogeneous(site)
            if path and kids and len(kids) > size:
                best, size = path, len(kids)
        named = [best] if best is not None else []
    return [f"{c}.{k}" for c in named for k in _homogeneous(all_sites[c])]


def find_layers(all_sites: dict[str, Site]) -> list[str]:
    """A model without repeated blocks (a user's `nn.Sequential(Linear, ReLU, Linear)`, a small custom net):
    every child of the root that holds parameters, in registration order, each a target of its own, so that
    such a model is covered layer by layer instead of not at all. Parameters held by the root itself are
    outside every target (coverage names them)."""
    root = all_sites[""].inner
    return [
        name
        for name, child in root._modules.items()
        if child is not None and any(True for _ in unwrap(child).parameters()) and not tensor_parallel_io(child)
    ]


def find_embeddings(all_sites: dict[str, Site], blocks: list[str]) -> list[str]:
    """Every nn.Embedding outside the blocks (token and learned position embeddings), in registration order."""
    return [p for p, s in all_sites.items() if p and isinstance(s.inner, nn.Embedding) and not _inside(p, blocks)]


def find_head(all_sites: dict[str, Site], blocks: list[str], embeddings: list[str]) -> str | None:
    """The output projection: a Linear outside the blocks named like a head, else the last Linear outside the
    blocks whose output size is the vocabulary, else the last Linear outside them. Weight-tied heads (GPT-2's
    lm_head shares wte.weight) are modules of their own and are found like any other."""
    linears = [p for p, s in all_sites.items() if p and isinstance(s.inner, nn.Linear) and not _inside(p, blocks)]
    if not linears:
        return None
    for p in reversed(linears):
        if p.rsplit(".", 1)[-1] in HEAD_NAMES:
            return p
    vocab = {all_sites[e].inner.num_embeddings for e in embeddings}
    for p in reversed(linears):
        if all_sites[p].inner.out_features in vocab:
            return p
    return linears[-1]


def discover(model: nn.Module, optimizer=None) -> list[tuple[str, str]]:
    """(recipe, user path) for the embedding(s), every block in order, the head, and `optimizer` when given.

    Raises NoTargets when no repeated blocks are found: pass `targets=` (user paths, see `describe`)."""
    all_sites = sites(model)
    blocks = find_blocks(all_sites)
    if not blocks:
        layers = find_layers(all_sites)
        if layers:
            targets = [("embedding" if isinstance(all_sites[p].inner, nn.Embedding) else "block", p) for p in layers]
            return targets + ([("optimizer", OPTIMIZER)] if optimizer is not None else [])
        root = original_class(all_sites[""].inner).__name__
        if tensor_parallel_targets(model):
            raise NoTargets(
                f"every layer of {root} that holds parameters is itself tensor-parallel (parallelize_module's "
                f"hooks turn its inputs and outputs into shards), which a replay of the whole layer on one rank "
                f"cannot take; replay covers blocks that hold tensor-parallel layers: name them with targets=, or "
                f"turn replay off with replay=False"
            )
        raise NoTargets(
            f"replay found no repeated blocks in {root} (looked for a ModuleList/ModuleDict/Sequential of "
            f"same-class layers); name them with targets=, e.g. Checkpointer(replay=ReplayOptions(targets="
            f"{_example(all_sites)})), or turn replay off with replay=False"
        )
    embeddings = [e for e in find_embeddings(all_sites, blocks) if not tensor_parallel_io(all_sites[e].outer)]
    head = find_head(all_sites, blocks, embeddings)
    targets = [("embedding", e) for e in embeddings] + [("block", b) for b in blocks]
    if head is not None and not tensor_parallel_io(all_sites[head].outer):
        targets.append(("head", head))
    if optimizer is not None:
        targets.append(("optimizer", OPTIMIZER))
    return targets


def _example(all_sites: dict[str, Site]) -> list[str]:
    kids = [p for p in all_sites if p and "." not in p][:3]
    return kids or ["<submodule path>"]


def resolve(model: nn.Module, targets, optimizer=None) -> list[tuple[str, str]]:
    """User-given targets -> (recipe, user path). Each is a (recipe, path) pair or a path alone (recipe guessed:
    `optimizer`, an nn.Embedding -> embedding, anything else -> block). Paths may be user paths or spelled with
    wrapper components (`module.transformer.h.0`)."""
    all_sites = sites(model)
    out: list[tuple[str, str]] = []
    for t in targets:
        recipe, name = (t[0], t[1]) if isinstance(t, (tuple, list)) else (None, str(t))
        if name == OPTIMIZER and recipe in (None, "optimizer"):
            out.append(("optimizer", OPTIMIZER))
            continue
        path = name if name in all_sites else _try_user_path(model, name)
        if path is None or path == "":
            raise NoTargets(
                f"replay target {name!r} is not a submodule of the model (user paths look like {_example(all_sites)})"
            )
        if recipe is None:
            recipe = "embedding" if isinstance(all_sites[path].inner, nn.Embedding) else "block"
        out.append((recipe, path))
    if not out:
        raise NoTargets("replay targets= is empty: name at least one submodule, or turn replay off")
    return out


def _try_user_path(model: nn.Module, raw: str) -> str | None:
    try:
        return user_path(model, raw)
    except KeyError:
        return None


__all__ = [
    "OPTIMIZER",
    "NoTargets",
    "Site",
    "discover",
    "find_blocks",
    "find_embeddings",
    "find_head",
    "find_layers",
    "original_class",
    "resolve",
    "runs_compiled",
    "sites",
    "unwrap",
    "user_path",
]
