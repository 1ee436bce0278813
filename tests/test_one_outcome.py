"""Every assertion in tests/ judges one outcome: none accepts either of two opposite outcomes, as
`assert rc in (0, 1)`, `assert status in ("pass", "fail")` or `assert by in ("save", "load")` would (it passes
whichever way the code went, so it proves nothing about which). A test that cannot tell in advance which outcome
is right derives it from its own setup (the placement, what the records say happened) and asserts that one.

Checked from the tests' own syntax (stdlib `ast`): an `in` test inside an `assert` whose right side is a literal
tuple, list or set holding two or more members of one outcome vocabulary below: exit codes (0 with any other
small integer or a signal), evidence and checkpoint states, the two sides of a save or a load, who recorded an
event, booleans. A membership test that filters a comprehension (`[e for e in events if e["kind"] in (...)]`)
selects what is judged and is not itself a judgement, so it is not counted. A legitimate case (a set of values
that are all correct, not opposite outcomes) goes into ALLOWED with the reason."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# Outcomes that exclude one another: an assertion accepting two of them accepts both answers to one question.
STATES = {
    "pass",
    "fail",
    "not_applicable",
    "inconclusive",
    "missing",
    "certified",
    "rejected",
    "committed",
    "quarantined",
    "writing",
    "deleted",
    "partial",
    "ok",
    "failed",
    "timeout",
    "agree",
    "disagree",
}
ROADS = {"save", "load", "observer", "previous_generation", "checkpointer", "live", "aftermath"}
EXIT_NAMES = ("rc", "returncode", "exitcode", "exit_code", "code", "status")

# "path::function" -> why its membership test holds values that are all right, not opposite outcomes.
ALLOWED: dict[str, str] = {}


def _constant(node: ast.AST) -> object:
    """The literal value of a member (a negated number or a `signal.SIGX` counts as an exit code), else a marker."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _constant(node.operand)
        return -inner if isinstance(inner, int) and not isinstance(inner, bool) else "signal"
    if isinstance(node, ast.Attribute) and node.attr.startswith("SIG"):
        return "signal"
    return None


def _names(node: ast.AST) -> str:
    """The names and string keys on the left of the test, lower-cased (what the value is: an rc, a status...)."""
    parts = []
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            parts.append(n.id)
        elif isinstance(n, ast.Attribute):
            parts.append(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            parts.append(n.value)
    return " ".join(parts).lower()


def opposite_outcomes(left: ast.AST, members: list[ast.AST]) -> str | None:
    """Why `left in members` accepts opposite outcomes, or None."""
    values = [_constant(m) for m in members]
    strings = {v for v in values if isinstance(v, str) and v != "signal"}
    if len(strings & STATES) >= 2:
        return f"states {sorted(strings & STATES)}"
    if len(strings & ROADS) >= 2:
        return f"roads {sorted(strings & ROADS)}"
    if {True, False} <= {v for v in values if isinstance(v, bool)}:
        return "True and False"
    codes = [v for v in values if (isinstance(v, int) and not isinstance(v, bool) and abs(v) < 256) or v == "signal"]
    if 0 in codes and len(codes) >= 2 or "signal" in codes and len(codes) >= 2:
        if any(name in _names(left) for name in EXIT_NAMES):
            return f"exit codes {codes}"
    return None


def _filters(tree: ast.AST) -> set[int]:
    """ids of the nodes that filter a comprehension (its `if` clauses) and everything under them."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.comprehension):
            for cond in node.ifs:
                out.update(id(n) for n in ast.walk(cond))
    return out


def findings(source: str, filename: str = "<test>") -> list[tuple[str, int, str]]:
    """(function, line, why) for every both-outcome membership test inside an assert of `source`."""
    tree = ast.parse(source, filename)
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            continue
        body_asserts = [n for n in ast.walk(func) if isinstance(n, ast.Assert)]
        for a in body_asserts:
            skip = _filters(a.test)
            for node in ast.walk(a.test):
                if not isinstance(node, ast.Compare) or id(node) in skip:
                    continue
                for op, right in zip(node.ops, node.comparators, strict=True):
                    if isinstance(op, ast.In) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
                        why = opposite_outcomes(node.left, right.elts)
                        if why:
                            name = func.name if not isinstance(func, ast.Module) else "<module>"
                            found.append((name, node.lineno, why))
    # an assert inside a function is also under the module: keep the innermost name for each line
    best: dict[int, tuple[str, int, str]] = {}
    for f in found:
        if f[1] not in best or best[f[1]][0] == "<module>":
            best[f[1]] = f
    return sorted(best.values(), key=lambda f: f[1])


def test_the_checker_catches_both_outcome_assertions_and_passes_single_ones():
    """The checker judged on snippets whose answer is known by construction."""
    caught = [
        "assert rc in (0, 1)",
        "assert p.returncode in (0, 2) and ok",
        "assert all(o.exitcode in (-signal.SIGKILL, 1) for o in outs)",
        "assert ev['status'] in ('pass', 'not_applicable')",
        "assert row['checked']['by'] in ('save', 'load')",
        "assert g['detected_by'] in ['observer', 'previous_generation']",
        "assert flag in {True, False}",
    ]
    passed = [
        "assert rc == 0",
        "assert step in (11, 12)",  # numbers that are not exit codes
        "assert not [e for e in evs if e['kind'] in ('crash', 'hang')]",  # a filter selects, it does not judge
        "assert x in (0, 1)",  # not named as an exit code
        "assert ev['status'] == 'pass'",
        "assert name in ('a', 'b')",
    ]
    for src in caught:
        assert len(findings(f"def t():\n    {src}\n")) == 1, src
    for src in passed:
        assert findings(f"def t():\n    {src}\n") == [], src


def test_no_assertion_in_tests_accepts_opposite_outcomes():
    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        for func, line, why in findings(path.read_text(), str(path)):
            if f"{rel}::{func}" not in ALLOWED:
                bad.append(f"tests/{rel}:{line} ({func}): {why}")
    assert bad == [], "assertions that accept opposite outcomes:\n" + "\n".join(bad)


@pytest.mark.parametrize("key", sorted(ALLOWED) or ["(none)"])
def test_every_allowed_case_still_exists_and_says_why(key):
    if key == "(none)":
        return
    rel, func = key.split("::")
    assert ALLOWED[key].strip()
    assert func in {f for f, _, _ in findings((TESTS / rel).read_text())}, f"{key} no longer needs its entry"
