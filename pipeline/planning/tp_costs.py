"""Costs under tensor parallelism: each unit of a profiled capture priced at its shard shapes
plus its collectives on the tp group, as one tp rank runs it (every rank of a tp group runs
the same work in step, so the simulator runs one of them per pipeline rank).

Per unit (partitioner.tp_work says which of its nodes the plan splits and which collectives
the tensor-parallel pass adds):
- its profiled F, B and W seconds scaled by ``1 - share + share / tp``, `share` the part of
  its roofline seconds in nodes that run at shard shapes (split matmuls, the attention and
  activations between a column- and a row-parallel matmul, a vocab-parallel lookup);
- plus each forward collective in F and each backward one in B (W runs none), priced by
  the fitted collectives of the tp group (pipeline.planning.hardware.group_collectives:
  latency + bytes x factor / bus bandwidth through the collective model);
- plus DTensor's measured seconds per op for every op it runs (in F, and split between B and
  W as their times);
- its activation bytes scaled by the split part of the bytes its nodes make;
- its parameter bytes per rank from the plan (`Width.param_share`): what the memory model and
  the data-parallel all-reduce see.

`Width` carries one degree's costed capture for the auto-planner
(pipeline.planning.autoplan.search)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from partitioner import Captured, UnitCosts, partition
from partitioner.tp_plan import TPPlan, derive_tp_plan, given_tp_plan
from partitioner.tp_work import UnitWork, parameter_share, unit_work
from pipeline.planning.costs import StageCosts, stage_costs


class CollectiveTimes(Protocol):
    """What prices a collective: seconds of `kind` of `nbytes` on a group of `ranks`, and
    DTensor's seconds per op (`dispatch`)."""

    @property
    def dispatch(self) -> float: ...

    def seconds(self, kind: str, nbytes: float, ranks: int) -> float: ...


def unit_costs_at(costs: UnitCosts, work: UnitWork, degree: int,
                  collectives: CollectiveTimes) -> UnitCosts:
    """One unit's `costs` (profiled whole) as one of `degree` tp ranks runs it (see the
    module docstring)."""
    k = 1.0 - work.share + work.share / degree
    forward = sum(collectives.seconds(c.kind, c.bytes, degree)
                  for c in work.collectives if c.phase == "forward")
    backward = sum(collectives.seconds(c.kind, c.bytes, degree)
                   for c in work.collectives if c.phase == "backward")
    dispatch = collectives.dispatch * work.ops
    b, w = costs.input_grad * k, costs.weight_grad * k
    to_b = b / (b + w) if b + w > 0 else 1.0
    held = 1.0 - work.held_share + work.held_share / degree
    return dataclasses.replace(
        costs, forward=costs.forward * k + forward + dispatch,
        input_grad=b + backward + dispatch * to_b, weight_grad=w + dispatch * (1 - to_b),
        activation_bytes=costs.activation_bytes * held, policies=None)


@dataclass(frozen=True)
class Width:
    """One tensor-parallel degree as the planner prices it: `captured` carrying the costs of
    one tp rank (`unit_costs_at`), `param_share` per unit (bytes a rank holds over the
    whole), the `plan` (None at tp=1) and the `work` per unit it came from."""

    tp: int
    captured: Captured
    param_share: Mapping[str, float] = field(default_factory=dict)
    plan: TPPlan | None = None
    work: Mapping[str, UnitWork] = field(default_factory=dict)

    def stage_costs(self, stages: int, balance: str = "profile") -> StageCosts:
        """The stage costs of the partition `Pipeline` makes for `stages` stages from these
        costs, parameter bytes per tp rank."""
        plan = partition(self.captured, stages, balance)
        costs = stage_costs(self.captured, plan)
        if self.tp == 1:
            return costs
        nodes = self.captured.nodes
        shares = []
        for units in plan.stages:
            whole = sum(float(nodes[u].get("param_bytes", 0)) for u in units)
            mine = sum(float(nodes[u].get("param_bytes", 0)) * self.param_share.get(u, 1.0)
                       for u in units)
            shares.append(mine / whole if whole else 1.0)
        return replace(costs, param_bytes=[b * s for b, s in
                                            zip(costs.param_bytes, shares, strict=True)],
                       prices=None)

    def describe(self) -> str:
        """What the plan splits and the collectives per step of one microbatch."""
        if self.plan is None:
            return "tensor parallel 1: nothing split"
        counts: dict[tuple[str, str], int] = {}
        for w in self.work.values():
            for c in w.collectives:
                counts[(c.phase, c.kind)] = counts.get((c.phase, c.kind), 0) + 1
        parts = ", ".join(f"{n} {kind} ({phase})" for (phase, kind), n in sorted(counts.items()))
        return (f"tensor parallel {self.tp}: {len(self.plan.sharded)} of "
                f"{len(self.plan.params)} parameters split; per microbatch {parts or 'none'}")


def whole(captured: Captured) -> Width:
    """tp=1: the capture as profiled."""
    return Width(1, captured, {u: 1.0 for u in captured.order})


def width(captured: Captured, degree: int, collectives: CollectiveTimes, *,
          sequence_parallel: bool = False, rules: Mapping[str, Any] | None = None) -> Width:
    """The profiled `captured` priced at `degree` tp ranks: the plan derived from its graph
    (or given by `rules`, a ``tp_plan``), each unit's costs at shard shapes with its
    collectives (`unit_costs_at`). ValueError when the capture has no costs."""
    if degree == 1:
        return whole(captured)
    if not captured.profiled:
        raise ValueError("tensor-parallel costs start from profiled units: profile the capture "
                         "first (partitioner.profile or estimate)")
    gm = captured.graph_module
    plan = derive_tp_plan(gm, degree) if rules is None else given_tp_plan(gm, degree, rules)
    work = unit_work(captured, plan, sequence_parallel)
    costs = {u: unit_costs_at(captured.costs[u], work[u], degree, collectives)
             for u in captured.order}
    return Width(degree, captured.with_costs(costs), parameter_share(captured, plan), plan, work)
