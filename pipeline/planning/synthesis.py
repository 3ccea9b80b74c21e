"""Synthesised schedules in planning: `scheduler.synthesize` fed from the cost model (profiled
or calibrated `StageCosts` as the runtime runs a split backward, the runtime's overhead per
action, the transfer latency), a memory limit in bytes turned into the in-flight count it
allows each rank, and the re-synthesis `Pipeline(schedule="auto")` proposes from measured
costs once steps have run (`propose_schedule`, applied like a re-balance)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.planning.calibration import Calibration, ReplanReport, calibrated_costs
from pipeline.planning.costs import StageCosts, predict
from scheduler import Schedule, synthesize
from scheduler.simulate import peak_held

OPTIMIZER_FACTOR = 4.0
"""Bytes held per parameter byte: the weight, its gradient and Adam's two moments."""



def split_costs(costs: StageCosts, overhead: float = 0.0) -> tuple[list[float], ...]:
    """(F, B, W) per stage as a split-backward schedule runs them (stage 0's B is empty, its W
    the whole backward: `pipeline.planning.costs.action_costs`), `overhead` added to each."""
    b, w = list(costs.input_grad), list(costs.weight_grad)
    b[0], w[0] = 0.0, b[0] + w[0]
    return tuple([x + overhead for x in values] for values in (costs.forward, b, w))


def inflight_limits(
    costs: StageCosts, ranks: int, microbatches: int, virtual_stages: int,
    memory_limit: float | None, fixed: Sequence[float] | None = None,
) -> list[int] | None:
    """Per rank, the (stage, microbatch) activations that fit in `memory_limit` bytes beside
    the rank's `fixed` bytes (parameters, grads, optimizer state), each counted as the rank's
    largest stage's (any stage's with v > 1); all of them (v x m) without a limit. None if
    a rank cannot hold one microbatch of each of its stages (the least any schedule needs)."""
    v, m = virtual_stages, microbatches
    if memory_limit is None:
        return [v * m] * ranks
    out = []
    for r in range(ranks):
        # With chunks the placement is searched too: count any stage's activations.
        largest = max(costs.activation_bytes[r:r + 1] if v == 1 else costs.activation_bytes)
        room = memory_limit - (fixed[r] if fixed is not None else 0.0)
        count = v * m if largest <= 0 else min(v * m, math.floor(room / largest))
        if count < v:
            return None
        out.append(count)
    return out


def synthesized(
    costs: StageCosts, ranks: int, microbatches: int, limits: Sequence[int], *,
    virtual_stages: int = 1, latency: float = 0.0, overhead: float = 0.0,
) -> Schedule:
    """`scheduler.synthesize` on these stage costs (plus `overhead` per action and `latency`
    per cross-rank transfer, as `pipeline.planning.costs.predict` adds them)."""
    f, b, w = split_costs(costs, overhead)
    return synthesize(ranks, microbatches, f, b, w, latency, memory_limit=list(limits),
                      virtual_stages=virtual_stages)


def running_limits(
    schedule: Schedule, costs: StageCosts, memory_limit: float | None
) -> list[int]:
    """The in-flight limits a re-synthesis of the running `schedule` keeps to: what fits in
    `memory_limit` bytes beside each rank's parameters x `OPTIMIZER_FACTOR` (as the
    auto-planner counts), else (no limit, or not even that fits) what the schedule holds now."""
    now = [round(x) for x in peak_held(schedule, [1.0] * schedule.num_stages)]
    fixed = [0.0] * schedule.num_ranks
    for stage, rank in enumerate(schedule.placement):
        fixed[rank] += costs.param_bytes[stage] * OPTIMIZER_FACTOR
    limits = inflight_limits(costs, schedule.num_ranks, schedule.num_microbatches,
                             schedule.virtual_stages, memory_limit, fixed)
    return now if memory_limit is None or limits is None else limits


@dataclass(frozen=True)
class Resynthesis(ReplanReport):
    """A schedule synthesised from measured costs; `before`: the running schedule's name."""

    before: str

    def __str__(self) -> str:
        verdict = "switched to it" if self.applied else f"kept {self.before} (gain <= " \
            f"{self.threshold:.0%})"
        return (
            f"schedule synthesised from measured costs: predicted step {self.before} "
            f"{1e3 * self.predicted_before:.2f} ms -> synth {1e3 * self.predicted_after:.2f} ms "
            f"({self.gain:+.1%}); {verdict}"
        )


def propose_schedule(
    schedule: Schedule, calibration: Calibration, profiled: StageCosts,
    limits: Sequence[int], threshold: float = 0.05,
) -> tuple[Resynthesis, Schedule]:
    """Synthesise a schedule for the running plan from calibrated costs (measured action
    times, overhead per action, transfer latency) within `limits` in-flight activations per
    rank, and compare both calibrated predictions (mean actions, as a re-balance does)."""
    measured = calibrated_costs(calibration, profiled)
    lat, over = calibration.latency, calibration.overhead
    new = synthesized(measured, schedule.num_ranks, schedule.num_microbatches, limits,
                      virtual_stages=schedule.virtual_stages, latency=lat, overhead=over)
    before = predict(schedule, measured, latency=lat, overhead=over).step_time
    after = predict(new, measured, latency=lat, overhead=over).step_time
    gain = 1.0 - after / before if before > 0 else 0.0
    report = Resynthesis(predicted_before=before, predicted_after=after, threshold=threshold,
                         applied=gain > threshold, before=schedule.name)
    return report, new
