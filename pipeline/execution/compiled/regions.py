"""Cut a stage's flat graph into regions, the pieces compiled one by one: one region per call
of a repeated block (a child of a ModuleList or Sequential, e.g. ``blocks.3`` or
``model.layers.0``) and one per run of the ops between blocks. Identical blocks give regions
with the same canonical code (parameters and inputs as numbered placeholders, nodes renamed),
so they share one compiled artefact and the compile time does not grow with depth. The blocks
are those the activation policies checkpoint (partitioner.blocks: one rule for both).

`outline` returns the regions and a driver graph: the stage's graph with each region replaced
by one call of its runner, which the compiled stage runs instead of the stage's own code."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from partitioner.autocast import op_of
from partitioner.blocks import block_key, runs
from partitioner.exported import is_symbolic, unit_item

_PLAIN = ("call_function", "call_method")


@dataclass
class Region:
    """Nodes of the stage graph run as one compiled piece: `attrs` (get_attr nodes: weights,
    buffers, constants), `inputs` (values from before the region) and `outputs` (values used
    after it). `name` is the module path of the block (or the ops' first module)."""

    name: str
    nodes: list[fx.Node] = field(default_factory=list)
    attrs: list[fx.Node] = field(default_factory=list)
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)
    copied: list[fx.Node] = field(default_factory=list)  # symbolic sizes recomputed here
    sizes: dict[fx.Node, tuple[int, int]] = field(default_factory=dict)  # ... or re-read
    modules: list[str] = field(default_factory=list)  # modules called whole (torch.fx)
    states: list[tuple[str, str]] = field(default_factory=list)  # their tensors: (m0.w, path)


