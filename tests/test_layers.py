"""The package's wings and the directions they may import in, declared once (LAYERS) and checked from the code's
own import statements (stdlib `ast`, every `import` in a module, function-level ones included).

A wing may import its own modules and the wings of lower layers, never a wing of its own layer or above; no
module may take part in an import cycle, inside a wing or across wings. docs/design.md ("The house") explains
the layers; a change that needs an upward import registers what it adds with the lower layer instead (as the
Hugging Face folder layout does with format/layout.py).

The read-only commands (ls, explain, resume, report, suspects) never import torch: from each command's function in cli.py,
every package function or class it may call is followed (names bound by imports, module-level or lazy, and the
module's own definitions; a class counts with all its methods), and neither the imports those functions make nor
what their modules import when loaded may reach torch. An over-approximation (a branch not taken still counts),
so a lazy `import torch` anywhere on those paths fails it; tests/test_cli.py runs the commands on a real ROOT
and checks sys.modules too."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "scout_ckpt"

# Lowest first. Top-level modules are wings of their own (errors, policy, options, checkpointer, cli).
LAYERS: list[set[str]] = [
    {"errors", "policy"},  # pure: exit codes, the one policy
    {"options"},  # the Checkpointer's options as validated dataclasses
    {"consensus", "invariants"},  # C3 signatures and verdicts; model-intrinsic checks
    {"format"},  # the on-disk truth: layout, manifest, digests, DCP readers, verify
    {"object_store"},  # the S3 / fsspec backend of the format
    {"ledger"},  # the SQLite ledger and the journal beside the data
    {"ops", "observer", "replay", "fleet"},  # offline operations on a ROOT; the observer; SDC replay; fleet memory
    {"save", "report"},  # what runs inside a job; the fault timeline
    {"checkpointer"},  # the facade a training script holds
    {"integrations", "testing"},  # optional framework drop-ins; gloo ranks for tests and benches
    {"demo"},  # the runnable job with fault injection
    {"commands"},  # what each CLI command prints and the exit code it returns
    {"cli"},  # the thin command line: the commands' names, options, help
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
            if r is not None and r != mod and r != "scout_ckpt":  # the root package imports nothing eagerly
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


# ---- the read-only commands never import torch -----------------------------------------------------------------

READ_ONLY_COMMANDS = ("ls", "explain", "resume", "report", "suspects")


def _outside_functions(nodes):
    """The statements a module runs when it is imported: everything but function bodies (and `if TYPE_CHECKING`)."""
    for n in nodes:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            yield from _outside_functions(n.orelse)
            continue
        yield n
        yield from _outside_functions(ast.iter_child_nodes(n))


def _from_module(mod: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if MODULES[mod].name == "__init__.py" else mod.split(".")[:-1]
    return ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))


def _bindings(mod: str, nodes) -> dict[str, str]:
    """Local name -> the dotted name it is bound to, for the import statements among `nodes`."""
    out = {}
    for n in nodes:
        if isinstance(n, ast.Import):
            for a in n.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(n, ast.ImportFrom):
            for a in n.names:
                out[a.asname or a.name] = f"{_from_module(mod, n)}.{a.name}"
    return out


TREES = {m: ast.parse(p.read_text()) for m, p in MODULES.items()}
LOADS = {m: _bindings(m, _outside_functions(TREES[m].body)) for m in MODULES}  # what importing m binds
DEFS = {m: {n.name: n for n in TREES[m].body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} for m in MODULES}


def _loaded_externals(mod: str) -> dict[str, str]:
    """Top-level names of the non-package modules that importing `mod` loads (with its parent packages and
    everything they import when loaded), each with the package module that imports it."""
    out: dict[str, str] = {}
    seen: set[str] = set()
    todo = [mod]
    while todo:
        m = todo.pop()
        parts = m.split(".")
        todo.extend(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in MODULES and p not in seen)
        if m in seen:
            continue
        seen.add(m)
        for target in LOADS[m].values():
            if target.split(".")[0] == "scout_ckpt":
                r = _resolve(target)
                if r is not None and r not in seen:
                    todo.append(r)
            else:
                out.setdefault(target.split(".")[0], m)
    return out


def _definition(dotted: str, depth: int = 0) -> tuple[str, ast.AST] | None:
    """The package function or class a dotted name refers to (following re-exports), or None."""
    mod, _, name = dotted.rpartition(".")
    if mod not in MODULES or depth > 8:
        return None
    if name in DEFS[mod]:
        return mod, DEFS[mod][name]
    target = LOADS[mod].get(name)
    return _definition(target, depth + 1) if target and target != dotted else None


def _reached_externals(start: str) -> dict[str, str]:
    """Every non-package module the functions reachable from `start` (a dotted function name) may import,
    lazily or by loading a package module, each with one function on the way."""
    out: dict[str, str] = {}
    seen: set[str] = set()
    todo = [start]
    while todo:
        dotted = todo.pop()
        found = _definition(dotted)
        if dotted in seen or found is None:
            continue
        seen.add(dotted)
        mod, node = found
        lazy = _bindings(mod, ast.walk(node))
        for m in {mod, *(_resolve(t) for t in lazy.values() if t.split(".")[0] == "scout_ckpt")} - {None}:
            for ext in _loaded_externals(m):
                out.setdefault(ext, f"{dotted} (loading {m})")
        for t in lazy.values():
            if t.split(".")[0] != "scout_ckpt":
                out.setdefault(t.split(".")[0], dotted)
        names = {**LOADS[mod], **{k: f"{mod}.{k}" for k in DEFS[mod]}, **lazy}
        for n in ast.walk(node):  # calls and references (a function handed on is called too)
            if isinstance(n, ast.Name) and n.id in names:
                todo.append(names[n.id])
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in names:
                todo.append(f"{names[n.value.id]}.{n.attr}")
        if isinstance(node, ast.ClassDef):
            todo.extend(f"{mod}.{node.name}.{m.name}" for m in node.body if isinstance(m, ast.FunctionDef))
    return out


def _command_function(command: str) -> str:
    """The dotted name of the function cli.py declares for `command`."""
    for name, node in DEFS["scout_ckpt.cli"].items():
        for d in getattr(node, "decorator_list", []):
            if isinstance(d, ast.Call) and d.args and getattr(d.args[0], "value", None) == command:
                return f"scout_ckpt.cli.{name}"
    raise AssertionError(f"cli.py declares no command {command!r}")


def test_read_only_commands_never_reach_torch():
    bad = {}
    for command in READ_ONLY_COMMANDS:
        reached = _reached_externals(_command_function(command))
        if "torch" in reached:
            bad[command] = reached["torch"]
    assert not bad, "read-only commands that may import torch (command: through):\n" + "\n".join(
        f"{c}: {why}" for c, why in sorted(bad.items())
    )


def test_the_torch_check_sees_a_command_that_imports_torch():
    """The check above can fail: certify, which reads tensors with torch, is found to reach it; and a module that
    imports torch when loaded (replay's runner) is found by what loading it imports."""
    assert "torch" in _reached_externals(_command_function("certify"))
    assert _loaded_externals("scout_ckpt.replay.runner").get("torch") == "scout_ckpt.replay.runner"
