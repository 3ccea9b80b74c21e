"""A re-plan from measured costs, the planning phase `Planner.replan` runs on the leader: what
was measured (`Measured`: every stage's measured times, the slowest replica's, and every unit's
profiled costs), the one proposer of a new partition (`propose_rebalance`) and of a new
schedule (`pipeline.planning.synthesis.propose_schedule`), and what the leader decides for
every process (`Replanned`, carried through the agreement by field name, as the first plan
is). The elastic re-plan (a run restarted at another layout) is a re-balance whose measurement
is the unit costs the earlier run kept in its checkpoint (`from_unit_costs`).

A stage's measured deviation from its profile is attributed to its units (`by_rank` False:
every stage runs on the same kind of device, in one process) or to its rank's speed
(`by_rank` True: across processes the deviation is mostly the device's, and a unit moved to a
faster rank gets faster; pipeline.planning.rank_speeds)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from partitioner import Captured, Plan, partition
from pipeline.planning.calibration import (
    Calibration,
    Rebalance,
    calibrated_costs,
    gain,
    measured_node_costs,
)
from pipeline.planning.costs import StageCosts, predict, stage_costs
from pipeline.planning.decision import Decision
from pipeline.planning.rank_speeds import at_speeds, rank_speeds, scaled_units
from pipeline.planning.synthesis import Resynthesis, propose_schedule, running_limits
from scheduler import Op, Schedule, Timeline

Reason = Literal["rebalance", "resynthesize", "elastic"]
REASONS: tuple[Reason, ...] = ("rebalance", "resynthesize", "elastic")
OPS = (Op.F, Op.B, Op.W)


def own_stage_means(trace: Timeline, held: set[int], stages: int) -> list[list[float]]:
    """[op][stage] mean measured seconds of the stages in `held` (0 elsewhere)."""
    sums = [[0.0] * stages for _ in OPS]
    counts = [[0] * stages for _ in OPS]
    for e in trace.events:
        if e.stage in held:
            sums[OPS.index(e.op)][e.stage] += e.duration
            counts[OPS.index(e.op)][e.stage] += 1
    return [[s / c if c else 0.0 for s, c in zip(row, crow, strict=True)]
            for row, crow in zip(sums, counts, strict=True)]


def median_stage_times(steps: Sequence[list[list[float]]]) -> list[list[float]]:
    """[op][stage] median over measured steps of `own_stage_means`."""
    ops, stages = len(steps[0]), len(steps[0][0])
    return [[statistics.median(step[o][s] for step in steps) for s in range(stages)]
            for o in range(ops)]


@dataclass(frozen=True)
class Measured:
    """What a re-plan starts from: `calibration`, the measured stage times (forward, backward,
    weight: the slowest replica's, gathered from every process) with the leader's overhead
    and latency; `units`, the captured model with every unit's profiled costs; `by_rank`:
    attribute a stage's deviation from its profile to its rank's speed (see the module)."""

    calibration: Calibration
    units: Captured
    by_rank: bool


def from_unit_costs(units: Captured, plan: Plan) -> Measured:
    """What an elastic re-plan starts from: `units` carrying the unit costs an earlier run of
    the model measured (its checkpoint's), which are the measurement; each stage's measured
    time is its units' costs summed under the running `plan`, so the proposer partitions on
    the units' own costs (no overhead or latency: this run has measured no step)."""
    costs = stage_costs(units, plan)
    calibration = Calibration(list(costs.forward), list(costs.input_grad),
                              list(costs.weight_grad), overhead=0.0, latency=0.0, steps=0,
                              splits_backward=True)
    return Measured(calibration, units, by_rank=False)


@dataclass(frozen=True)
class Replanned:
    """The leader's re-plan, which every process follows: the report (applied or not, the
    predicted steps) and, when applied, the new partition with its stage costs or the new
    schedule."""

    report: Rebalance | Resynthesis
    plan: Plan | None = None
    costs: StageCosts | None = None
    schedule: Schedule | None = None

    def applied_to(self, decision: Decision) -> Decision:
        """`decision` as this re-plan changes it (itself when not applied), with the report."""
        new = decision
        if self.plan is not None:
            new = dataclasses.replace(decision.repartitioned(self.plan), costs=self.costs)
        elif self.schedule is not None:
            new = decision.rescheduled(self.schedule)
        return dataclasses.replace(new, replanned=self.report)


def propose_rebalance(
    captured: Captured,
    plan: Plan,
    schedule: Schedule,
    calibration: Calibration,
    profiled: StageCosts,
    threshold: float = 0.05,
    *,
    by_rank: bool = False,
) -> tuple[Rebalance, Plan]:
    """Re-partition `captured` (profiled units) from the measured stage times and compare both
    plans' predictions for `schedule` (mean actions, no spread: the choice between two plans
    should not ride on replay draws). `by_rank` False: each stage's units are scaled to its
    measured time (`measured_node_costs`); True: each pipeline rank's speed is its profiled
    over measured time, the units keep their relative costs and each stage gets the work its
    rank's speed carries (`partition(device_speeds=...)`). Applied when the predicted step
    shrinks by more than `threshold` and the stage sizes change."""
    if not captured.profiled:
        raise ValueError(
            "a re-plan needs every unit's profiled costs; pass the units the processes measured "
            "(Executor.measure_units) or a capture profiled with balance='profile'"
        )
    measured = calibrated_costs(calibration, profiled)
    n = schedule.num_stages
    speeds = [1.0] * n
    if by_rank:
        per_rank, base = rank_speeds(measured, profiled, schedule.placement)
        speeds = [per_rank[r] for r in schedule.placement]
        scaled = scaled_units(captured, base)
    else:
        scaled = measured_node_costs(captured, plan, measured)
    new_plan = partition(scaled, n, "profile", device_speeds=speeds if by_rank else None)
    lat, over = calibration.latency, calibration.overhead
    before = predict(schedule, measured, latency=lat, overhead=over).step_time
    after_costs = at_speeds(stage_costs(scaled, new_plan), speeds)
    after = predict(schedule, after_costs, latency=lat, overhead=over).step_time
    report = Rebalance(
        before=plan.sizes, after=new_plan.sizes, predicted_before=before,
        predicted_after=after, threshold=threshold,
        applied=gain(before, after) > threshold and new_plan.sizes != plan.sizes,
        measured=tuple(f + b + w for f, b, w in zip(
            measured.forward, measured.input_grad, measured.weight_grad, strict=True)),
    )
    return report, new_plan


def decide(decision: Decision, measured: Measured, reason: Reason, threshold: float,
           memory_limit: float | None) -> Replanned:
    """(The leader) the re-plan of `decision` for `reason` from what was measured: a new
    schedule ("resynthesize") or a new partition ("rebalance", "elastic")."""
    if reason not in REASONS:
        raise ValueError(f"reason must be one of {list(REASONS)}, got {reason!r}")
    units = measured.units
    profiled = decision.costs or stage_costs(units, decision.plan)
    if reason == "resynthesize":
        limits = running_limits(decision.schedule, profiled, memory_limit)
        synth, schedule = propose_schedule(decision.schedule, measured.calibration, profiled,
                                           limits, threshold)
        return Replanned(synth, schedule=schedule if synth.applied else None)
    report, plan = propose_rebalance(units, decision.plan, decision.schedule,
                                     measured.calibration, profiled, threshold,
                                     by_rank=measured.by_rank)
    if not report.applied:
        return Replanned(report)
    return Replanned(report, plan=plan, costs=stage_costs(units, plan))
