"""The torch.export front end of capture: export a model (non-strict; the batch dim and the
dims asked for dynamic), turn the exported program into a flat fx graph over the model's own
parameters and buffers, and group its aten nodes into units by module call
(`nn_module_stack`), so the partitioner sees blocks.

The flat graph reads every parameter, buffer and constant with a `get_attr` at the model's own
qualified name (tied parameters under each of their names), so a GraphModule built over it
holds the user's Parameter objects themselves, not copies: gradients land on the model.
Buffer mutations the export records (BatchNorm running stats) become in-place `copy_`s right
after the new value is computed. Symbolic sizes (SymInt nodes) are never sent between stages:
`SymLookup` re-derives them in each stage from the shapes of tensors the stage has."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

from partitioner.autocast import retarget_autocast

LeafRule = Callable[[nn.Module], bool]


class Unflatten(fx.graph.CodeGen):
    """Codegen that returns the model's output structure (tree_unflatten of the flat outputs
    with the module's `_out_spec`), wrapped in a 1-tuple when `wrap` (a last stage)."""

    def __init__(self, wrap: bool) -> None:
        super().__init__()
        self.wrap = wrap

    def generate_output(self, output_args: Any, *args: Any, **kwargs: Any) -> str:
        rebuilt = f"pytree.tree_unflatten({list(output_args)!r}, self._out_spec)"
        return f"return ({rebuilt},)" if self.wrap else f"return {rebuilt}"


@dataclass
class Exported:
    """A model exported as a flat fx graph: `gm(*flat inputs)` equals `model(*args,
    **kwargs)`; `in_spec` is the pytree structure of (args, kwargs) whose leaves are the
    graph's placeholders in order; `ranges` maps each symbolic dim to its (low, high) bound;
    `non_persistent` names the buffers and constants not in the model's state_dict."""

    gm: fx.GraphModule
    in_spec: TreeSpec
    ranges: dict[Any, tuple[int, float]]
    non_persistent: set[str]


def _dynamic_shapes(
    args: tuple[Any, ...], kwargs: dict[str, Any], dynamic: Collection[tuple[int, int]]
) -> tuple[Any, ...]:
    """torch.export's dynamic_shapes: dim 0 (the batch) of every tensor, and the dims named in
    `dynamic` as (flat input index, dim), are Dim.AUTO (dynamic unless the model fixes them);
    every other dim is static. Marking every dim dynamic costs minutes on models that reshape
    by their sizes (window partitioning in Swin or MaxViT), for dims that rarely change."""
    count = itertools.count()

    def spec(leaf: Any) -> Any:
        index = next(count)
        if not isinstance(leaf, torch.Tensor):
            return None
        return {d: Dim.AUTO for d in range(leaf.dim()) if d == 0 or (index, d) in dynamic}

    specs_args, specs_kwargs = tree_map(spec, (args, kwargs))
    return tuple(specs_args) + tuple(specs_kwargs.values())


def _model_tensors(model: nn.Module) -> dict[str, Any]:
    found: dict[str, Any] = dict(model.named_parameters(remove_duplicate=False))
    found.update(model.named_buffers(remove_duplicate=False))
    return found


def non_persistent_buffers(model: nn.Module) -> set[str]:
    """Qualified names of the model's non-persistent buffers (not in its state_dict)."""
    names = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        for field in module._non_persistent_buffers_set:
            names.add(f"{prefix}.{field}" if prefix else field)
    return names


def _dtype_check(node: fx.Node) -> bool:
    """Export's check of the dtype a ``.to()``/``.float()`` meets, as capture met it. On meta,
    where autocast does nothing, that is fp32 where the run (under ``mixed_precision`` or the
    model's own autocast block) meets bf16: a meta capture drops these checks."""
    return node.target is torch.ops.aten._assert_tensor_metadata.default


