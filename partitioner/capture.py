"""Capture a model as a networkx graph: trace it with torch.fx (or, for sequential models, take
its top-level children in order), propagate shapes on the example input, and record per node the
output shape/dtype/bytes and parameter bytes, per edge the bytes it moves."""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import networkx as nx
import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from partitioner.sandbox import sandbox

# Blocks kept whole by default: repeated units whose insides are never worth cutting through.
DEFAULT_LEAF_NAMES = ("BasicBlock", "Bottleneck", "InvertedResidual", "EncoderBlock")
DEFAULT_LEAF_SUFFIXES = ("Block", "Layer")


class CaptureError(ValueError):
    """torch.fx could not trace the model and it is not sequential."""


def is_default_leaf(module: nn.Module) -> bool:
    """The default leaf rule: torch.nn's own modules (as fx does), nn.MultiheadAttention, and
    blocks named like transformer/residual units (class name ending in Block or Layer, or one of
    torchvision's BasicBlock, Bottleneck, InvertedResidual, EncoderBlock)."""
    if isinstance(module, nn.Sequential | nn.ModuleList | nn.ModuleDict):
        return False
    name = type(module).__name__
    if name in DEFAULT_LEAF_NAMES or name.endswith(DEFAULT_LEAF_SUFFIXES):
        return True
    return isinstance(module, nn.MultiheadAttention) or type(module).__module__.startswith(
        ("torch.nn", "torch.ao.nn")
    )


class _Tracer(fx.Tracer):
    """fx tracer with our leaf rule, remembering which module it is inside so a failure can be
    reported against that module."""

    def __init__(self, leaf_modules: tuple[type, ...] | None) -> None:
        super().__init__()
        self.leaf_types = leaf_modules
        self.stack: list[tuple[str, str]] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self.leaf_types is None:
            return is_default_leaf(m)
        # An explicit tuple replaces the name rule: torch.nn's own modules plus these types.
        return isinstance(m, self.leaf_types) or super().is_leaf_module(m, module_qualified_name)

    def call_module(
        self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        path = self.path_of_module(m)
        if self.is_leaf_module(m, path):
            return super().call_module(m, forward, args, kwargs)
        self.stack.append((path, type(m).__name__))
        result = super().call_module(m, forward, args, kwargs)
        self.stack.pop()
        return result


def _trace(model: nn.Module, leaf_modules: tuple[type, ...] | None) -> fx.GraphModule:
    tracer = _Tracer(leaf_modules)
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # fx raises many kinds (TraceError, TypeError, RuntimeError...)
        path, cls = tracer.stack[-1] if tracer.stack else ("", type(model).__name__)
        if path:
            where = f"module '{path}' ({cls})"
            leaf = f"keep that module whole by passing leaf_modules=({cls},) to capture/Pipeline"
        else:
            where = f"the model's own forward ({cls})"
            leaf = (
                "move the untraceable code into a submodule and pass its class in leaf_modules "
                "to capture/Pipeline"
            )
        raise CaptureError(
            f"torch.fx could not trace {where}: {type(exc).__name__}: {exc}. Two ways out: "
            f"{leaf}, or give a sequential model (an nn.Sequential, or sequential=True when "
            f"the model's forward applies its top-level children in order)"
        ) from exc
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _sequential_graph_module(model: nn.Module) -> fx.GraphModule:
    """The chain model -> child0 -> child1 -> ... as an fx graph, without tracing anything."""
    children = list(model.named_children())
    if not children:
        raise ValueError(
            f"sequential=True needs a model with child modules; {type(model).__name__} has none"
        )
    graph = fx.Graph()
    value: fx.Node = graph.placeholder("input")
    for name, _ in children:
        value = graph.call_module(name, (value,))
    graph.output(value)
    return fx.GraphModule(model, graph, type(model).__name__)


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


def _module_path(n: fx.Node) -> str | None:
    if n.op in ("call_module", "get_attr"):
        return str(n.target)
    stack = n.meta.get("nn_module_stack")
    if stack:
        return str(list(stack.values())[-1][0])
    return None


def _param_bytes(gm: fx.GraphModule, n: fx.Node) -> int:
    if n.op == "call_module":
        sub = gm.get_submodule(str(n.target))
        return sum(p.numel() * p.element_size() for p in sub.parameters())
    if n.op == "get_attr":
        attr = _fetch(gm, str(n.target))
        if isinstance(attr, nn.Parameter):
            return attr.numel() * attr.element_size()
    return 0


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


def capture(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    *,
    leaf_modules: tuple[type, ...] | None = None,
    sequential: bool = False,
) -> nx.DiGraph:
    """Capture `model` as a DiGraph of its fx nodes in execution order.

    Placeholders and the output node are not graph nodes (stage 0 takes the model's inputs,
    the last stage returns its output); their names are in graph.graph["inputs"] and
    graph.graph["output"]. graph.graph["module"] is the traced GraphModule, or the model itself
    for the sequential fallback; graph.graph["graph_module"] is always the fx form that
    `split_model` cuts. Node attrs: name, op, target, module, shape, dtype, bytes, tensor (output
    is a single tensor), param_bytes, index (position in the order). Edge attr: bytes.
    leaf_modules: module classes fx keeps whole (called, not traced into); None means the
    default rule of `is_default_leaf`, a tuple replaces it (torch.nn's modules stay leaves).
    The example run happens in a sandbox: parameters, buffers, .training and RNG are unchanged.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        raise TypeError(
            f"example_inputs must be a tuple of the model's forward arguments, got "
            f"{type(example_inputs).__name__}; wrap a single input as (x,)"
        )
    if leaf_modules is not None and not all(isinstance(t, type) for t in leaf_modules):
        raise TypeError(f"leaf_modules must be a tuple of module classes, got {leaf_modules!r}")
    if sequential:
        gm = _sequential_graph_module(model)
        module: nn.Module = model
    else:
        try:
            gm = _trace(model, leaf_modules)
            module = gm
        except CaptureError:
            if not isinstance(model, nn.Sequential):
                raise
            gm = _sequential_graph_module(model)
            module = model

    recorder = _Recorder(gm)
    with sandbox(model), torch.no_grad():
        recorder.run(*example_inputs)

    graph = nx.DiGraph()
    order: list[str] = []
    inputs: list[str] = []
    output: fx.Node | None = None
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            inputs.append(n.name)
            continue
        if n.op == "output":
            output = n
            continue
        meta = recorder.meta[n.name]
        graph.add_node(
            n.name,
            name=n.name,
            op=n.op,
            target=_target_name(n),
            module=_module_path(n),
            param_bytes=_param_bytes(gm, n),
            index=len(order),
            **meta,
        )
        order.append(n.name)
    for n in gm.graph.nodes:
        if n.name not in graph:
            continue
        for user in n.users:
            if user.name in graph:
                graph.add_edge(n.name, user.name, bytes=recorder.meta[n.name]["bytes"])
    if not order:
        raise ValueError(f"{type(model).__name__} has no operations to partition")
    graph.graph.update(
        module=module,
        graph_module=gm,
        inputs=inputs,
        input_meta={name: recorder.meta[name] for name in inputs},
        output=output.name if output is not None else None,
        order=order,
    )
    return graph
