"""What a tensor-parallel plan does to each unit of a captured graph, for pricing it (pure graph
analysis, no process group): which nodes run at shard shapes (1/tp of their work: the split
matmuls, the vocab-parallel lookup, and every op between a column-parallel matmul and its
row-parallel partner, where activations are split by heads or features; under sequence
parallelism the element-wise work on token activations between the pairs too), and the
collectives the tensor-parallel pass (pipeline.execution.tensor_parallel) adds, each with its
buffer's bytes and the pass it runs in:

- a row-parallel matmul's output: one all-reduce in the forward (sequence parallel: a
  reduce-scatter forward, an all-gather backward);
- the activation a column-parallel matmul reads (once per activation: q, k and v share one):
  one all-reduce of its gradient in the backward (sequence parallel: an all-gather forward,
  a reduce-scatter backward);
- a vocab-parallel embedding's rows: one all-reduce forward;
- a column-parallel projection with no row-parallel partner (an LM head): its output
  all-gathered in the forward.

`unit_work` sums them per unit with each node's roofline seconds (FLOPs over a FLOP rate,
bytes over a byte rate, never under a per-op floor), which the planner turns into costs at
shard shapes (pipeline.planning.tp_costs)."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from partitioner.captured import Captured
from partitioner.tp_plan import _ATTENTION, _SHAPE_OPS, _SPLITS, Matmul, TPPlan, matmul_of

aten = torch.ops.aten
FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class Collective:
    """One collective on the tp group: `kind` ("all_reduce", "all_gather",
    "reduce_scatter"), `phase` ("forward" or "backward"), `bytes` of the full buffer (the
    reduced tensor, the gathered output, the scattered input), and the flat node it serves."""

    kind: str
    phase: str
    bytes: int
    node: str


@dataclass(frozen=True)
class UnitWork:
    """One unit under a tp plan: `share` of its roofline seconds in nodes that run at shard
    shapes, `held_share` of the bytes its nodes make that are split, its `collectives`, and
    `ops` (the aten ops it runs: each goes through DTensor's dispatch under tp)."""

    share: float = 0.0
    held_share: float = 0.0
    collectives: tuple[Collective, ...] = ()
    ops: int = 0


@dataclass(frozen=True)
class Rates:
    """Roofline constants for a node's seconds: FLOP/s, bytes/s and the least an op costs."""

    flops: float = 5e10
    bandwidth: float = 1e10
    floor: float = 5e-6


@dataclass
class _Found:
    sharded: set[fx.Node] = field(default_factory=set)
    collectives: list[tuple[fx.Node, Collective]] = field(default_factory=list)


def _transparent(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and (
        target in _SHAPE_OPS or target in _ATTENTION or target in _SPLITS
        or target is operator.getitem or torch.Tag.pointwise in getattr(target, "tags", ()))


def _region(start: fx.Node, matmuls: Mapping[fx.Node, Matmul], plan: TPPlan,
            found: _Found) -> bool:
    """Mark the ops between column-parallel `start` and the row-parallel matmuls it reaches
    as sharded; whether it reaches one (else its output is gathered: an LM head)."""
    todo, rows, seen = [start], False, {start}
    while todo:
        node = todo.pop()
        for user in node.users:
            row = matmuls.get(user)
            if row is not None and plan.style(row.weight) == "rowwise":
                rows = True
            elif _transparent(user) and user not in seen:
                seen.add(user)
                found.sharded.add(user)
                todo.append(user)
    return rows


def _bytes(captured: Captured, node: fx.Node) -> int:
    value = captured.values.get(node.name)
    return 0 if value is None else int(value.bytes)


def _find(captured: Captured, plan: TPPlan, sequence_parallel: bool) -> _Found:
    gm = captured.graph_module
    params = dict(gm.named_parameters(remove_duplicate=False))
    matmuls = {n: mm for n in gm.graph.nodes if (mm := matmul_of(n, params)) is not None}
    found = _Found()
    read: set[fx.Node] = set()  # activations whose column-parallel readers are counted

    def add(node: fx.Node, kind: str, phase: str, nbytes: int) -> None:
        found.collectives.append((node, Collective(kind, phase, nbytes, node.name)))

    for node, mm in matmuls.items():
        style = plan.style(mm.weight)
        if plan.dim(mm.weight) is None:
            continue
        found.sharded.add(node)
        if style == "rowwise":
            out = _bytes(captured, node)
            if sequence_parallel:
                add(node, "reduce_scatter", FORWARD, out)
                add(node, "all_gather", BACKWARD, out)
            else:
                add(node, "all_reduce", FORWARD, out)
            continue
        if mm.activation not in read:
            read.add(mm.activation)
            act = _bytes(captured, mm.activation)
            if sequence_parallel:
                add(node, "all_gather", FORWARD, act)
                add(node, "reduce_scatter", BACKWARD, act)
            else:
                add(node, "all_reduce", BACKWARD, act)
        if not _region(node, matmuls, plan, found):
            add(node, "all_gather", FORWARD, _bytes(captured, node))
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target is aten.embedding.default
                and isinstance(node.args[0], fx.Node)
                and plan.style(str(node.args[0].target)) == "vocab"):
            found.sharded.add(node)
            add(node, "all_reduce", FORWARD, _bytes(captured, node))
    if sequence_parallel:  # the element-wise work between the pairs runs on 1/tp tokens
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            if (node.op == "call_function" and node not in found.sharded
                    and node not in matmuls and isinstance(value, torch.Tensor)
                    and value.dim() >= 2 and value.is_floating_point()):
                found.sharded.add(node)
    return found


def _flops(node: fx.Node, matmuls_k: Mapping[fx.Node, int], out_numel: int) -> float:
    if node in matmuls_k:
        return 2.0 * out_numel * matmuls_k[node]
    if node.op == "call_function" and node.target in _ATTENTION and node.args:
        q = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if isinstance(q, torch.Tensor) and q.dim() == 4:
            b, h, s, d = (int(x) if isinstance(x, int) else 1 for x in q.shape)
            return 4.0 * b * h * s * s * d
    return 0.0


def _seconds(captured: Captured, node: fx.Node, matmuls_k: Mapping[fx.Node, int],
             rates: Rates) -> float:
    out = _bytes(captured, node)
    moved = out + sum(_bytes(captured, i) for i in node.all_input_nodes)
    value = node.meta.get("val")
    numel = value.numel() if isinstance(value, torch.Tensor) else 0
    try:
        numel = int(numel)
    except TypeError:  # a symbolic size: take the bytes' count
        numel = out // max(1, value.element_size()) if isinstance(value, torch.Tensor) else 0
    flops = _flops(node, matmuls_k, numel)
    return max(flops / rates.flops, moved / rates.bandwidth, rates.floor)


def unit_work(captured: Captured, plan: TPPlan, sequence_parallel: bool = False,
              rates: Rates | None = None) -> dict[str, UnitWork]:
    """Per unit of `captured` (by name): the `UnitWork` of running it under `plan` (see the
    module docstring); `rates` price each node's share (only their ratio matters)."""
    rates = rates or Rates()
    found = _find(captured, plan, sequence_parallel)
    gm = captured.graph_module
    params = dict(gm.named_parameters(remove_duplicate=False))
    matmuls_k: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        mm = matmul_of(node, params)
        if mm is not None:
            matmuls_k[node] = int(params[mm.weight].shape[mm.in_dim])
    totals: dict[int, list[float]] = {}  # unit -> [seconds, sharded seconds, bytes, split, ops]
    for node in gm.graph.nodes:
        unit = captured.unit_of.get(node.name)
        if unit is None or node.op != "call_function":
            continue
        row = totals.setdefault(unit, [0.0, 0.0, 0.0, 0.0, 0.0])
        seconds, made = _seconds(captured, node, matmuls_k, rates), _bytes(captured, node)
        row[0] += seconds
        row[2] += made
        row[4] += 1
        if node in found.sharded:
            row[1] += seconds
            row[3] += made
    collectives: dict[int, list[Collective]] = {}
    for node, c in found.collectives:
        unit = captured.unit_of.get(node.name)
        if unit is not None:
            collectives.setdefault(unit, []).append(c)
    out: dict[str, UnitWork] = {}
    for i, name in enumerate(captured.order):
        s, sh, b, split, ops = totals.get(i, [0.0] * 5)
        out[name] = UnitWork(share=sh / s if s else 0.0, held_share=split / b if b else 0.0,
                             collectives=tuple(collectives.get(i, ())), ops=int(ops))
    return out


def unit_parameters(captured: Captured) -> dict[str, list[str]]:
    """Per unit: the names of the parameters its ops read (each once, in graph order)."""
    gm = captured.graph_module
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    out: dict[str, list[str]] = {u: [] for u in captured.order}
    for node in gm.graph.nodes:
        unit = captured.unit_of.get(node.name)
        if unit is None:
            continue
        held = out[captured.order[unit]]
        for read in node.all_input_nodes:
            name = str(read.target)
            if read.op == "get_attr" and name in params and name not in held:
                held.append(name)
    return out


def stage_lines(captured: Captured, plan: TPPlan,
                stages: Sequence[Sequence[str]]) -> list[str]:
    """Per stage (unit names), a short line of what `plan` splits there: parameters split
    of those held, and the parameter bytes one tp rank holds."""
    held = unit_parameters(captured)
    lines = []
    for units in stages:
        names = list(dict.fromkeys(n for u in units for n in held.get(u, ())))
        split = sum(1 for n in names if plan.dim(n) is not None)
        mine = plan.bytes_per_rank(names)
        lines.append(f"tp={plan.degree}: {split}/{len(names)} split, "
                     f"{mine / 2**20:.3g} MiB/rank")
    return lines


def parameter_share(captured: Captured, plan: TPPlan) -> dict[str, float]:
    """Per unit: the parameter bytes one tp rank holds over the whole unit's (1.0 for a unit
    without parameters)."""
    gm = captured.graph_module
    out: dict[str, float] = {}
    held: dict[int, list[int]] = {}
    for node in gm.graph.nodes:
        unit = captured.unit_of.get(node.name)
        if unit is None:
            continue
        for read in node.all_input_nodes:  # the parameters a unit's ops read, once each
            placed = plan.params.get(str(read.target)) if read.op == "get_attr" else None
            if placed is None:
                continue
            row = held.setdefault(unit, [0, 0])
            row[0] += placed.bytes
            row[1] += placed.bytes if placed.dim is None else placed.bytes // plan.degree
    for i, name in enumerate(captured.order):
        whole, mine = held.get(i, [0, 0])
        out[name] = mine / whole if whole else 1.0
    return out
