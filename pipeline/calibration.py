"""Calibration: fold what isolated profiling misses (threads contending for cores and memory,
the runtime's own work around each action, the time a tensor takes to reach the next rank)
into the cost model, from measured step traces.

From the traces of a few steps (after a warm-up step) of one schedule:
- per (stage, op) the mean measured action time (Events time compute only), which carries
  the contention of the ranks running side by side;
- `overhead`: the mean idle gap between two consecutive actions of a rank when the second
  one's inputs were all made on that rank (bookkeeping, send posting, stream handoffs);
- `latency`: the mean extra wait for a cross-rank input beyond that overhead.
Means, not medians: a step's makespan adds durations up, and on a loaded machine the rare
long ones (a descheduled thread) are a real part of it.
`calibrated_costs` turns them into `StageCosts` (an unsplit schedule's measured backward is
divided as the profile divides it) for `pipeline.costs.predict(..., latency=, overhead=)`.
`measured_node_costs` rescales the profiled node times of each stage to its measured total, for
re-partitioning from measured costs (see `Pipeline.rebalance`). `held_out_check` runs a
calibration pass and held-out steps on a Pipeline and compares (benchmarks and the demo).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import networkx as nx

from partitioner import Plan
from pipeline.costs import StageCosts
from scheduler import Action, Op, Schedule, Timeline
from scheduler.validate import dependencies


@dataclass(frozen=True)
class Calibration:
    """Measured means: `forward`, `backward`, `weight` seconds per stage as the runtime ran
    them (backward is input-grad only when the schedule splits it; weight is 0 otherwise),
    `overhead` seconds per action and `latency` seconds per cross-rank input, from `steps`
    traces."""

    forward: list[float]
    backward: list[float]
    weight: list[float]
    overhead: float
    latency: float
    steps: int
    splits_backward: bool


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def calibrate(schedule: Schedule, traces: Sequence[Timeline]) -> Calibration:
    """Means over `traces` (measured steps of `schedule`; leave out the first, warm-up one)."""
    if not traces:
        raise ValueError("calibrate needs at least one measured trace; run a step first")
    n = schedule.num_stages
    durations: dict[tuple[int, Op], list[float]] = {}
    gaps: list[float] = []
    waits: list[float] = []
    for trace in traces:
        ends = {(e.stage, e.op, e.microbatch): e.end for e in trace.events}
        for e in trace.events:
            durations.setdefault((e.stage, e.op), []).append(e.duration)
        for rank in range(trace.num_ranks):
            events = trace.for_rank(rank)
            for prev, e in zip(events, events[1:], strict=False):
                inputs = [
                    (d.stage, d.op, d.microbatch)
                    for d in dependencies(Action(e.stage, e.op, e.microbatch), n)
                ]
                remote = [ends[k] for k in inputs if schedule.placement[k[0]] != rank and k in ends]
                if not remote:
                    gaps.append(e.start - prev.end)  # inputs on this rank: ready at prev.end
                elif max(remote) > prev.end:
                    waits.append(e.start - max(remote))  # waited for the transfer
                # (a remote input that ended before prev.end may still have been in flight)
    overhead = max(0.0, _mean(gaps))
    per = {key: _mean(v) for key, v in durations.items()}
    return Calibration(
        forward=[per.get((s, Op.F), 0.0) for s in range(n)],
        backward=[per.get((s, Op.B), 0.0) for s in range(n)],
        weight=[per.get((s, Op.W), 0.0) for s in range(n)],
        overhead=overhead,
        latency=max(0.0, _mean(waits) - overhead),
        steps=len(traces),
        splits_backward=schedule.splits_backward,
    )


def calibrated_costs(calibration: Calibration, profiled: StageCosts) -> StageCosts:
    """`profiled` with its times replaced by the measured ones. Split-backward measurements
    map directly (stage 0's empty B and whole-backward W included); an unsplit measured
    backward is divided into input and weight grad in the profile's proportions."""
    if len(calibration.forward) != profiled.num_stages:
        raise ValueError(
            f"the calibration has {len(calibration.forward)} stages and the costs "
            f"{profiled.num_stages}; calibrate on the schedule of this plan"
        )
    if calibration.splits_backward:
        input_grad, weight_grad = list(calibration.backward), list(calibration.weight)
    else:
        input_grad, weight_grad = [], []
        for full, i, w in zip(
            calibration.backward, profiled.input_grad, profiled.weight_grad, strict=True
        ):
            share = i / (i + w) if i + w > 0 else 1.0
            input_grad.append(full * share)
            weight_grad.append(full * (1.0 - share))
    return replace(
        profiled, forward=list(calibration.forward), input_grad=input_grad,
        weight_grad=weight_grad,
    )


def measured_node_costs(graph: nx.DiGraph, plan: Plan, measured: StageCosts) -> nx.DiGraph:
    """A copy of `graph` whose node times are scaled, stage by stage, so that each stage's
    forward and backward sums equal the measured ones: the profile's split of a stage among
    its nodes, the measurement's totals. Partition it to re-balance from measured costs."""
    scaled = graph.copy()
    for k, nodes in enumerate(plan.stages):
        f_prof = sum(graph.nodes[v].get("forward_time", 0.0) for v in nodes)
        b_prof = sum(graph.nodes[v].get("backward_time", 0.0) for v in nodes)
        f_ratio = measured.forward[k] / f_prof if f_prof > 0 else 1.0
        b_ratio = measured.backward[k] / b_prof if b_prof > 0 else 1.0
        for v in nodes:
            node = scaled.nodes[v]
            node["forward_time"] = node.get("forward_time", 0.0) * f_ratio
            for key in ("backward_time", "input_grad_time", "weight_grad_time"):
                node[key] = node.get(key, 0.0) * b_ratio
    return scaled


@dataclass(frozen=True)
class Rebalance:
    """A re-partition proposed from measured costs: stage sizes (nodes per stage) before and
    after, the calibrated predicted step time of each, and whether it was applied (only when
    the gain 1 - after/before exceeds the threshold)."""

    before: list[int]
    after: list[int]
    predicted_before: float
    predicted_after: float
    threshold: float
    applied: bool

    @property
    def gain(self) -> float:
        return 1.0 - self.predicted_after / self.predicted_before if self.predicted_before else 0.0

    def __str__(self) -> str:
        verdict = "applied" if self.applied else f"kept the plan (gain <= {self.threshold:.0%})"
        return (
            f"re-balance from measured costs: stages {self.before} -> {self.after}, predicted "
            f"step {1e3 * self.predicted_before:.2f} -> {1e3 * self.predicted_after:.2f} ms "
            f"({self.gain:+.1%}); {verdict}"
        )


def propose_rebalance(
    graph: nx.DiGraph,
    plan: Plan,
    schedule: Schedule,
    calibration: Calibration,
    profiled: StageCosts,
    threshold: float = 0.05,
) -> tuple[Rebalance, Plan]:
    """Re-partition `graph` on measured node costs (`measured_node_costs`) and compare both
    plans' calibrated predictions for `schedule`; the Rebalance says whether the new plan cuts
    the predicted step by more than `threshold`."""
    from partitioner import partition
    from pipeline.costs import predict, stage_costs

    measured = calibrated_costs(calibration, profiled)
    scaled = measured_node_costs(graph, plan, measured)
    new_plan = partition(scaled, schedule.num_stages, "profile")
    timing = {"latency": calibration.latency, "overhead": calibration.overhead}
    before = predict(schedule, measured, **timing).step_time
    after = predict(schedule, stage_costs(scaled, new_plan), **timing).step_time
    gain = 1.0 - after / before if before > 0 else 0.0
    report = Rebalance(
        before=plan.sizes, after=new_plan.sizes, predicted_before=before,
        predicted_after=after, threshold=threshold,
        applied=gain > threshold and new_plan.sizes != plan.sizes,
    )
    return report, new_plan


@dataclass(frozen=True)
class Check:
    """A held-out check of the cost model on one schedule: the median measured step (trace
    makespan) of the held-out steps, the prediction from profiled costs, and the one from costs
    calibrated on the steps before them."""

    schedule: str
    measured: float
    profiled: float
    calibrated: float
    calibration: Calibration

    @property
    def profiled_error(self) -> float:
        return self.profiled / self.measured - 1.0

    @property
    def calibrated_error(self) -> float:
        return self.calibrated / self.measured - 1.0


def held_out_check(
    pipe: Any, x: Any, y: Any, calibration_steps: int = 3, measured_steps: int = 5
) -> Check | None:
    """Run 1 warm-up step, `calibration_steps` steps to calibrate on and `measured_steps`
    held-out steps on `pipe` (a Pipeline; gradients are cleared before each step), and compare.
    None on a process whose traces are incomplete (under torch.distributed: not rank 0)."""
    from pipeline.costs import predict

    traces = []
    for _ in range(1 + calibration_steps + measured_steps):
        pipe.zero_grad()
        pipe.step(x, y)
        traces.append(pipe.trace)
    schedule = pipe.schedule
    ops = 3 if schedule.splits_backward else 2
    if any(t is None or len(t.events) != ops * schedule.num_stages * schedule.num_microbatches
           for t in traces):
        return None
    cal = calibrate(schedule, traces[1:1 + calibration_steps])
    costs = calibrated_costs(cal, pipe.profiled_costs())
    calibrated = predict(schedule, costs, latency=cal.latency, overhead=cal.overhead)
    return Check(
        schedule=schedule.name,
        measured=statistics.median(t.step_time for t in traces[1 + calibration_steps:]),
        profiled=pipe.simulate(calibrated=False).step_time,
        calibrated=calibrated.step_time,
        calibration=cal,
    )
