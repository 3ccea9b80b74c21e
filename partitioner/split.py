"""Cut a captured graph into one executable module per stage, in chain form: stage 0 takes the
model's inputs, stage k>0 takes exactly stage k-1's outputs, and a value needed further on (a
skip connection) is passed through the stages in between.

Each stage is an fx.GraphModule built over the captured module: fx copies the submodules and
attributes a graph refers to *by reference* at their original qualified paths, so stages share
the model's parameters and buffers and report the model's own parameter names. (fx's
split_module also shares parameters, but names its pieces submod_k and passes values between
arbitrary pieces; building each stage's graph here gives the chain form directly.)"""

from __future__ import annotations

from typing import Any

import networkx as nx
from torch import fx

from partitioner.cuts import live_at, spans
from partitioner.plan import Plan


class StageModule(fx.GraphModule):
    """One pipeline stage. `forward(*inputs)` takes the values named `input_names` and returns
    a tuple of the values named `output_names`; the last stage returns a 1-tuple holding the
    model's output as the model returns it."""

    input_names: list[str]
    output_names: list[str]

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
        return copied


def _check_plan(graph: nx.DiGraph, plan: Plan) -> list[int]:
    order: list[str] = graph.graph["order"]
    flat = [name for stage in plan.stages for name in stage]
    if flat != order:
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
) -> fx.Graph:
    """The graph of one stage: placeholders `inputs`, the nodes `names` copied in order, and
    an output of `outputs` (or, for the last stage, a 1-tuple of the model's output)."""
    new = fx.Graph()
    env: dict[str, fx.Node] = {}
    for name in inputs:
        # Stage 0 keeps the model's placeholders (names, defaults); later stages take the
        # previous stage's outputs under the same value names.
        env[name] = new.node_copy(nodes[name]) if first else new.placeholder(name)

    def lookup(arg: fx.Node) -> fx.Node:
        if arg.name not in env:
            if arg.op != "get_attr":
                raise RuntimeError(f"value {arg.name} is not available in this stage")
            # Parameters and constants are re-read where used instead of being sent.
            env[arg.name] = new.get_attr(str(arg.target))
        return env[arg.name]

    for name in names:
        source = nodes[name]
        if source.op == "get_attr":
            continue  # materialised by lookup in the stages that use it
        env[name] = new.node_copy(source, lookup)
    if last is not None:
        new.output((fx.node.map_arg(last.args[0], lookup),))
    else:
        new.output(tuple(lookup(nodes[name]) for name in outputs))
    new.lint()
    return new


def split_model(graph: nx.DiGraph, plan: Plan) -> list[StageModule]:
    """Build the stage modules of `plan` (from `partition`) over the captured model."""
    gm: fx.GraphModule = graph.graph["graph_module"]
    bounds = _check_plan(graph, plan)
    all_spans = spans(graph)
    nodes = {node.name: node for node in gm.graph.nodes}
    output_node = nodes[graph.graph["output"]]
    p = len(plan.stages)
    stage_modules: list[StageModule] = []
    inputs: list[str] = list(graph.graph["inputs"])
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
        new = _stage_graph(nodes, plan.stages[k], inputs, outputs, first=k == 0, last=last)
        stage_modules.append(StageModule(gm, new, list(inputs), outputs, k))
        inputs = outputs
    return stage_modules
