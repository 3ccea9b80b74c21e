"""Capture a model as a `Captured` record of units: export it with torch.export (non-strict; the
default) and group its aten nodes by module, or trace it with torch.fx (fallback, or for
sequential models take its top-level children in order); propagate shapes on the example input
and record per unit its output shape/dtype/bytes and parameter bytes, per edge the bytes it
moves. Each way is a front end in `FRONT_ENDS`; all return the same record, whose units are runs
of nodes of one flat fx graph over the model's own parameters, which `split_model` cuts into
stages."""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import operator
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils._pytree import TreeSpec, tree_flatten

from partitioner.autocast import inline_regions
from partitioner.captured import Captured, Method, Value
from partitioner.exported import (
    Unflatten,
    export_flat,
    group_units,
    is_symbolic,
    non_persistent_buffers,
    unit_key,
    unit_module,
)
from partitioner.inputs import (
    call_structure,
    check_inputs,
    input_dims,
    mode_sensitive,
    modes,
)
from partitioner.sandbox import sandbox
from partitioner.traced import (
    CaptureError,
    bind_kwargs,
    fx_units,
    is_default_leaf,
    leaf_rule,
    sequential_graph_module,
    trace,
)

__all__ = [
    "FRONT_ENDS",
    "METHODS",
    "CaptureError",
    "Captured",
    "aliases",
    "call_structure",
    "capture",
    "check_inputs",
    "is_default_leaf",
    "nbytes",
]

METHODS = ("auto", "export", "fx")
log = logging.getLogger("hybridpipe")


