"""The package's wings and the directions they may import in, declared once (LAYERS) and checked from the code's
own import statements (stdlib `ast`, every `import` in a module, function-level ones included).

A wing may import its own modules and the wings of lower layers, never a wing of its own layer or above; no
module may take part in an import cycle, inside a wing or across wings. docs/design.md ("The house") explains
the layers; a change that needs an upward import registers what it adds with the lower layer instead (as the
Hugging Face folder layout does with format/layout.py)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "scout_ckpt"

# Lowest first. Top-level modules are wings of their own (errors, policy, options, checkpointer, cli).
LAYERS: list[set[str]] = [
    {"errors", "policy"},                  # pure: exit codes, the one policy
    {"options"},                           # the Checkpointer's options as validated dataclasses
    {"consensus", "invariants"},           # C3 signatures and verdicts; model-intrinsic checks
    {"format"},                            # the on-disk truth: layout, manifest, digests, DCP readers, verify
    {"object_store"},                      # the S3 / fsspec backend of the format
    {"ledger"},                            # the SQLite ledger and the journal beside the data
    {"ops", "observer", "replay"},         # offline operations on a ROOT; the observer; SDC replay
    {"save", "report"},                    # what runs inside a job; the fault timeline
    {"checkpointer"},                      # the facade a training script holds
    {"integrations", "testing"},           # optional framework drop-ins; gloo ranks for tests and benches
    {"demo"},                              # the runnable job with fault injection
    {"cli"},                               # the thin command line
]
LEVEL = {wing: i for i, layer in enumerate(LAYERS) for wing in layer}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _lazy_names() -> dict[str, str]:
    """`scout_ckpt.__init__`'s PEP 562 table: `from scout_ckpt import Checkpointer` imports the module it names."""
    tree = ast.parse((PKG / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


LAZY = _lazy_names()


def _resolve(name: str) -> str | None:
    """The package module a dotted name refers to (the longest prefix that is a module)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(mod: str, path: Path) -> set[str]:
    found: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = []
            for a in node.names:
                if module == "scout_ckpt" and a.name in LAZY:
                    targets.append(LAZY[a.name])
                else:
                    targets.append(f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module)
        else:
            continue
        for t in targets:
            if t.split(".")[0] != "scout_ckpt":
                continue
            r = _resolve(t)
            if r is not None and r != mod and r != "scout_ckpt":   # the root package imports nothing eagerly
                found.add(r)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def wing(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def test_every_wing_is_declared():
    wings = {wing(m) for m in MODULES} - {"<root>"}
    assert wings <= set(LEVEL), f"declare these wings in LAYERS: {sorted(wings - set(LEVEL))}"


def test_no_import_goes_up_or_sideways():
    bad = []
    for mod, targets in GRAPH.items():
        if mod == "scout_ckpt":
            continue
        for t in targets:
            a, b = wing(mod), wing(t)
            if a != b and LEVEL[b] >= LEVEL[a]:
                bad.append(f"{mod} -> {t} ({a} at layer {LEVEL[a]}, {b} at layer {LEVEL[b]})")
    assert not bad, "imports against the declared layers:\n" + "\n".join(sorted(bad))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_a_cycle_and_an_upward_import():
    """The checks above can fail: a cycle and an upward edge added to a copy of the real graph are found."""
    graph = {m: set(t) for m, t in GRAPH.items()}
    graph["scout_ckpt.format.layout"].add("scout_ckpt.ops.recovery")
    assert any("scout_ckpt.format.layout" in c and "scout_ckpt.ops.recovery" in c for c in _cycles(graph))
    assert LEVEL[wing("scout_ckpt.ops.recovery")] > LEVEL[wing("scout_ckpt.format.layout")]