def _module_name(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [str(path) for path, _ in stack.values() if path]
    if node.op == "call_module":
        paths.append(str(node.target))
    return paths[0] if paths else "(model ops)"


def _floating(node: fx.Node) -> bool:
    """Symbolic-size arithmetic and value-less checks: recomputed where used, not a region's."""
    if node.op not in _PLAIN:
        return False
    return is_symbolic(node) or ("val" in node.meta and node.meta["val"] is None)


def _unpacks_input(node: fx.Node) -> bool:
    """An item of a tuple the graph takes (a captured unit's input): the driver takes it out,
    so only tensors cross into a region."""
    item = node.target is operator.getitem or node.target is unit_item
    source = node.args[0] if item and node.args else None
    return isinstance(source, fx.Node) and source.op == "placeholder"


def _group(graph: fx.Graph, whole: bool) -> list[Region]:
    """The graph's blocks (partitioner.blocks: the activation policies' rule; all of it as
    one with `whole`), without the nodes no region computes, each tuple's items kept with the
    op returning it."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")
             and not _floating(n) and not _unpacks_input(n)]
    cut = [nodes] if whole else runs(nodes)
    run_of: dict[fx.Node, list[fx.Node]] = {}
    for members in cut:
        for node in list(members):
            source = node.args[0] if node.target is operator.getitem and node.args else None
            home = run_of.get(source) if isinstance(source, fx.Node) else None
            if home is not None and home is not members:
                members.remove(node)
                home.append(node)
            run_of[node] = home if home is not None else members
    return [Region(_region_name(members), nodes=members) for members in cut if members]


def _region_name(members: list[fx.Node]) -> str:
    """The block's module path, else the first module its ops belong to."""
    keys = (block_key(n) for n in members)
    return next((k for k in keys if k), None) or _module_name(members[0])


def _sym_expr(node: fx.Node) -> Any:
    value = node.meta.get("val")
    return value.node.expr if isinstance(value, torch.SymInt) else None


def _size_of(inputs: list[fx.Node], expr: Any) -> tuple[int, int] | None:
    """(input index, dim) of the first input dim whose symbolic size is `expr`."""
    for i, node in enumerate(inputs):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            if isinstance(size, torch.SymInt) and size.node.expr == expr:
                return i, dim
    return None


def _call_modules(region: Region, owner: nn.Module) -> None:
    """The modules the region calls whole, and their tensors (passed in like attributes)."""
    for node in region.nodes:
        if node.op == "call_module" and str(node.target) not in region.modules:
            i = len(region.modules)
            region.modules.append(str(node.target))
            module = owner.get_submodule(str(node.target))
            named = [*module.named_parameters(remove_duplicate=False),
                     *module.named_buffers(remove_duplicate=False)]
            region.states += [(f"m{i}.{name}", f"{node.target}.{name}") for name, _ in named]


def _needs(region: Region) -> None:
    """Record what the region reads from outside: attributes and inputs, then the symbolic
    sizes it uses, re-read from an input's shape where one has the size (so equal blocks
    read it alike) and otherwise recomputed from what they need."""
    members = set(region.nodes)
    seen: set[fx.Node] = set()
    floating: list[fx.Node] = []

    def read(node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            if arg in members or arg in seen:
                continue
            seen.add(arg)
            if arg.op == "get_attr":
                region.attrs.append(arg)
            elif _floating(arg):
                floating.append(arg)
            else:
                region.inputs.append(arg)

    for node in region.nodes:
        read(node)
    while floating:
        node = floating.pop(0)
        expr = _sym_expr(node)
        found = None if expr is None else _size_of(region.inputs, expr)
        if found is not None:
            region.sizes[node] = found
        else:
            region.copied.append(node)
            read(node)


def regions_of(stage: fx.GraphModule, whole: bool = False) -> list[Region]:
    """The stage graph's regions in order, each with its attrs, inputs and outputs (`whole`:
    one region, e.g. for a block already cut by partitioner.blocks)."""
    graph = stage.graph
    regions = _group(graph, whole)
    for region in regions:
        _needs(region)
        _call_modules(region, stage)
    used_later: set[fx.Node] = set()
    for region in regions:
        used_later.update(region.inputs)
    output = next(n for n in graph.nodes if n.op == "output")
    used_later.update(output.all_input_nodes)
    for region in regions:
        region.outputs = [n for n in region.nodes if n in used_later]
    return regions


def canonical(region: Region, owner: nn.Module) -> fx.GraphModule:
    """The region as a module of its own: placeholders a0.. (attrs), x0.. (inputs), nodes
    n0.., modules called whole as m0.. (`owner`'s), returning the tuple of its outputs. Equal
    blocks give equal code."""
    root = nn.Module()
    renamed = {}
    for i, target in enumerate(region.modules):
        root.add_module(f"m{i}", owner.get_submodule(target))
        renamed[target] = f"m{i}"
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(region.attrs):
        env[node] = graph.placeholder(f"a{i}")
    for i, node in enumerate(region.inputs):
        env[node] = graph.placeholder(f"x{i}")
    names = (f"n{i}" for i in itertools.count())

    def emit(node: fx.Node) -> fx.Node:
        """The node in the new graph, its symbolic-size arguments first (each just before
        its first use, so the code does not depend on where the stage graph held them)."""
        if node in env:
            return env[node]
        if node in region.sizes:
            i, dim = region.sizes[node]
            env[node] = graph.call_function(
                torch.ops.aten.sym_size.int, (env[region.inputs[i]], dim), name=next(names)
            )
        else:
            args = fx.node.map_arg(node.args, emit)
            kwargs = fx.node.map_arg(node.kwargs, emit)
            target = renamed.get(str(node.target), node.target) if node.op == "call_module" \
                else node.target
            env[node] = graph.create_node(node.op, target, args, kwargs, name=next(names))
        env[node].meta = {k: v for k, v in node.meta.items() if k == "val"}
        return env[node]

    for node in region.nodes:
        emit(node)
    outs = []
    for node in region.outputs:
        out = env[node]
        if _is_alias(node):  # AOTAutograd traces outputs that are not views of one another
            out = graph.call_function(torch.ops.aten.clone.default, (out,))
        outs.append(out)
    graph.output(tuple(outs))
    graph.lint()
    return fx.GraphModule(root, graph)


def _is_alias(node: fx.Node) -> bool:
    """Whether the node's value may be a view of another value (a view op, or an item of a
    tuple of views such as split's)."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    target = op_of(node.target)
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return any(r.alias_info is not None for r in target._schema.returns)


def outline(
    gm: fx.GraphModule, regions: Sequence[Region], runners: Sequence[Callable[..., Any]]
) -> fx.GraphModule:
    """`gm` with each region replaced by ``runners[k](*attrs, *states, *inputs)`` (a tuple of its
    outputs): the driver of the compiled stage. Attributes are read from `gm` at call time."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    source = gm.graph
    start = {r.nodes[0]: (r, run) for r, run in zip(regions, runners, strict=True) if r.nodes}

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:  # a get_attr or symbolic size used after the last region
            env[node] = graph.node_copy(node, lookup)
        return env[node]

    # Placeholders first: a block's graph (partitioner.blocks) makes them where first read.
    for node in source.find_nodes(op="placeholder"):
        env[node] = graph.node_copy(node)
    for node in source.nodes:
        if node.op == "placeholder":
            continue
        if node in start:
            region, run = start[node]
            states = [graph.get_attr(path) for _, path in region.states]
            args = [*map(lookup, region.attrs), *states, *map(lookup, region.inputs)]
            call = graph.call_function(run, tuple(args))
            # The block's module, so an activation policy recomputes region by region.
            stack = {"nn_module_stack": node.meta.get("nn_module_stack", {})}
            call.meta.update(stack)
            for i, out in enumerate(region.outputs):
                env[out] = graph.call_function(operator.getitem, (call, i))
                env[out].meta.update(stack)
        elif node.op == "output":
            graph.output(fx.node.map_arg(node.args[0], lookup))
    graph.set_codegen(source._codegen)
    graph.lint()
    driver = fx.GraphModule(gm, graph, f"{type(gm).__name__}Driver")
    # The driver holds the stage's own modules, parameters and buffers (the same dicts, not
    # copies), so the step's private leaves swapped into the stage are what it reads.
    for slot in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
        driver.__dict__[slot] = gm.__dict__[slot]
    if hasattr(gm, "_out_spec"):
        driver._out_spec = gm._out_spec
    return driver