def export_flat(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dynamic: Collection[tuple[int, int]] = (),
) -> Exported:
    """torch.export.export(strict=False) with the batch dim and the `dynamic` (flat input,
    dim) pairs dynamic where the model allows it (see `_dynamic_shapes`), rebuilt as a flat
    fx graph over the model's own tensors (see the module docstring). Raises whatever
    torch.export raises; capture() reports it."""
    ep = torch.export.export(
        model, args, kwargs, dynamic_shapes=_dynamic_shapes(args, kwargs, dynamic), strict=False
    )
    sig = ep.graph_signature
    tensors = _model_tensors(model)
    old = ep.graph_module.graph
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, Any] = {}
    non_persistent = non_persistent_buffers(model)
    placeholders = [n for n in old.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, sig.input_specs, strict=True):
        if spec.kind is InputKind.USER_INPUT:
            env[node] = new.node_copy(node)
            continue
        target = spec.target
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and target in tensors:
            attrs[target] = tensors[target]
        elif spec.kind is InputKind.CONSTANT_TENSOR and target is not None:
            attrs[target] = ep.constants[target]
            non_persistent.add(target)
        else:
            raise ValueError(f"exported input {node.name} of kind {spec.kind.name} is unsupported")
        assert target is not None
        got = new.get_attr(target)
        got.meta = dict(node.meta)
        env[node] = got
    output: fx.Node | None = None
    on_meta = any(t.is_meta for t in tensors.values() if isinstance(t, torch.Tensor))
    for node in old.nodes:
        if node.op == "placeholder" or on_meta and _dtype_check(node):
            continue
        if node.op == "output":
            output = node
            continue
        if node.op == "get_attr":  # a higher-order op's subgraph (e.g. an autocast region)
            attrs[str(node.target)] = getattr(ep.graph_module, str(node.target))
        env[node] = new.node_copy(node, lambda n: env[n])
    assert output is not None
    results: list[Any] = []
    for value, spec in zip(output.args[0], sig.output_specs, strict=True):  # type: ignore[arg-type]
        if spec.kind is OutputKind.USER_OUTPUT:
            results.append(fx.node.map_arg(value, lambda n: env[n]))
        elif spec.kind is OutputKind.BUFFER_MUTATION:
            produced = env[value]
            buffer = next(n for n in new.nodes if n.op == "get_attr" and n.target == spec.target)
            with new.inserting_after(produced):
                copy = new.call_function(torch.ops.aten.copy_.default, (buffer, produced))
            copy.meta = {k: v for k, v in produced.meta.items() if k in ("nn_module_stack", "val")}
        else:
            raise ValueError(
                f"the model's forward has a side effect torch.export records as "
                f"{spec.kind.name} ({spec.target}); pipelines support buffer updates only, not "
                "in-place changes of inputs"
            )
    new.output(tuple(results))
    new.set_codegen(Unflatten(wrap=False))
    gm = fx.GraphModule(attrs, new, type(model).__name__)
    gm._out_spec = ep.call_spec.out_spec
    mark_non_persistent(gm, non_persistent)
    in_spec = ep.call_spec.in_spec
    assert in_spec is not None
    ranges = {
        sym: (int(r.lower), float(r.upper)) for sym, r in ep.range_constraints.items()
    }
    return Exported(gm, in_spec, ranges, non_persistent)


def mark_non_persistent(module: nn.Module, names: Collection[str]) -> None:
    """fx registers every tensor attribute as a persistent buffer: keep the model's
    non-persistent buffers (and lifted constants) out of this module's state_dict."""
    for name in names:
        prefix, _, field = name.rpartition(".")
        try:
            owner = module.get_submodule(prefix)
        except AttributeError:
            continue
        if field in owner._buffers:
            owner._non_persistent_buffers_set.add(field)


def retarget(gm: fx.GraphModule, device: torch.device) -> None:
    """torch.export writes the capture device into the graph: factory calls
    (``arange(..., device=cpu)``) and moves (``aten.to.device(x, device(type='meta'), ...)``,
    the device positional). Point every such device, keyword or positional, at `device`,
    where the module now runs, so it creates and moves its tensors there."""
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        args = tuple(
            device if isinstance(a, torch.device) and a != device else a for a in node.args
        )
        if args != node.args:
            node.args = args
            changed = True
        current = node.kwargs.get("device")
        if isinstance(current, torch.device) and current != device:
            node.update_kwarg("device", device)
            changed = True
        changed = retarget_autocast(node, device) or changed
    if changed:
        gm.recompile()


# ---------------------------------------------------------------------------------------------
# Symbolic sizes
# ---------------------------------------------------------------------------------------------


