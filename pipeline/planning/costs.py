"""The cost model, in one place: per-stage seconds of F, B (input grad) and W (weight grad) for
one microbatch, summed from a profiled graph over a plan's stages (`stage_costs`), and the one
adapter from those to what each schedule action costs in simulation (`action_costs`, `predict`).
`Pipeline.simulate`, the demo, the benchmarks and the auto-planner all go through it, so they
cannot disagree."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from partitioner import Captured, Plan, UnitCosts, partition
from pipeline.planning.activation_plan import PolicyPrices, priced
from scheduler import Schedule, Timeline, simulate
from scheduler.simulate import Summary, summarize


@dataclass(frozen=True)
class StageCosts:
    """Per stage, for one microbatch: forward, input-grad (B) and weight-grad (W) seconds (the
    profiler's split: B is the measured input-grad walk, W the rest of the backward), the
    activation bytes kept for backward, and the parameter bytes."""

    forward: list[float]
    input_grad: list[float]
    weight_grad: list[float]
    activation_bytes: list[float]
    param_bytes: list[float]
    prices: PolicyPrices | None = None  # each activation policy's, when the units were priced
    policies: tuple[str, ...] = ()  # the activation policy per stage these costs include

    @property
    def backward(self) -> list[float]:
        """The whole backward per stage (input grads + weight grads)."""
        return [i + w for i, w in zip(self.input_grad, self.weight_grad, strict=True)]

    @property
    def num_stages(self) -> int:
        return len(self.forward)


def stage_costs(captured: Captured, plan: Plan) -> StageCosts:
    """Sum a costed capture's `UnitCosts` over each stage of `plan` (a unit without costs
    counts zero)."""
    none = UnitCosts()
    units = [[captured.costs.get(v, none) for v in s] for s in plan.stages]
    return StageCosts(
        forward=[float(sum(c.forward for c in s)) for s in units],
        input_grad=[float(sum(c.input_grad for c in s)) for s in units],
        weight_grad=[float(sum(c.weight_grad for c in s)) for s in units],
        activation_bytes=[float(sum(c.activation_bytes for c in s)) for s in units],
        param_bytes=[float(p) for p in plan.stage_params],
        prices=priced(captured.costs, plan.stages),
    )


def with_policies(costs: StageCosts, policies: Sequence[str]) -> StageCosts:
    """`costs` of stages running under activation `policies` (one name per stage; see
    pipeline.planning.activation_plan): the kept bytes as activations, the time each adds to
    F and B (the recomputation runs in B; a split backward's W recomputes nothing)."""
    prices = costs.prices
    if prices is None:
        raise ValueError("these costs carry no activation prices: price the units first "
                         "(partitioner.activation_cost.price_policies)")
    n = costs.num_stages
    forward = [costs.forward[s] + prices.forward[p][s] for s, p in enumerate(policies)]
    input_grad = [costs.input_grad[s] + prices.backward[p][s] for s, p in enumerate(policies)]
    return replace(costs, forward=forward, input_grad=input_grad,
                   activation_bytes=[prices.kept[p][s] for s, p in enumerate(policies)][:n],
                   policies=tuple(policies))


def costs_for_stages(
    captured: Captured, stages: int, balance: str = "profile"
) -> StageCosts:
    """The stage costs of the plan `Pipeline` would make for `stages` stages of this model."""
    return stage_costs(captured, partition(captured, stages, balance))


def action_costs(
    costs: StageCosts, schedule: Schedule
) -> tuple[list[float], list[float], list[float]]:
    """(F, B, W) seconds per stage as the runtime runs `schedule`'s actions. Unsplit backward:
    B is the whole backward and W is 0. Split backward: B is the input-grad part and W the
    weight-grad part, except on stage 0, whose inputs need no gradient: its B does nothing and
    its W is the whole backward."""
    if costs.num_stages != schedule.num_stages:
        raise ValueError(
            f"costs cover {costs.num_stages} stages but schedule {schedule.name!r} has "
            f"{schedule.num_stages}; partition for {schedule.num_stages} stages "
            "(costs_for_stages) first"
        )
    f = list(costs.forward)
    if not schedule.splits_backward:
        return f, costs.backward, [0.0] * len(f)
    b, w = list(costs.input_grad), list(costs.weight_grad)
    b[0], w[0] = 0.0, b[0] + w[0]
    return f, b, w


def predict(
    schedule: Schedule,
    costs: StageCosts,
    *,
    latency: float = 0.0,
    overhead: float = 0.0,
    spread: Sequence[float] = (),
    replays: int = 31,
) -> Timeline:
    """The predicted Timeline of one step: `action_costs` plus `overhead` seconds per action
    (the runtime's own work around each one) and `latency` seconds per cross-rank transfer.
    Its memory curve is in activation bytes.

    `spread`: measured action times relative to their mean (`Calibration.spread`). A pipeline
    waits for its slowest actions, so a step of varying actions is longer than one of mean
    actions; with a spread, `replays` steps are simulated with each action's compute scaled by
    a draw from it (seeded: the same answer every call) and the median one is returned."""
    steps = replay(
        schedule, costs, latency=latency, overhead=overhead, spread=spread, replays=replays
    )
    return steps[len(steps) // 2]


def replay(
    schedule: Schedule,
    costs: StageCosts,
    *,
    latency: float = 0.0,
    overhead: float = 0.0,
    spread: Sequence[float] = (),
    replays: int = 31,
) -> list[Timeline]:
    """The Timelines `predict` takes the median of, sorted by step time: one step of mean
    actions without a spread, else `replays` seeded draws (see `predict`)."""
    f, b, w = _with_overhead(costs, schedule, overhead)
    if not spread:
        return [simulate(schedule, f, b, w, latency, activation=costs.activation_bytes)]
    base = action_costs(costs, schedule)
    draws = random.Random(0)

    def scale(stage: int, op: int, microbatch: int) -> float:
        compute = base[op][stage]
        total = compute + overhead
        return (compute * draws.choice(spread) + overhead) / total if total > 0 else 1.0

    return sorted(
        (simulate(schedule, f, b, w, latency, activation=costs.activation_bytes, scale=scale)
         for _ in range(replays)),
        key=lambda t: t.step_time,
    )


def predict_summary(
    schedule: Schedule, costs: StageCosts, *, latency: float = 0.0, overhead: float = 0.0
) -> Summary:
    """`predict`'s step time, bubble and peak activation bytes per rank, without building the
    Timeline (for a generator's schedule; the planner calls this thousands of times)."""
    f, b, w = _with_overhead(costs, schedule, overhead)
    return summarize(schedule, f, b, w, latency, costs.activation_bytes)


def _with_overhead(
    costs: StageCosts, schedule: Schedule, overhead: float
) -> tuple[list[float], list[float], list[float]]:
    f, b, w = action_costs(costs, schedule)
    f = [x + overhead for x in f]
    b = [x + overhead for x in b]
    if schedule.splits_backward:
        w = [x + overhead for x in w]
    return f, b, w
