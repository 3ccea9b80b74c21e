"""Calibration: fold what isolated profiling misses (threads contending for cores and memory,
the runtime's own work around each action, the time a tensor takes to reach the next rank)
into the cost model, from measured step traces.

From the traces of a few steps (after a warm-up step) of one schedule:
- per (stage, op) the mean measured action time (Events time compute only), which carries
  the contention of the ranks running side by side;
- `overhead` (the runtime's work between two actions of a rank: bookkeeping, send posting,
  stream handoffs) and `latency` (the time a tensor takes to reach another rank), fitted to
  every idle gap between two consecutive actions of a rank (see `_fit_gaps`).
Within a step means, not medians: a step's makespan adds durations up, and on a loaded
machine the rare long ones (a descheduled thread) are a real part of it. `calibrated_costs`
turns them into `StageCosts` (an unsplit schedule's measured backward is divided as the
profile divides it) for `pipeline.planning.costs.predict(..., latency=, overhead=)`.

Across steps: `predict_calibrated` predicts steps from each measured step's own calibration
and returns the median of them all. Not one prediction from the median of each
figure: a step's time is about a sum of its figures, the figures are right-skewed here (a
transfer or an action that waits for a descheduled thread) and vary together within a step,
and the median of a sum exceeds the sum of the medians (against the median of the steps it
was calibrated on, the median-figures prediction was 2.5% short on average and up to 12.5%
over four runs of benchmarks/bench_calibration.py; the median prediction 0.8%, at most
7.6%). The medians of the figures (`calibrate`'s fields) stay what re-partitioning compares
plans on.
`measured_node_costs` rescales the profiled node times of each stage to its measured total, for
re-partitioning from measured costs (pipeline.planning.replan, `Pipeline.rebalance`).
`held_out_check` runs a calibration pass and held-out steps on a Pipeline and compares
(benchmarks and the demo).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from partitioner import Captured, Plan, UnitCosts
from pipeline.planning.costs import StageCosts, predict, replay
from scheduler import Action, Op, Schedule, Timeline
from scheduler.validate import dependencies


@dataclass(frozen=True)
class Calibration:
    """Measured means: `forward`, `backward`, `weight` seconds per stage as the runtime ran
    them (backward is input-grad only when the schedule splits it; weight is 0 otherwise),
    `overhead` seconds per action and `latency` seconds per cross-rank input, from `steps`
    traces (across steps: the median of each); `spread`: every measured action's time over
    its step's mean for its stage and op (for `pipeline.planning.costs.predict`); `per_step`: the
    calibration of each step alone (empty on a one-step calibration: it is its own); `scale`:
    the measured step over the one its own figures simulate (across steps: the median)."""

    forward: list[float]
    backward: list[float]
    weight: list[float]
    overhead: float
    latency: float
    steps: int
    splits_backward: bool
    spread: tuple[float, ...] = ()
    per_step: tuple[Calibration, ...] = ()
    scale: float = 1.0  # measured step over the step these figures simulate (see `_scale`)

    @property
    def step_calibrations(self) -> tuple[Calibration, ...]:
        """The calibration of each measured step (this one, for a single step)."""
        return self.per_step or (self,)


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _fit_gaps(gaps: Sequence[tuple[float, float | None]]) -> tuple[float, float]:
    """(overhead, latency) fitting every idle gap between two actions of a rank, in the least
    squares sense, to ``overhead + max(0, slack + latency)``: `slack` is how long after the
    earlier action's end the later one's last input from another rank was made (None when
    every input was made on the rank: the gap is then the overhead alone). Between two
    latencies where a wait starts (-slack) the error is quadratic: its minimum is exact."""
    if not gaps:
        return 0.0, 0.0

    def fit(latency: float) -> tuple[float, float]:  # (squared error, best overhead)
        waits = [0.0 if sl is None else max(0.0, sl + latency) for _, sl in gaps]
        overhead = _mean([g - w for (g, _), w in zip(gaps, waits, strict=True)])
        return sum((g - overhead - w) ** 2 for (g, _), w in zip(gaps, waits, strict=True)), overhead

    starts = sorted({0.0, *(max(0.0, -sl) for _, sl in gaps if sl is not None)})
    candidates = list(starts)
    for low, high in zip(starts, [*starts[1:], math.inf], strict=True):
        mid = low + 1.0 if high == math.inf else (low + high) / 2  # the gaps waiting inside
        active = [sl is not None and sl + mid > 0 for _, sl in gaps]
        share = _mean([float(a) for a in active])
        base = _mean([g - (sl if a and sl is not None else 0.0)
                      for (g, sl), a in zip(gaps, active, strict=True)])
        d = [g - (sl if a and sl is not None else 0.0) - base
             for (g, sl), a in zip(gaps, active, strict=True)]
        e = [share - float(a) for a in active]
        norm = sum(x * x for x in e)
        if norm > 0:
            best = -sum(x * y for x, y in zip(d, e, strict=True)) / norm
            candidates.append(min(high, max(low, best)))
    _, overhead, latency = min((*fit(lat), lat) for lat in candidates)
    return max(0.0, overhead), latency


def _one_step(schedule: Schedule, trace: Timeline) -> Calibration:
    """The means of one measured step, and the overhead and latency its gaps fit."""
    n = schedule.num_stages
    durations: dict[tuple[int, Op], list[float]] = {}
    gaps: list[tuple[float, float | None]] = []
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
            gaps.append((e.start - prev.end, max(remote) - prev.end if remote else None))
    overhead, latency = _fit_gaps(gaps)
    per = {key: _mean(v) for key, v in durations.items()}
    step = Calibration(
        forward=[per.get((s, Op.F), 0.0) for s in range(n)],
        backward=[per.get((s, Op.B), 0.0) for s in range(n)],
        weight=[per.get((s, Op.W), 0.0) for s in range(n)],
        overhead=overhead,
        latency=latency,
        steps=1,
        splits_backward=schedule.splits_backward,
        spread=tuple(d / per[key] for key, ds in durations.items() if per[key] > 0 for d in ds),
    )
    return replace(step, scale=_scale(schedule, step, trace.step_time))


def _scale(schedule: Schedule, step: Calibration, measured: float) -> float:
    """`measured` over the step `step`'s own figures simulate for the schedule they were
    measured on (as `predict_calibrated` replays them). The simulator gives each rank a core
    of its own and draws the actions' variations independently; where ranks share fewer
    cores (rank threads of one process on a small CPU) or vary together, its steps come out
    longer or shorter than the measured ones by a like factor for every configuration
    (+7% to +19% at 4 ranks on 2 cores, benchmarks/bench_activations.py), which this
    measures and `predict_calibrated` applies."""
    n = schedule.num_stages
    costs = StageCosts(forward=list(step.forward), input_grad=list(step.backward),
                       weight_grad=list(step.weight), activation_bytes=[0.0] * n,
                       param_bytes=[0.0] * n)
    runs = replay(schedule, costs, overhead=step.overhead, latency=step.latency,
                  spread=step.spread)
    simulated = runs[len(runs) // 2].step_time
    return measured / simulated if simulated > 0 and measured > 0 else 1.0


def calibrate(schedule: Schedule, traces: Sequence[Timeline]) -> Calibration:
    """Per measured step of `schedule` (leave out the first, warm-up one) the means, then
    across steps the median of each (a step that another process on the machine slowed down
    moves them little), with each step's own calibration kept in `per_step`."""
    if not traces:
        raise ValueError("calibrate needs at least one measured trace; run a step first")
    steps = [_one_step(schedule, t) for t in traces]
    if len(steps) == 1:
        return steps[0]
    median = statistics.median

    def per_stage(field: str) -> list[float]:
        return [median(column) for column in zip(*(getattr(c, field) for c in steps), strict=True)]

    return Calibration(
        forward=per_stage("forward"),
        backward=per_stage("backward"),
        weight=per_stage("weight"),
        overhead=median([c.overhead for c in steps]),
        latency=median([c.latency for c in steps]),
        steps=len(steps),
        splits_backward=schedule.splits_backward,
        spread=tuple(r for c in steps for r in c.spread),
        per_step=tuple(steps),
        scale=median([c.scale for c in steps]),
    )