def _flat_tensors(value: Any) -> Iterator[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return (leaf for leaf in leaves if isinstance(leaf, torch.Tensor))


def nbytes(value: Any) -> int:
    """Bytes of every tensor inside `value` (a tensor or a nested tuple/list/dict)."""
    return sum(t.numel() * t.element_size() for t in _flat_tensors(value))


class _Recorder(fx.Interpreter):
    """Runs the graph once, recording each node's output metadata (shape propagation)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.meta: dict[str, dict[str, Any]] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        is_tensor = isinstance(result, torch.Tensor)
        self.meta[n.name] = {
            "shape": tuple(result.shape) if is_tensor else None,
            "dtype": str(result.dtype) if is_tensor else type(result).__name__,
            "bytes": nbytes(result),
            "tensor": is_tensor,
        }
        return result


def _unit_bases(
    model: nn.Module, units: list[tuple[str, list[str]]], front: str, rule: Any
) -> list[str]:
    """Names for the units (unit_module makes them unique): fx units keep their node's name;
    an exported unit of a leaf module, or of several ops of one module, is named after the
    module's path (dots as underscores, as fx names call_module nodes); a single op keeps
    its node's name (as fx would name it)."""
    bases = []
    for key, members in units:
        whole = False
        if front == "export" and key:
            try:
                whole = len(members) > 1 or rule(model.get_submodule(key.split("@")[0]))
            except AttributeError:
                whole = len(members) > 1
        bases.append(key.replace(".", "_").replace("@", "_") if whole else members[0])
    return bases


def _unit_params(gm: fx.GraphModule, nodes: dict[str, fx.Node], members: list[str]) -> int:
    """Bytes of the distinct parameters a unit's nodes read (directly or in submodules)."""
    seen: dict[int, int] = {}
    for name in members:
        n = nodes[name]
        found: list[Any] = []
        if n.op == "call_module":
            found = list(gm.get_submodule(str(n.target)).parameters())
        for arg in n.all_input_nodes:
            if arg.op == "get_attr":
                found.append(_fetch(gm, str(arg.target)))
        for p in found:
            if isinstance(p, nn.Parameter):
                seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


def _fetch(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _target_name(n: fx.Node) -> str:
    if isinstance(n.target, str):
        return n.target
    if n.target in (operator.add, operator.mul, operator.getitem):
        return f"operator.{n.target.__name__}"
    return getattr(n.target, "__qualname__", None) or str(n.target)


@contextlib.contextmanager
def _no_cache(model: nn.Module) -> Iterator[None]:
    """Hugging Face models return a KV cache when config.use_cache is set: training needs
    none, and torch.export cannot return one, so capture runs with it off: in every config of
    the model, since a submodule may hold a copy of its own (T5's decoder stack)."""
    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            configs[id(config)] = config
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


def _first_lines(exc: BaseException, limit: int = 600) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit] + " ..."


@dataclass(frozen=True)
class _Request:
    """What a front end captures: the model called as ``model(*args, **kwargs)``, its leaf
    modules (`rule` says which modules an export unit takes whole), and the (flat input
    index, dim) pairs to make dynamic."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    leaf_modules: tuple[type, ...] | None
    rule: Callable[[nn.Module], bool]
    dynamic_dims: Collection[tuple[int, int]]


def _export(request: _Request) -> Captured:
    """torch.export (non-strict), its aten nodes grouped into units by module call."""
    model = request.model
    try:
        with _no_cache(model):
            exported = export_flat(model, request.args, request.kwargs, request.dynamic_dims)
    except CaptureError:
        raise
    except Exception as exc:  # export raises many kinds
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {_first_lines(exc)}"
        ) from exc
    gm = exported.gm
    # After export's try: a block that cannot be cut is the user's to change, not export's.
    inline_regions(gm, lambda n: unit_key(n, model, request.rule), type(model).__name__)
    units = group_units(gm, model, request.rule)
    meta = _exported_meta(gm)
    return _record(
        request, gm, units, "export", meta if meta is not None else _run_meta(request, gm),
        in_spec=exported.in_spec, ranges=exported.ranges, non_persistent=exported.non_persistent,
    )


def _fx(request: _Request) -> Captured:
    """torch.fx: one unit per fx node, leaf modules called whole."""
    return _traced(request, trace(request.model, request.leaf_modules), "fx")


def _sequential(request: _Request) -> Captured:
    """An nn.Sequential's top-level children as a chain."""
    gm = sequential_graph_module(request.model)
    if request.kwargs:
        raise ValueError("a sequential model takes one positional input, not keywords")
    return _traced(request, gm, "sequential")


def _traced(request: _Request, gm: fx.GraphModule, method: Method) -> Captured:
    _check_flat_call(request, method)
    bind_kwargs(gm, len(request.args), request.kwargs)
    return _record(
        request, gm, fx_units(gm), method, _run_meta(request, gm),
        in_spec=tree_flatten((request.args, request.kwargs))[1], ranges={},
        non_persistent=non_persistent_buffers(request.model),
    )


def _check_flat_call(request: _Request, method: Method) -> None:
    """A traced graph takes each forward argument as one value: an argument that is a
    list, tuple or dict would be fed its tensors one by one instead, so the graph would run
    on a call the model itself rejects or reads differently (a one-element list as a tensor)."""
    named = [(f"positional argument {i}", a) for i, a in enumerate(request.args)]
    named += [(f"keyword argument {k!r}", v) for k, v in request.kwargs.items()]
    for what, value in named:
        if isinstance(value, (list, tuple, dict)):
            raise CaptureError(
                f"torch.{'fx' if method == 'fx' else 'nn.Sequential chain'} takes each forward "
                f"argument as one tensor, but {what} is a {type(value).__name__} of "
                f"{len(value)}; pass the structure the model's forward takes (a tensor there, "
                "if that is what it expects)"
            )


# The capture front ends: each returns the same record, or raises CaptureError to let the
# next one try.
FRONT_ENDS: dict[str, Callable[[_Request], Captured]] = {
    "export": _export,
    "fx": _fx,
    "sequential": _sequential,
}


def capture(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    *,
    leaf_modules: tuple[type, ...] | None = None,
    sequential: bool = False,
    method: str = "auto",
    dynamic_dims: Collection[tuple[int, int]] = (),
) -> Captured:
    """Capture `model` called as ``model(*example_inputs, **example_kwargs)`` as units in
    execution order (a `Captured`; its docstring is the record's contract).

    method "export" exports it with torch.export (non-strict; dim 0, the batch, of every
    input dynamic where the model allows, and the (flat input index, dim) pairs of
    `dynamic_dims`; every other dim static: see `Captured.input_dims`) and groups the aten
    nodes into units by module call: the ops of one leaf module call (see `is_default_leaf`,
    or `leaf_modules`) form a unit, and so does each run of other ops of one module call; a
    module called several times (a shared layer) gives one unit per call. "fx" traces it
    with torch.fx (one unit per fx node, leaf modules called whole, their Python run as
    written). "auto" (default) tries export, then fx (fx first when `leaf_modules` is
    given), and raises CaptureError naming each failure.
    `sequential=True` (or an nn.Sequential nothing else captures) takes the top-level
    children as a chain.
    The example run happens in a sandbox: parameters, buffers, .training and RNG are unchanged.
    """
    _check_arguments(model, example_inputs, example_kwargs, leaf_modules, method)
    kwargs = dict(example_kwargs or {})
    _check_keywords(model, kwargs)
    request = _Request(
        model, example_inputs, kwargs, leaf_modules,
        is_default_leaf if leaf_modules is None else leaf_rule(leaf_modules), dynamic_dims,
    )
    if sequential:
        return _sequential(request)
    return _first_that_captures(request, _attempts(method, leaf_modules))


def _check_arguments(
    model: object, example_inputs: object, example_kwargs: object,
    leaf_modules: tuple[type, ...] | None, method: str,
) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        raise TypeError(
            f"example_inputs must be a tuple of the model's forward arguments, got "
            f"{type(example_inputs).__name__}; wrap a single input as (x,)"
        )
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(
            f"example_kwargs must be a dict of keyword arguments, got "
            f"{type(example_kwargs).__name__}"
        )
    if leaf_modules is not None and not all(isinstance(t, type) for t in leaf_modules):
        raise TypeError(f"leaf_modules must be a tuple of module classes, got {leaf_modules!r}")
    if method not in METHODS:
        raise ValueError(f"unknown capture method {method!r}; use one of {', '.join(METHODS)}")


def _attempts(method: str, leaf_modules: tuple[type, ...] | None) -> list[str]:
    """The front ends to try, in order."""
    if method != "auto":
        return [method]
    # Explicit leaf modules are fx's idea (called whole, their Python run as written).
    return ["export", "fx"] if leaf_modules is None else ["fx", "export"]


def _first_that_captures(request: _Request, attempts: list[str]) -> Captured:
    """The record of the first front end in `attempts` that captures the model; else the
    sequential one for an nn.Sequential, else CaptureError naming every failure."""
    model = request.model
    failures: list[str] = []
    for name in attempts:
        try:
            captured = FRONT_ENDS[name](request)
        except CaptureError as exc:
            failures.append(str(exc))
            continue
        if name == "fx" and failures:
            log.warning("hybridpipe: captured %s with torch.fx instead: %s",
                        type(model).__name__, failures[0])
        return captured
    if isinstance(model, nn.Sequential):
        return _sequential(request)
    hint = " Try method='fx'." if attempts == ["export"] else ""
    raise CaptureError("; then ".join(failures) + hint)


def _run_meta(request: _Request, gm: fx.GraphModule) -> dict[str, dict[str, Any]]:
    """Every node's value metadata from one run of `gm` on the example (in a sandbox)."""
    recorder = _Recorder(gm)
    with sandbox(request.model), torch.no_grad():
        recorder.run(*tree_flatten((request.args, request.kwargs))[0])
    return recorder.meta


_SYMBOLIC: dict[type, type] = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}


