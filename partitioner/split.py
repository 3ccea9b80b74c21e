"""Cut a captured graph into one executable module per stage, in chain form: stage 0 takes the
model's inputs, stage k>0 takes exactly stage k-1's outputs, and a value needed further on (a
skip connection) is passed through the stages in between.

Each stage is an fx.GraphModule built over the captured module: fx copies the submodules and
attributes a graph refers to *by reference* at their original qualified paths, so stages share
the model's parameters and buffers and report the model's own parameter names. (fx's
split_module also shares parameters, but names its pieces submod_k and passes values between
arbitrary pieces; building each stage's graph here gives the chain form directly.)"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn

from partitioner.captured import Captured
from partitioner.cuts import live_at, spans
from partitioner.exported import (
    SymLookup,
    Unflatten,
    is_symbolic,
    mark_non_persistent,
    retarget,
)
from partitioner.plan import Plan


class StageModule(fx.GraphModule):
    """One pipeline stage. `forward(*inputs)` takes the values named `input_names` and returns
    a tuple of the values named `output_names`; the last stage returns a 1-tuple holding the
    model's output as the model returns it. `input_needs_grad` / `output_needs_grad`: per
    input / output, whether a gradient can flow through it (`needs_grad`): a value computed
    from buffers and integers alone (a rotary table) crosses the stage boundary without one."""

    input_names: list[str]
    output_names: list[str]
    input_needs_grad: tuple[bool, ...] = ()
    output_needs_grad: tuple[bool, ...] = ()

    def __init__(
        self,
        root: fx.GraphModule,
        graph: fx.Graph,
        input_names: list[str],
        output_names: list[str],
        index: int,
    ) -> None:
        super().__init__(root, graph, f"Stage{index}")
        self.input_names = input_names
        self.output_names = output_names
        self.index = index

    def __deepcopy__(self, memo: dict[int, object]) -> StageModule:
        # fx's deepcopy rebuilds through GraphModule.__init__, which knows nothing of these.
        copied: Any = super().__deepcopy__(memo)
        copied.input_names = list(self.input_names)
        copied.output_names = list(self.output_names)
        copied.index = self.index
        copied.input_needs_grad = self.input_needs_grad
        copied.output_needs_grad = self.output_needs_grad
        if hasattr(self, "_out_spec"):
            copied._out_spec = self._out_spec
        return copied

    def to(self, *args: Any, **kwargs: Any) -> Any:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            retarget(self, device)  # a stage moved to another device creates tensors there
        return super().to(*args, **kwargs)


_CONTAINERS = ("tuple", "list", "dict")


def needs_grad(captured: Captured) -> frozenset[str]:
    """The flat graph's values a gradient can flow through: floating tensors computed (through
    floating values) from a parameter (read as an attribute, or by a module called whole),
    or from a floating model input (the caller's may need grad). Every parameter counts,
    frozen or not, so a later unfreezing changes nothing; a value computed from buffers and
    integers alone (positions, a rotary table) does not, nor does an integer, boolean or
    size (no gradient crosses those). Conservative: a value that could carry a gradient is
    in the set."""
    gm = captured.graph_module
    values = captured.values
    params = {id(p) for p in gm.parameters()}

    def floating(name: str) -> bool:
        value = values.get(name)
        if value is None or (not value.tensor and value.dtype in _CONTAINERS):
            return True  # unknown, or a container of values: as its items may
        if not value.tensor:
            return False
        dtype = getattr(torch, value.dtype.removeprefix("torch."), None)
        return isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex)

    flowing: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            source = True
        elif node.op == "get_attr":
            source = id(_attr(gm, str(node.target))) in params
        elif node.op == "output":
            continue
        else:  # a module called whole (torch.fx) reads its own parameters
            source = any(a.name in flowing for a in node.all_input_nodes) or (
                node.op == "call_module" and any(
                    True for _ in gm.get_submodule(str(node.target)).parameters()))
        if source and floating(node.name):
            flowing.add(node.name)
    return frozenset(flowing)


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _check_plan(captured: Captured, plan: Plan) -> list[int]:
    order = captured.order
    flat = [name for stage in plan.stages for name in stage]
    if flat != list(order):
        raise ValueError(
            "plan does not match the graph: its stages must be contiguous, non-empty segments "
            f"covering the graph's {len(order)} nodes in order (the plan covers {len(flat)}); "
            "make the plan with partition() on this graph"
        )
    if any(not stage for stage in plan.stages):
        raise ValueError(f"plan has an empty stage (sizes {plan.sizes}); re-partition")
    bounds = [0]
    for stage in plan.stages:
        bounds.append(bounds[-1] + len(stage))
    return bounds


def _stage_graph(
    nodes: dict[str, fx.Node],
    names: list[str],
    inputs: list[str],
    outputs: list[str],
    *,
    first: bool,
    last: fx.Node | None,
    structured: bool,
) -> fx.Graph:
    """The graph of one stage: placeholders `inputs`, the flat nodes `names` copied in order,
    and an output of `outputs` (or, for the last stage, a 1-tuple of the model's output,
    rebuilt from the flat outputs when `structured`)."""
    new = fx.Graph()
    env: dict[str, fx.Node] = {}
    for name in inputs:
        # Stage 0 keeps the model's placeholders (names, defaults); later stages take the
        # previous stage's outputs under the same value names.
        env[name] = new.node_copy(nodes[name]) if first else new.placeholder(name)
        env[name].meta = dict(nodes[name].meta)
    def lookup(arg: fx.Node) -> fx.Node:
        if arg.name not in env:
            if arg.op == "get_attr":
                # Parameters and constants are re-read where used instead of being sent.
                env[arg.name] = new.get_attr(str(arg.target))
                env[arg.name].meta = dict(arg.meta)
            elif is_symbolic(arg):
                return SymLookup(new, env, lookup)(arg)
            else:
                raise RuntimeError(f"value {arg.name} is not available in this stage")
        return env[arg.name]

    for name in names:
        env[name] = new.node_copy(nodes[name], lookup)
    if last is None:
        new.output(tuple(lookup(nodes[name]) for name in outputs))
    elif structured:
        new.output(fx.node.map_arg(last.args[0], lookup))
        new.set_codegen(Unflatten(wrap=True))
    else:
        new.output((fx.node.map_arg(last.args[0], lookup),))
    new.lint()
    return new


def split_model(captured: Captured, plan: Plan) -> list[StageModule]:
    """Build the stage modules of `plan` (from `partition`) over the captured model."""
    gm = captured.graph_module
    bounds = _check_plan(captured, plan)
    all_spans = spans(captured)
    nodes = {node.name: node for node in gm.graph.nodes}
    output_node = nodes[captured.output]
    structured = captured.out_spec is not None
    unit_of = captured.unit_of
    flat_order = [n.name for n in gm.graph.nodes if n.name in unit_of]
    p = len(plan.stages)
    stage_modules: list[StageModule] = []
    inputs = list(captured.inputs)
    flowing = needs_grad(captured)
    for k in range(p):
        crossing = live_at(all_spans, bounds[k + 1]) if k < p - 1 else []
        bad = [s.name for s in crossing if not s.tensor]
        if bad:
            raise ValueError(
                f"stage {k}'s boundary carries non-tensor values {bad}; only cuts where every "
                f"crossing value is a tensor are allowed: re-partition"
            )
        outputs = [s.name for s in crossing]
        last = output_node if k == p - 1 else None
        members = [n for n in flat_order if bounds[k] <= unit_of[n] < bounds[k + 1]]
        new = _stage_graph(
            nodes, members, inputs, outputs, first=k == 0, last=last, structured=structured
        )
        stage = StageModule(gm, new, list(inputs), outputs, k)
        stage.input_needs_grad = tuple(n in flowing for n in inputs)
        stage.output_needs_grad = tuple(n in flowing for n in outputs)
        if last is not None and structured:
            stage._out_spec = captured.out_spec
        _add_aliases(stage, captured.aliases)
        mark_non_persistent(stage, captured.non_persistent)
        stage_modules.append(stage)
        inputs = outputs
    return stage_modules


def _add_aliases(stage: StageModule, names: Mapping[str, list[str]]) -> None:
    """A tied weight is held under every name the model gives it, so the stage's state_dict
    has the model's own keys (named_parameters still yields it once)."""
    held: dict[str, torch.Tensor] = dict(stage.named_parameters(remove_duplicate=False))
    held.update(stage.named_buffers(remove_duplicate=False))
    for name, tensor in list(held.items()):
        for other in names.get(name, []):
            if other in held:
                continue
            prefix, _, field = other.rpartition(".")
            owner: nn.Module = stage
            for part in prefix.split(".") if prefix else []:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            if isinstance(tensor, nn.Parameter):
                owner.register_parameter(field, tensor)
            else:
                owner.register_buffer(field, tensor)
            held[other] = tensor