def predict_calibrated(
    schedule: Schedule,
    calibration: Calibration,
    costs: Callable[[Calibration], StageCosts],
    latency: float | None = None,
) -> Timeline:
    """The median step predicted from each measured step's own calibration
    (`Calibration.step_calibrations`): every step's replays (`pipeline.planning.costs.replay`, with
    its overhead, latency unless `latency` is given, and spread; `costs(step)` gives its stage
    costs, usually ``calibrated_costs(step, profiled)``) pooled, and the median of them, so an
    even number of steps needs no tie-break. Each step's replays are scaled by its `scale`
    (the measured step over the one its figures simulate for the schedule it ran)."""
    predicted = sorted(
        (
            _scaled(timeline, step.scale)
            for step in calibration.step_calibrations
            for timeline in replay(
                schedule, costs(step), overhead=step.overhead, spread=step.spread,
                latency=step.latency if latency is None else latency,
            )
        ),
        key=lambda t: t.step_time,
    )
    return predicted[len(predicted) // 2]


def _scaled(timeline: Timeline, factor: float) -> Timeline:
    if factor == 1.0:
        return timeline
    events = tuple(replace(e, start=e.start * factor, end=e.end * factor)
                   for e in timeline.events)
    return Timeline(events, timeline.num_ranks, timeline.splits_backward, timeline.name,
                    timeline.activation, timeline.activation_unit)


def calibrated_costs(calibration: Calibration, profiled: StageCosts) -> StageCosts:
    """`profiled` with its times replaced by the measured ones. Split-backward measurements
    map directly (stage 0's empty B and whole-backward W included); an unsplit measured
    backward is divided into input and weight grad in the profile's proportions. The
    activation policies' recompute prices (if priced) scale with each stage's measured over
    profiled compute; the calibration should come from steps without recomputation."""
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
    prices = profiled.prices
    if prices is not None:  # recomputation runs at the stage's measured speed
        speed = [(f + b + w) / (pf + pi + pw) if pf + pi + pw > 0 else 1.0
                 for f, b, w, pf, pi, pw in zip(
                     calibration.forward, input_grad, weight_grad, profiled.forward,
                     profiled.input_grad, profiled.weight_grad, strict=True)]
        prices = prices.at_speed(speed)
    return replace(
        profiled, forward=list(calibration.forward), input_grad=input_grad,
        weight_grad=weight_grad, prices=prices,
    )


def measured_node_costs(captured: Captured, plan: Plan, measured: StageCosts) -> Captured:
    """A copy of `captured` whose unit times are scaled, stage by stage, so that each stage's
    forward and backward sums equal the measured ones: the profile's split of a stage among
    its units, the measurement's totals. Partition it to re-balance from measured costs."""
    costs = {v: captured.costs.get(v, UnitCosts()) for v in captured.order}
    for k, nodes in enumerate(plan.stages):
        f_prof = sum(costs[v].forward for v in nodes)
        b_prof = sum(costs[v].backward for v in nodes)
        f_ratio = measured.forward[k] / f_prof if f_prof > 0 else 1.0
        b_ratio = measured.backward[k] / b_prof if b_prof > 0 else 1.0
        for v in nodes:
            costs[v] = costs[v].scaled(f_ratio, b_ratio)
    return captured.with_costs(costs)


def gain(before: float, after: float) -> float:
    """The share of the predicted step a re-plan saves: 1 - after/before (0 with no step)."""
    return 1.0 - after / before if before else 0.0


@dataclass(frozen=True)
class ReplanReport:
    """What a re-plan from measured costs proposed (a `Rebalance` or a
    pipeline.planning.synthesis `Resynthesis`): the calibrated predicted step of the running
    plan and of the new one, and whether it was applied (only when the gain 1 - after/before
    exceeds the threshold)."""

    predicted_before: float
    predicted_after: float
    threshold: float
    applied: bool

    @property
    def gain(self) -> float:
        return gain(self.predicted_before, self.predicted_after)


@dataclass(frozen=True)
class Rebalance(ReplanReport):
    """A re-partition: stage sizes (nodes per stage) before and after, and `measured`: each
    stage's measured seconds per microbatch (forward + backward) it started from."""

    before: list[int]
    after: list[int]
    measured: tuple[float, ...] = ()

    def __str__(self) -> str:
        verdict = "applied" if self.applied else f"kept the plan (gain <= {self.threshold:.0%})"
        measured = (f" (measured {', '.join(f'{1e3 * t:.2f}' for t in self.measured)} ms "
                    "per microbatch)" if self.measured else "")
        return (
            f"re-balance from measured costs: stages {self.before}{measured} -> {self.after}, "
            f"predicted step {1e3 * self.predicted_before:.2f} -> "
            f"{1e3 * self.predicted_after:.2f} ms ({self.gain:+.1%}); {verdict}"
        )


@dataclass(frozen=True)
class Check:
    """A held-out check of the cost model on one schedule: the median measured step (trace
    makespan) of the held-out steps, the prediction from profiled costs, and the one from costs
    calibrated on the steps taking turns with them (`predict_calibrated`); `step_noise`: half
    the interquartile range of the held-out step times over their median (how far one step
    strays from the median on this machine); `remeasured`: the median measured step of the
    calibration steps themselves, i.e. the held-out steps predicted by measuring again, whose
    error is the floor set by the machine's noise (two medians of the same run's steps
    disagree by it; no cost model can be expected to do better)."""

    schedule: str
    measured: float
    profiled: float
    calibrated: float
    calibration: Calibration
    step_noise: float
    remeasured: float

    @property
    def profiled_error(self) -> float:
        return self.profiled / self.measured - 1.0

    @property
    def calibrated_error(self) -> float:
        return self.calibrated / self.measured - 1.0

    @property
    def remeasured_error(self) -> float:
        return self.remeasured / self.measured - 1.0

    @property
    def fit_error(self) -> float:
        """The calibrated prediction against the median of the steps it was calibrated on:
        the model's own error, without the noise between two sets of steps."""
        return self.calibrated / self.remeasured - 1.0


def held_out_check(
    pipe: Any, x: Any, y: Any, calibration_steps: int = 3, measured_steps: int = 5,
    profiled: StageCosts | None = None,
) -> Check | None:
    """Run 1 warm-up step, then `calibration_steps` steps to calibrate on and `measured_steps`
    held-out steps on `pipe` (a Pipeline; gradients are cleared before each step), taking
    turns (so both sample the machine as it is: other work on a shared machine drifts its
    speed by more than 10% within seconds), and compare. None on a process whose traces are
    incomplete (under torch.distributed: not rank 0). `profiled`: the plan's profiled stage
    costs (default `pipe.profiled_costs()`; pass them for a distributed Pipeline that was not
    built with balance="profile", which cannot profile once split)."""
    total = calibration_steps + measured_steps
    held_out = {round((k + 0.5) * total / measured_steps) - 1 for k in range(measured_steps)}
    calibration: list[Timeline | None] = []
    measured: list[Timeline | None] = []
    for i in range(1 + total):
        pipe.zero_grad()
        pipe.step(x, y)
        if i > 0:
            (measured if i - 1 in held_out else calibration).append(pipe.trace)
    schedule = pipe.schedule
    ops = 3 if schedule.splits_backward else 2
    traces = [t for t in (*calibration, *measured)
              if t is not None and len(t.events) == ops * schedule.num_stages
              * schedule.num_microbatches]
    if len(traces) != total:
        return None
    cal = calibrate(schedule, traces[:calibration_steps])
    if profiled is None:
        profiled = pipe.profiled_costs()
    base = profiled
    calibrated = predict_calibrated(schedule, cal, lambda step: calibrated_costs(step, base))
    held = [t.step_time for t in traces[calibration_steps:]]
    q1, median, q3 = statistics.quantiles(held, n=4) if len(held) > 1 else [held[0]] * 3
    return Check(
        schedule=schedule.name,
        measured=statistics.median(held),
        profiled=predict(schedule, profiled).step_time,
        calibrated=calibrated.step_time,
        calibration=cal,
        step_noise=(q3 - q1) / (2 * median) if median > 0 else 0.0,
        remeasured=statistics.median(t.step_time for t in traces[:calibration_steps]),
    )
