"""The import graph of our packages: no module imports itself through others (counting imports
under TYPE_CHECKING and inside functions, which hide a circle until a refactor makes one run
first), and imports run the one way docs/architecture.md draws."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import ROOT

PACKAGES = ("pipeline", "partitioner", "scheduler", "viz")

# What each layer may import of ours besides itself (docs/architecture.md, "The folders and
# the direction of imports"). The facade layer is pipeline/__init__, api, facade/, checkpoint/
# and elastic/; the app sits on top of everything.
MAY_IMPORT = {
    "scheduler": set(),
    "partitioner": {"scheduler"},
    "viz": {"scheduler"},
    "planning": {"partitioner", "scheduler"},
    "execution": {"planning", "partitioner", "scheduler"},
    "facade": {"execution", "planning", "partitioner", "scheduler"},
    "app": {"facade", "execution", "planning", "partitioner", "scheduler", "viz"},
}
FACADE = {"api", "facade", "checkpoint", "elastic"}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of our packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere in its text (an ``import a.b.c`` or
    ``from a.b import c`` names the deepest of a.b.c, a.b, a that is a module)."""

    def resolve(name: str) -> str | None:
        while name and name not in found:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.update(resolve(f"{node.module}.{a.name}") for a in node.names)
            elif isinstance(node, ast.Import):
                targets.update(resolve(a.name) for a in node.names)
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "pipeline":
        return parts[0]
    if len(parts) == 1 or parts[1] in FACADE:
        return "facade"
    return parts[1]


def test_cycles_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    circles = cycles(import_graph(modules()))
    assert not circles, "import cycles (each a set of modules importing each other): " + "; ".join(
        " <-> ".join(c) for c in circles
    )


def test_imports_follow_the_layers() -> None:
    graph = import_graph(modules())
    wrong = sorted(
        f"{module} ({layer(module)}) imports {target} ({layer(target)})"
        for module, targets in graph.items()
        for target in targets
        if layer(target) != layer(module) and layer(target) not in MAY_IMPORT[layer(module)]
    )
    assert not wrong, "imports against docs/architecture.md's direction:\n" + "\n".join(wrong)


def test_model_code_imports_no_parallelism() -> None:
    graph = import_graph(modules())
    assert graph["pipeline.app.models"] <= {"pipeline.app"}, graph["pipeline.app.models"]


def test_the_executor_owns_the_distributed_difference() -> None:
    """Only execution/ (and the app on top) knows the distributed executor: the facade,
    checkpoints and elastic training reach it through `Executor` methods and `Processes`."""
    graph = import_graph(modules())
    wrong = sorted(
        f"{module} imports {target}" for module, targets in graph.items()
        for target in targets
        if target.startswith("pipeline.execution.distributed")
        and layer(module) not in ("execution", "app")
    )
    assert not wrong, "only execution/ and app/ import execution.distributed:\n" + "\n".join(
        wrong)
    named = [path for name, path in modules().items() if layer(name) not in ("execution", "app")
             and any(text in path.read_text()
                     for text in ("DistributedExecutor", "execution.distributed"))]
    assert not named, f"modules naming the distributed executor outside execution/: {named}"


def test_another_torch_release_is_refused_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """partitioner checks the running torch first when imported (before any of torch's
    private APIs; pipeline's modules import partitioner before their own): another release
    than the tested 2.14.x is an ImportError naming the version found and the fix."""
    import importlib

    import torch

    from partitioner import torch_version

    tree = ast.parse((ROOT / "partitioner" / "__init__.py").read_text())
    first = next(n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))
    assert ast.unparse(first) == "from partitioner import torch_version"
    torch_version.check_torch("2.14.1+cu130")  # the tested release, any patch or build
    monkeypatch.delenv(torch_version.ALLOW_UNTESTED, raising=False)
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    with pytest.raises(ImportError, match=r"needs torch 2\.14\.x .* torch 2\.15\.0 is "
                                          r"installed; install it with pip install "
                                          r"'torch==2\.14\.\*' 'torchvision==0\.29\.\*'"):
        importlib.reload(torch_version)
    monkeypatch.setenv(torch_version.ALLOW_UNTESTED, "1")
    importlib.reload(torch_version)  # allowed: imports