def _exported_meta(gm: fx.GraphModule) -> dict[str, dict[str, Any]] | None:
    """What `_Recorder` records, read from the fake values torch.export left on every node
    (symbolic sizes at the example's values), without running the model: a real forward of
    GPT-2 small costs more than its export. None when a node has no value or a size no hint."""
    meta: dict[str, dict[str, Any]] = {}

    def concrete(t: torch.Tensor) -> tuple[int, ...]:
        return tuple(optimization_hint(s) if isinstance(s, torch.SymInt) else int(s)
                     for s in t.shape)

    try:
        for n in gm.graph.nodes:
            if n.op == "output":
                continue
            if "val" not in n.meta:
                return None
            value = n.meta["val"]
            tensors = list(_flat_tensors(value))
            meta[n.name] = {
                "shape": concrete(value) if isinstance(value, torch.Tensor) else None,
                "dtype": str(value.dtype) if isinstance(value, torch.Tensor)
                else _SYMBOLIC.get(type(value), type(value)).__name__,
                "bytes": sum(math.prod(concrete(t)) * t.element_size() for t in tensors),
                "tensor": isinstance(value, torch.Tensor),
            }
    except (RuntimeError, ValueError, TypeError):  # an unbacked size has no hint
        return None
    return meta


def _check_keywords(model: nn.Module, kwargs: dict[str, Any]) -> None:
    params = inspect.signature(model.forward).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if p.kind is not p.VAR_POSITIONAL]
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise ValueError(
            f"input keys {unknown} are not arguments of {type(model).__name__}.forward "
            f"{names}; use its argument names as keys"
        )


