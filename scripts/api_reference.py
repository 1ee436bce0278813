"""Write docs/api.md, the API reference, from the code: every public name of `scout_ckpt` and of each framework
integration (its `__all__`), with its signature and docstring, the option dataclasses' fields, and each
exception's exit code.

`python scripts/api_reference.py` rewrites the page; `--check` exits 1 (one line) when the page is not what the
code says or a public call's docstring has no `Args:` section, as `make lint` runs it in CI. `--missing-args` lists the public calls whose docstring
has no `Args:` section. The integrations are documented only where their framework imports (the `make test`
environment has them all); a module that does not import is named on the page as such.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
PAGE = REPO / "docs" / "api.md"

# The integrations whose module paths are part of the contract, in the order the README introduces them.
INTEGRATIONS = (
    "scout_ckpt.integrations.transformers",
    "scout_ckpt.integrations.torchtitan",
    "scout_ckpt.integrations.lightning",
    "scout_ckpt.integrations.accelerate",
    "scout_ckpt.integrations.deepspeed",
    "scout_ckpt.integrations.megatron",
)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _default(value) -> str:
    return _ADDRESS.sub("", repr(value))


def signature(obj, name: str) -> str:
    """`name(param: annotation = default, ...) -> return`, from the annotations as written (strings)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return f"{name}(...)"
    parts, star = [], False
    for p in sig.parameters.values():
        if p.name in ("self", "cls"):
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        text = {p.VAR_POSITIONAL: f"*{p.name}", p.VAR_KEYWORD: f"**{p.name}"}.get(p.kind, p.name)
        star = star or p.kind is p.VAR_POSITIONAL
        if p.annotation is not p.empty:
            text += f": {p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)}"
        if p.default is not p.empty:  # PEP 8: spaces around `=` only after an annotation
            text += f" = {_default(p.default)}" if p.annotation is not p.empty else f"={_default(p.default)}"
        parts.append(text)
    out = f"{name}({', '.join(parts)})"
    if sig.return_annotation is not sig.empty:
        ra = sig.return_annotation
        out += f" -> {ra if isinstance(ra, str) else inspect.formatannotation(ra)}"
    return out


def _doc(obj) -> str:
    return inspect.cleandoc(obj.__doc__) if obj.__doc__ else "(no docstring)"


def _takes_arguments(fn) -> bool:
    try:
        params = [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]
    except (TypeError, ValueError):
        return False
    return bool(params)


def public_methods(cls) -> list[tuple[str, object]]:
    """Methods and properties a class defines itself (not object's), public names only, in definition order."""
    out = []
    for name, member in cls.__dict__.items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isfunction(member) or isinstance(member, property):
            out.append((name, member))
    return out


def _overrides(cls, name: str, module) -> bool:
    """Does `name` override a method of a base class (a framework's hook, Stateful's load_state_dict): a call
    the framework makes, documented by the framework. A mixin's method counts where a class of its module mixes
    it into a base that defines the name (Lightning's strategies)."""
    if name == "__init__":
        return False
    if any(name in vars(base) for base in cls.__mro__[1:] if base is not object):
        return True
    for other in vars(module).values():
        if inspect.isclass(other) and other is not cls and issubclass(other, cls):
            if any(
                name in vars(b) for b in other.__mro__ if b is not object and b not in cls.__mro__ and b is not other
            ):
                return True
    return False


def calls(module_name: str, names: list[str]) -> list[tuple[str, object]]:
    """(qualified name, function) for every public call a user makes: functions, and classes' __init__ and
    methods (not the overrides of a framework's hooks)."""
    mod = importlib.import_module(module_name)
    out = []
    for n in names:
        obj = getattr(mod, n)
        if inspect.isclass(obj) and not issubclass(obj, BaseException) and not dataclasses.is_dataclass(obj):
            for m, member in public_methods(obj):
                if inspect.isfunction(member) and not _overrides(obj, m, mod):
                    out.append((f"{n}.{m}", member))
        elif inspect.isfunction(obj):
            out.append((n, obj))
    return out


