"""The split backward of zero-bubble schedules: B (`backward_input`) computes a stage's input
grads only and keeps what W (`backward_weight`) needs to compute its weight grads later.

B runs `torch.autograd.grad` w.r.t. the stage inputs only (graph kept), and captures with node
pre-hooks the gradient arriving where each weight's path leaves the input-grad path; W starts
from those saved gradients, so the activation-grad path is walked once. Stage outputs that do
not depend on the stage inputs (and stage 0, whose inputs need no grad) get their weight grads
from a plain pass in W. (A stage under a recompute policy does not split: the runtime takes
its weight grads in B, since each backward call would recompute its checkpointed blocks.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node


def _grad_node(t: Tensor) -> Node | None:
    """The autograd node gradients of `t` flow into (AccumulateGrad for a leaf)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    view_fn = t.view_as(t).grad_fn  # a leaf's AccumulateGrad is reached through a view
    return view_fn.next_functions[0][0] if view_fn is not None else None


def _ancestors(
    starts: Sequence[Node], parents: Mapping[Node, list[Node]], stop: set[Node]
) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from `starts` towards the outputs, not expanding past `stop` nodes;
    returns (reached, the `stop` nodes met)."""
    reached, met = set(starts), set()
    queue = list(starts)
    while queue:
        for parent in parents.get(queue.pop(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in reached:
                reached.add(parent)
                queue.append(parent)
    return reached, met


@dataclass(eq=False)  # identity, not tensor-wise, comparison
class _WeightGroup:
    """Weights whose gradient paths meet the input-grad path at `nodes`; `grads[i]` are the
    gradients that flowed into nodes[i] during B."""

    params: list[Tensor]
    nodes: list[Node]
    grads: list[tuple[Tensor | None, ...]] = field(default_factory=list)


@dataclass
class WeightWork:
    """What B leaves for W: weight groups to finish from their saved node gradients, plus the
    outputs that do not depend on the stage inputs (their weight grads are computed whole)."""

    groups: list[_WeightGroup]
    roots: list[Tensor]
    grads: list[Tensor | None]
    params: list[Tensor]


def backward_input(
    roots: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    inputs: Sequence[Tensor],
    params: Sequence[Tensor],
) -> tuple[tuple[Tensor | None, ...], WeightWork]:
    """B of a split backward: the gradients of `inputs` only (graph kept for W).

    The weight grads are not computed here, but the gradient flowing into every autograd node
    where a weight's path leaves the input-grad path is captured with a node pre-hook, so W
    starts from those nodes and never re-walks the input-grad path (the idea behind
    torch.distributed.pipelining's stage_backward_input/stage_backward_weight). W then makes
    one backward call per weight group."""
    if not inputs:  # stage 0: W computes every weight grad in one pass
        return (), WeightWork([], list(roots), list(grads), list(params))
    root_nodes = [_grad_node(r) for r in roots]
    input_nodes = [n for n in map(_grad_node, inputs) if n is not None]
    parents: dict[Node, list[Node]] = {}
    seen = {n for n in root_nodes if n is not None}
    queue = list(seen)
    while queue:
        node = queue.pop()
        for child, _ in node.next_functions:
            if child is not None:
                parents.setdefault(child, []).append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)
    on_input_path, _ = _ancestors(input_nodes, parents, set())
    # Outputs that do not depend on the inputs get their weight grads from a plain pass in W.
    rest = [i for i, n in enumerate(root_nodes) if n is not None and n not in on_input_path]
    linked = [i for i, n in enumerate(root_nodes) if n is not None and n in on_input_path]
    # Group weights by the input-path nodes their paths meet (weights sharing a node share a
    # group, so every meeting node is finished exactly once).
    groups: list[_WeightGroup] = []
    group_of: dict[Node, _WeightGroup] = {}
    for p in params:
        acc = _grad_node(p)
        if acc is None or acc not in seen:
            continue
        _, met = _ancestors([acc], parents, on_input_path)
        if not met:
            continue
        merged = {id(group_of[m]): group_of[m] for m in met if m in group_of}
        group = _WeightGroup([p], list(met))
        for other in merged.values():
            group.params += other.params
            group.nodes += [n for n in other.nodes if n not in group.nodes]
            groups.remove(other)
        groups.append(group)
        for m in group.nodes:
            group_of[m] = group
    handles = []
    for group in groups:
        group.grads = [() for _ in group.nodes]
        for i, node in enumerate(group.nodes):

            def save(
                grad_outputs: tuple[Tensor | None, ...], g: _WeightGroup = group, i: int = i
            ) -> None:
                g.grads[i] = grad_outputs

            handles.append(node.register_prehook(save))
    try:
        dx: tuple[Tensor | None, ...] = tuple(None for _ in inputs)
        if linked:
            dx = torch.autograd.grad(
                [roots[i] for i in linked],
                list(inputs),
                [grads[i] for i in linked],
                retain_graph=True,
                allow_unused=True,
            )
    finally:
        for h in handles:
            h.remove()
    return dx, WeightWork(groups, [roots[i] for i in rest], [grads[i] for i in rest], list(params))


def backward_weight(work: WeightWork) -> tuple[list[Tensor], list[Tensor | None]]:
    """W of a split backward: the weight grads from what `backward_input` kept, as (params,
    grads) for the caller to accumulate."""
    params: list[Tensor] = []
    grads: list[Tensor | None] = []
    for group in work.groups:
        edges = [
            GradientEdge(n, k)
            for n, gs in zip(group.nodes, group.grads, strict=True)
            for k, g in enumerate(gs)
            if g is not None
        ]
        saved = [g for gs in group.grads for g in gs if g is not None]
        if not edges:
            continue
        # A meeting node below another one in the same group would also get gradient through
        # the upper one; pin it to what B saw, so nothing is counted twice.
        handles = [
            n.register_prehook(lambda _, gs=gs: gs)
            for n, gs in zip(group.nodes, group.grads, strict=True)
            if gs
        ]
        try:
            # Groups may share weight-only nodes; the graph is freed when `work` is dropped.
            got = torch.autograd.grad(
                edges, group.params, saved, retain_graph=True, allow_unused=True
            )
        finally:
            for h in handles:
                h.remove()
        params += group.params
        grads += got
    if work.roots and work.params:
        params += work.params
        grads += torch.autograd.grad(work.roots, work.params, work.grads, allow_unused=True)
    return params, grads
