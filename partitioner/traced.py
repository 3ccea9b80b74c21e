"""The torch.fx front end of capture: the default leaf-module rule (which modules stay whole),
a tracer that reports an untraceable construct against the module it sits in, the chain of
top-level children for sequential models, and the fx graph's units (one per node) with its
placeholders bound to the call's (args, kwargs) order."""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from partitioner.autocast import AutocastSpy

# Blocks kept whole by default: repeated units whose insides are never worth cutting through.
DEFAULT_LEAF_NAMES = ("BasicBlock", "Bottleneck", "InvertedResidual", "EncoderBlock")
DEFAULT_LEAF_SUFFIXES = ("Block", "Layer")


class CaptureError(ValueError):
    """Neither torch.export nor torch.fx could capture the model (and it is not sequential)."""


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


def trace(model: nn.Module, leaf_modules: tuple[type, ...] | None) -> fx.GraphModule:
    tracer = _Tracer(leaf_modules)
    spy = AutocastSpy()
    try:
        with spy:
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
    dropped = spy.dropped(type(model).__name__)
    if dropped is not None:
        raise CaptureError(dropped)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def sequential_graph_module(model: nn.Module) -> fx.GraphModule:
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



def fx_units(gm: fx.GraphModule) -> list[tuple[str, list[str]]]:
    """fx nodes are units of their own (get_attr nodes are re-read where used)."""
    units = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        path = str(n.target) if n.op == "call_module" else None
        if path is None and n.meta.get("nn_module_stack"):
            path = str(list(n.meta["nn_module_stack"].values())[-1][0])
        units.append((path or "", [n.name]))
    return units


def bind_kwargs(gm: fx.GraphModule, nargs: int, kwargs: dict[str, Any]) -> None:
    """Reorder a traced graph's placeholders to the flat order of (args, kwargs): the
    positional ones, then the given keywords in their order, then the rest (defaults)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_name = {str(n.target): n for n in placeholders}
    unknown = [k for k in kwargs if k not in by_name]
    if unknown:
        raise ValueError(
            f"input keys {unknown} are not arguments of the model's forward "
            f"{list(by_name)}; use its argument names as keys"
        )
    given = placeholders[:nargs] + [by_name[k] for k in kwargs]
    if any(n in placeholders[:nargs] for n in given[nargs:]):
        raise ValueError(f"input keys {sorted(kwargs)} repeat positional arguments")
    order = given + [n for n in placeholders if n not in given]
    anchor = next(n for n in gm.graph.nodes if n.op != "placeholder")
    for n in order:
        anchor.prepend(n)
    gm.graph.lint()
    gm.recompile()



def leaf_rule(leaf_modules: tuple[type, ...]) -> Any:
    # An explicit tuple replaces the name rule: torch.nn's own modules plus these types.
    def rule(m: nn.Module) -> bool:
        return isinstance(m, leaf_modules) or (
            type(m).__module__.startswith(("torch.nn", "torch.ao.nn"))
            and not isinstance(m, nn.Sequential | nn.ModuleList | nn.ModuleDict)
        )

    return rule

