"""No function of our packages runs over 80 lines (STYLE: a function does one job; a longer one
is split by job). A function's length runs from its ``def`` line to its last line, docstring,
comments and nested functions included, decorators not; methods and nested functions count
on their own too."""

from __future__ import annotations

import ast

from tests.support import ROOT

PACKAGES = ("pipeline", "partitioner", "scheduler", "viz")
LIMIT = 80


def long_functions(source: str, filename: str, limit: int = LIMIT) -> list[str]:
    """'file:line name (N lines)' for each function in `source` longer than `limit` lines."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > limit:
                found.append(f"{filename}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_library_function_over_the_limit() -> None:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += long_functions(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, f"functions over {LIMIT} lines; split each by job:\n" + "\n".join(found)


def _function(name: str, lines: int, indent: str = "", decorators: int = 0) -> str:
    """Source of a function `lines` long (def line included), after `decorators` decorators."""
    head = [f"{indent}@staticmethod"] * decorators + [f"{indent}def {name}() -> None:"]
    return "\n".join(head + [f"{indent}    x = {i}" for i in range(lines - 1)]) + "\n"


def test_the_measure_counts_from_def_to_last_line() -> None:
    assert long_functions(_function("fits", 80), "m.py") == []
    assert long_functions(_function("over", 81), "m.py") == ["m.py:1 over (81 lines)"]
    # Decorators are not the function's lines.
    decorated = "class C:\n" + _function("method", 80, indent="    ", decorators=5)
    assert long_functions(decorated, "m.py") == []
    # Methods, coroutines and nested functions are measured on their own (a parent's length
    # counts its nested functions' lines too).
    method = "class C:\n" + _function("method", 81, indent="    ")
    assert long_functions(method, "m.py") == ["m.py:2 method (81 lines)"]
    coroutine = _function("co", 81).replace("def ", "async def ", 1)
    assert long_functions(coroutine, "m.py") == ["m.py:1 co (81 lines)"]
    nested = "def outer() -> None:\n" + _function("inner", 81, indent="    ")
    assert sorted(long_functions(nested, "m.py")) == [
        "m.py:1 outer (82 lines)",
        "m.py:2 inner (81 lines)",
    ]