def is_symbolic(node: fx.Node) -> bool:
    """A node whose value is a symbolic int/bool/float (shape arithmetic), not a tensor."""
    return isinstance(node.meta.get("val"), torch.SymInt | torch.SymBool | torch.SymFloat)


class SymLookup:
    """Makes symbolic size values available in a graph under construction: a SymInt the
    graph has not computed is re-read from the shape of a tensor it has (`sym_size`), or
    recomputed from other sizes (copying the arithmetic node)."""

    def __init__(
        self, graph: fx.Graph, env: dict[str, fx.Node], fetch: Callable[[fx.Node], fx.Node]
    ) -> None:
        self.graph = graph
        self.env = env
        self.fetch = fetch  # for a tensor the arithmetic needs, when no shape has the size

    def __call__(self, source: fx.Node) -> fx.Node:
        found = self._from_shape(source)
        if found is None:
            found = self.graph.node_copy(source, self._arg)
        self.env[source.name] = found
        return found

    def _arg(self, arg: fx.Node) -> fx.Node:
        if arg.name in self.env:
            return self.env[arg.name]
        if is_symbolic(arg):
            return self(arg)
        return self.fetch(arg)

    def _from_shape(self, source: fx.Node) -> fx.Node | None:
        value = source.meta.get("val")
        if not isinstance(value, torch.SymInt):
            return None
        expr = value.node.expr
        for have in list(self.env.values()):
            held = have.meta.get("val")
            if not isinstance(held, torch.Tensor):
                continue
            for dim, size in enumerate(held.shape):
                if isinstance(size, torch.SymInt) and size.node.expr == expr:
                    node = self.graph.call_function(torch.ops.aten.sym_size.int, (have, dim))
                    node.meta = dict(source.meta)
                    return node
        return None


# ---------------------------------------------------------------------------------------------
# Units: aten nodes grouped by module
# ---------------------------------------------------------------------------------------------


def unit_key(node: fx.Node, model: nn.Module, is_leaf: LeafRule) -> str:
    """The outermost leaf module call the node runs in, else the innermost module call ('' =
    root): the module's path, with torch.export's call count ("@1", "@2", ...) for a module
    called more than once (ALBERT's shared layer, a loop over one block), so every call is a
    unit of its own."""
    stack = node.meta.get("nn_module_stack") or {}
    calls = []
    for key, (path, _) in stack.items():
        count = str(key).rpartition("@")[2] if "@" in str(key) else ""
        calls.append((str(path), f"{path}@{count}" if count.isdigit() and path else str(path)))
    for path, call in calls:
        if not path:
            continue
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if is_leaf(module):
            return call
    return calls[-1][1] if calls else ""


def group_units(
    gm: fx.GraphModule, model: nn.Module, is_leaf: LeafRule
) -> list[tuple[str, list[str]]]:
    """(module path, node names) per unit: maximal runs of consecutive nodes with the same
    unit key, in graph order; the model's own ops (key '') are units of one node each, as fx
    would give them. get_attr and symbolic-size nodes belong to no unit (they are re-read or
    re-derived where used)."""
    units: list[tuple[str, list[str]]] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr") or is_symbolic(node):
            continue
        key = unit_key(node, model, is_leaf)
        if key and units and units[-1][0] == key:
            units[-1][1].append(node.name)
        else:
            units.append((key, [node.name]))
    return units


def unit_module(
    gm: fx.GraphModule, units: Sequence[tuple[str, list[str]]], bases: Sequence[str]
) -> tuple[fx.GraphModule, list[str]]:
    """A two-level module for measuring units, and the units' names: its graph calls one
    submodule per unit (named after `bases[i]`, made unique and valid the way fx names nodes),
    each taking the result tuples of the units (or the model inputs) it reads and returning the
    tuple of its values read later. Used by the profiler."""
    nodes = {n.name: n for n in gm.graph.nodes}
    unit_of = {name: i for i, (_, members) in enumerate(units) for name in members}
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    outputs: list[list[str]] = [[] for _ in units]
    for i, (_, members) in enumerate(units):
        for name in members:
            if any(unit_of.get(u.name, -1) != i for u in nodes[name].users):
                outputs[i].append(name)
    top = fx.Graph()
    results: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            results[node.name] = top.placeholder(node.name)
    root = nn.Module()
    names: list[str] = []
    for i, (_, members) in enumerate(units):
        sub, sources = _unit_graph(nodes, members, outputs, unit_of, names, order)
        base = bases[i]
        if hasattr(root, base):  # a Module attribute ("to", "float"): fx would call that
            base = f"{base}_unit"
        call = top.create_node(
            "call_module", "", tuple(results[s] for s in sources), name=base
        )
        call.target = call.name
        names.append(call.name)
        setattr(root, call.name, fx.GraphModule(gm, sub, call.name))
        results[call.name] = call
    top.output(tuple(results[name] for name in names))
    return fx.GraphModule(root, top, "Units"), names


