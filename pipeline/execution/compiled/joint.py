"""The graphs a compiled region runs, cut from its joint forward+backward graph (AOTAutograd's
`aot_export_joint_simple`, partitioned by its min-cut partitioner): the forward (outputs, then
what the backward keeps), the whole backward, and, for a split (zero-bubble) backward, an
input-grad graph and a weight-grad graph. The input-grad graph also returns the intermediate
values the weight grads are computed from, and the weight-grad graph starts from them, so W
runs only the weight-grad work (e.g. ``dW = dy^T x``) and never redoes the input-grad path."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

Partition = Callable[[fx.GraphModule, tuple[torch.Tensor, ...], int],
                     tuple[fx.GraphModule, fx.GraphModule]]
"""Cuts a joint graph (taking the primals it was traced on and its number of forward
outputs) into the forward (outputs, then what it keeps) and the backward graph."""


@dataclass(frozen=True)
class SplitBackward:
    """`input_grad(*saved, *tangents) -> (*grads of inputs, *kept)`; `weight_grad(*picked,
    *kept) -> grads of weights`, where `picked` indexes (*saved, *tangents)."""

    input_grad: fx.GraphModule
    weight_grad: fx.GraphModule
    inputs: tuple[int, ...]  # primal index of each input grad
    weights: tuple[int, ...]  # primal index of each weight grad
    picked: tuple[int, ...]


@dataclass(frozen=True)
class JointGraphs:
    """`forward(*primals) -> (*outputs, *saved)`; `backward(*saved, *tangents)` -> one grad
    per primal (None where the primal needs none). `tangents[i]` is the output index the i-th
    tangent belongs to (the outputs that require grad)."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    num_outputs: int
    tangents: tuple[int, ...]
    split: SplitBackward | None


def trace_joint(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    args: Sequence[torch.Tensor],
    differentiable: Sequence[bool],
    weights: Iterable[int],
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
    partition: Partition | None = None,
) -> JointGraphs:
    """Trace `fn(*args)` (a tuple of tensors; `differentiable[i]`: output i requires grad)
    forward and backward, and cut the graphs. `weights`: the primal indices that are weights
    (the others needing a grad are inputs); with both present the backward is also split.
    `decompositions`: the compiler's (inductor's: the joint graph then holds the primitive ops
    its partitioner may recompute in the backward, as under torch.compile). `partition`: how
    the joint graph is cut into forward and backward (default: AOTAutograd's min-cut
    partitioner; an activation policy chooses what the forward keeps itself)."""
    # Imported here: they load torch._dynamo (a second a process) and only compiling uses them.
    from torch._functorch.aot_autograd import aot_export_joint_simple

    table = dict(decompositions) if decompositions is not None else None
    try:
        joint = aot_export_joint_simple(fn, tuple(args), trace_joint=True,
                                        decompositions=table)
    except RuntimeError as err:
        if "outputs that alias" not in str(err):
            raise
        # E.g. a linear layer on a 3-d input returns an _unsafe_view of its product, which
        # the joint export refuses as an output: such a region returns copies.
        joint = aot_export_joint_simple(_copied(fn), tuple(args), trace_joint=True,
                                        decompositions=table)
    if not isinstance(joint, fx.GraphModule):
        raise TypeError(f"the joint trace gave a {type(joint).__name__}, not a graph")
    num_outputs = len(differentiable)
    cut = partition if partition is not None else _min_cut
    forward, backward = cut(joint, tuple(args), num_outputs)
    tangents = tuple(i for i, d in enumerate(differentiable) if d)
    found = sum(1 for n in backward.graph.nodes if n.op == "placeholder"
                and n.name.startswith("tangents"))
    if found != len(tangents):
        raise RuntimeError(
            f"the joint graph takes {found} tangents for {len(tangents)} differentiable outputs"
        )
    grads = _outputs(backward)
    wanted = [i for i, g in enumerate(grads) if g is not None]
    weight_set = set(weights)
    inputs = tuple(i for i in wanted if i not in weight_set)
    weight_idx = tuple(i for i in wanted if i in weight_set)
    split = split_backward(backward, inputs, weight_idx) if inputs and weight_idx else None
    return JointGraphs(forward, backward, num_outputs, tangents, split)


def _min_cut(
    joint: fx.GraphModule, args: tuple[torch.Tensor, ...], num_outputs: int
) -> tuple[fx.GraphModule, fx.GraphModule]:
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(joint, args, num_fwd_outputs=num_outputs)


def _copied(
    fn: Callable[..., tuple[torch.Tensor, ...]],
) -> Callable[..., tuple[torch.Tensor, ...]]:
    return lambda *a: tuple(o.clone() for o in fn(*a))


def _outputs(gm: fx.GraphModule) -> list[Any]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = out.args[0]
    return list(values) if isinstance(values, (tuple, list)) else [values]


def _ancestors(targets: Iterable[Any]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    queue = [t for t in targets if isinstance(t, fx.Node)]
    while queue:
        node = queue.pop()
        if node in seen:
            continue
        seen.add(node)
        queue.extend(node.all_input_nodes)
    return seen


def _subgraph(
    nodes: Sequence[fx.Node], inputs: Sequence[fx.Node], outputs: Sequence[fx.Node]
) -> fx.GraphModule:
    """A graph computing `outputs` from `inputs` (placeholders, in order) with `nodes`."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in nodes:
        if node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in outputs))
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph)


def split_backward(
    backward: fx.GraphModule, inputs: Sequence[int], weights: Sequence[int]
) -> SplitBackward:
    """Cut `backward` into the input-grad part (the grads of the primals `inputs` and
    everything they depend on) and the weight-grad part (what only the grads of `weights`
    need), joined by the values the first computes and the second reads (`kept`)."""
    grads = _outputs(backward)
    placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    order = {n: i for i, n in enumerate(backward.graph.nodes)}
    dx = [grads[i] for i in inputs]
    dw = [grads[i] for i in weights]
    shared = _ancestors(dx)
    only_w = _ancestors(dw) - shared
    # The items the weight-grad part reads of a multi-output op (e.g. native_layer_norm's
    # backward) the input-grad part runs are taken there: a graph returns tensors, not tuples.
    items = {n for n in only_w if n.target is operator.getitem and n.args[0] in shared}
    shared |= items
    only_w -= items
    # Values the input-grad part computes that the weight-grad part reads (or returns).
    kept = sorted(
        (n for n in shared if n.op != "placeholder"
         and (any(u in only_w for u in n.users) or n in dw)),
        key=order.__getitem__,
    )
    picked = [
        i for i, p in enumerate(placeholders) if any(u in only_w for u in p.users) or p in dw
    ]
    body = sorted((n for n in shared if n.op != "placeholder"), key=order.__getitem__)
    input_grad = _subgraph(body, placeholders, [*dx, *kept])
    rest = sorted((n for n in only_w if n.op != "placeholder"), key=order.__getitem__)
    weight_grad = _subgraph(rest, [placeholders[i] for i in picked] + kept, dw)
    return SplitBackward(input_grad, weight_grad, tuple(inputs), tuple(weights), tuple(picked))