def aliases(model: nn.Module) -> dict[str, list[str]]:
    """For every parameter or buffer known under several names (tied weights), name ->
    all its names in the model."""
    names: dict[int, list[str]] = {}
    for name, t in (
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ):
        names.setdefault(id(t), []).append(name)
    return {n: group for group in names.values() if len(group) > 1 for n in group}


def _record(
    request: _Request,
    gm: fx.GraphModule,
    units: list[tuple[str, list[str]]],
    method: Method,
    meta: dict[str, dict[str, Any]],
    *,
    in_spec: TreeSpec,
    ranges: dict[Any, tuple[int, float]],
    non_persistent: set[str],
) -> Captured:
    """The record of a capture: `units` (module key, flat node names) of `gm`, and `meta`,
    every node's value on the example."""
    model = request.model
    if not units:
        raise ValueError(f"{type(model).__name__} has no operations to partition")
    bases = _unit_bases(model, units, method, request.rule)
    units_gm, names = unit_module(gm, units, bases)
    unit_of = {m: i for i, (_, members) in enumerate(units) for m in members}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    structured = isinstance(gm.graph._codegen, Unflatten)
    return Captured(
        graph=_unit_graph(gm, units, names, meta, unit_of, exported=method == "export"),
        model=model,
        method=method,
        graph_module=gm,
        unit_module=units_gm,
        order=tuple(names),
        inputs=tuple(n.name for n in gm.graph.nodes if n.op == "placeholder"),
        output=output.name,
        in_spec=in_spec,
        out_spec=gm._out_spec if structured else None,
        input_dims=tuple(input_dims(gm)),
        ranges=ranges,
        values={name: Value(v["shape"], v["dtype"], v["bytes"], v["tensor"])
                for name, v in meta.items()},
        unit_of=unit_of,
        # Symbolic sizes are re-derived in each stage, never sent (see exported.SymLookup).
        recompute=frozenset(n.name for n in gm.graph.nodes if is_symbolic(n)),
        non_persistent=frozenset(non_persistent),
        aliases=aliases(model),
        training=modes(model) if method == "export" and mode_sensitive(gm) else None,
    )


def _unit_graph(
    gm: fx.GraphModule,
    units: list[tuple[str, list[str]]],
    names: list[str],
    meta: dict[str, dict[str, Any]],
    unit_of: dict[str, int],
    *,
    exported: bool,
) -> nx.DiGraph:
    """One node per unit with its attributes (see `Captured`), one edge per unit it feeds."""
    nodes = {n.name: n for n in gm.graph.nodes}
    graph = nx.DiGraph()
    for i, (key, members) in enumerate(units):
        handed = [
            m
            for m in members
            if any(
                u.op == "output" or (u.name in unit_of and unit_of[u.name] != i)
                for u in nodes[m].users
            )
        ]
        last = meta[(handed or members)[-1]]
        single = members[0] if not exported else None
        target = _target_name(nodes[members[0]]) if single or not key else key
        op = nodes[single].op if single else ("call_module" if key else "call_function")
        graph.add_node(
            names[i],
            name=names[i],
            op=op,
            target=target,
            module=key or None,
            members=list(members),
            shape=last["shape"],
            dtype=last["dtype"],
            bytes=sum(meta[m]["bytes"] for m in handed),
            tensor=all(meta[m]["tensor"] for m in handed),
            param_bytes=_unit_params(gm, nodes, members),
            index=i,
        )
    for i, (_, members) in enumerate(units):
        for m in members:
            for user in nodes[m].users:
                j = unit_of.get(user.name)
                if j is not None and j != i:
                    edge = graph.edges.get((names[i], names[j]))
                    size = meta[m]["bytes"] + (edge["bytes"] if edge else 0)
                    graph.add_edge(names[i], names[j], bytes=size)
    return graph