def _unit_graph(
    nodes: dict[str, fx.Node],
    members: list[str],
    outputs: list[list[str]],
    unit_of: dict[str, int],
    names: list[str],
    order: dict[str, int],
) -> tuple[fx.Graph, list[str]]:
    """One unit's graph for `unit_module`, and the top-level values (earlier units' names or
    model inputs) it takes, in placeholder order."""
    sub = fx.Graph()
    env: dict[str, fx.Node] = {}
    sources: list[str] = []
    own = set(members)

    def read(arg: fx.Node) -> fx.Node:
        if arg.name in env:
            return env[arg.name]
        if arg.op == "get_attr":
            value = sub.get_attr(str(arg.target))
        elif is_symbolic(arg) and arg.name not in own:
            return SymLookup(sub, env, read)(arg)
        else:
            producer = unit_of.get(arg.name)
            key = arg.name if producer is None else names[producer]
            if key not in sources:
                sources.append(key)
                env[key] = sub.placeholder(f"in_{len(sources)}")
            value = env[key]
            if producer is not None:
                value = sub.call_function(unit_item, (value, outputs[producer].index(arg.name)))
        value.meta = dict(arg.meta)
        env[arg.name] = value
        return value

    for name in sorted(members, key=order.__getitem__):
        env[name] = sub.node_copy(nodes[name], read)
    sub.output(tuple(env[name] for name in outputs[len(names)]))
    # Placeholders must come first in a graph.
    anchor = next(n for n in sub.nodes if n.op != "placeholder")
    for ph in [n for n in sub.nodes if n.op == "placeholder"]:
        anchor.prepend(ph)
    return sub, sources


def unit_item(values: tuple[Any, ...], index: int) -> Any:
    """Item `index` of the tuple of outputs another unit gave (a unit graph's input)."""
    return values[index]


def flat_inputs(
    in_spec: TreeSpec,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    signature: inspect.Signature | None = None,
) -> tuple[Any, ...]:
    """The graph's placeholder values for a call (args, kwargs) of the captured structure:
    keyword inputs in any order, and (given the forward's `signature`) positional inputs for
    keyword ones or the reverse; ValueError naming both structures otherwise."""
    want_args, want_kwargs = tree_unflatten([None] * in_spec.num_leaves, in_spec)
    if signature is not None and (len(args), set(kwargs)) != (len(want_args), set(want_kwargs)):
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
            names = list(signature.parameters)
            args = tuple(bound[n] for n in names[: len(want_args)])
            kwargs = {k: bound[k] for k in want_kwargs}
        except (TypeError, KeyError):
            pass  # reported below
    if len(args) == len(want_args) and set(kwargs) == set(want_kwargs):
        leaves, spec = tree_flatten((args, {k: kwargs[k] for k in want_kwargs}))
        if spec == in_spec:
            return tuple(leaves)
    raise ValueError(
        f"inputs are {_shape_of((args, kwargs))} but the model was captured with "
        f"{_shape_of((want_args, want_kwargs))} (positional arguments, keyword arguments; "
        "T: a tensor or value); give every batch the structure the model was captured with"
    )


def _shape_of(call: tuple[Any, ...]) -> str:
    """A call's pytree structure with every leaf shown as T, e.g. ``((T, [T]), {})``."""
    leaves, spec = tree_flatten(call)
    return repr(tree_unflatten([_Leaf()] * len(leaves), spec))


class _Leaf:
    def __repr__(self) -> str:
        return "T"