def _entry(name: str, obj, lines: list[str]) -> None:
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        lines += [f"### `{name}`", "", f"Exception ({obj.__mro__[1].__name__}); exit code {obj.exit_code}."]
        lines += ["", _doc(obj), ""]
        return
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        lines += [f"### `{name}`", "", "```python", signature(obj, name), "```", "", _doc(obj), ""]
        lines += ["| field | type | default |", "|---|---|---|"]
        for f in dataclasses.fields(obj):
            default = (
                _default(f.default)
                if f.default is not dataclasses.MISSING
                else ("(factory)" if f.default_factory is not dataclasses.MISSING else "(required)")
            )
            lines.append(f"| `{f.name}` | `{f.type}` | `{default}` |")
        lines.append("")
        return
    if inspect.isclass(obj):
        lines += [f"### `{name}`", "", "```python", signature(obj, name), "```", "", _doc(obj), ""]
        for m, member in public_methods(obj):
            if m == "__init__":
                continue
            if isinstance(member, property):
                lines += [f"#### `{name}.{m}` (property)", "", _doc(member.fget), ""]
            else:
                lines += [f"#### `{name}.{m}`", "", "```python", signature(member, m), "```", "", _doc(member), ""]
        return
    if callable(obj):
        lines += [f"### `{name}`", "", "```python", signature(obj, name), "```", "", _doc(obj), ""]
        return
    lines += [f"### `{name}`", "", f"`{_default(obj)}`", ""]


def render() -> str:
    import scout_ckpt

    lines = [
        "# API reference",
        "",
        "Generated from the code by `python scripts/api_reference.py` (`make lint`, in CI, checks that it is",
        "current). The guides are [integrate.md](integrate.md) and the README; this page is the signatures and",
        "docstrings of every public name.",
        "",
        "## `scout_ckpt`",
        "",
    ]
    for name in scout_ckpt.__all__:
        if name == "__version__":
            continue
        _entry(name, getattr(scout_ckpt, name), lines)
    for module_name in INTEGRATIONS:
        lines += [f"## `{module_name}`", ""]
        try:
            mod = importlib.import_module(module_name)
        except ImportError as e:
            lines += [f"(not imported here: {e.name} is not installed)", ""]
            continue
        lines += [inspect.cleandoc(mod.__doc__).split("\n\n")[0] if mod.__doc__ else "", ""]
        for name in mod.__all__:
            _entry(name, getattr(mod, name), lines)
    return "\n".join(lines).rstrip() + "\n"


def missing_args() -> list[str]:
    """Public calls that take arguments and whose docstring has no `Args:` section."""
    import scout_ckpt

    out = []
    groups = [("scout_ckpt", [n for n in scout_ckpt.__all__ if n != "__version__"])]
    for module_name in INTEGRATIONS:
        try:
            groups.append((module_name, list(importlib.import_module(module_name).__all__)))
        except ImportError:
            continue
    for module_name, names in groups:
        for qual, fn in calls(module_name, names):
            doc = fn.__doc__ or ""
            if qual.endswith(".__init__"):
                cls = getattr(importlib.import_module(module_name), qual.split(".")[0])
                doc = (cls.__doc__ or "") + doc
            if _takes_arguments(fn) and "Args:" not in doc:
                out.append(f"{module_name}.{qual}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/api.md is not current")
    ap.add_argument("--missing-args", action="store_true", help="list public calls without an Args: section")
    args = ap.parse_args()
    if args.missing_args:
        for name in missing_args():
            print(name)
        return 0
    text = render()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print("docs/api.md is not current: run `python scripts/api_reference.py`", file=sys.stderr)
            return 1
        missing = missing_args()
        if missing:
            print(f"public calls without an Args: section in their docstring: {', '.join(missing)}", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
