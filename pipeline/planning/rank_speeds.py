"""Re-partitioning a distributed job from what its ranks measured: each pipeline rank's
speed is the profile's time for its stages over the measured time of them (a slower or busier
device, contention the profile did not see), the units keep the profile's relative costs
(scaled to the fastest rank's measured time), and the partition gives each stage the work
its rank's speed can carry (`partitioner.partition(device_speeds=...)`).

In one process `calibration.propose_rebalance` attributes a stage's whole measured deviation
to its units, because every stage runs on the same kind of device there; across processes the
deviation is mostly the device's, and a unit moved to a faster rank gets faster."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from partitioner import Captured, Plan, partition
from pipeline.planning.calibration import Calibration, Rebalance, calibrated_costs, gain
from pipeline.planning.costs import StageCosts, predict, stage_costs
from scheduler import Schedule


def rank_speeds(
    measured: StageCosts, profiled: StageCosts, placement: Sequence[int]
) -> tuple[list[float], float]:
    """(speed of each pipeline rank relative to the fastest, the fastest rank's measured over
    profiled time). A rank whose profile is empty counts as fastest."""
    ranks = max(placement) + 1
    spent, expected = [0.0] * ranks, [0.0] * ranks
    for s, r in enumerate(placement):
        spent[r] += measured.forward[s] + measured.backward[s]
        expected[r] += profiled.forward[s] + profiled.backward[s]
    ratios = [m / p if p > 0 and m > 0 else 0.0 for m, p in zip(spent, expected, strict=True)]
    known = [x for x in ratios if x > 0]
    base = min(known) if known else 1.0
    return [base / x if x > 0 else 1.0 for x in ratios], base


def at_speeds(costs: StageCosts, speeds: Sequence[float]) -> StageCosts:
    """`costs` with stage s's times divided by `speeds[s]`."""

    def scale(values: list[float]) -> list[float]:
        return [v / sp for v, sp in zip(values, speeds, strict=True)]

    return replace(costs, forward=scale(costs.forward), input_grad=scale(costs.input_grad),
                   weight_grad=scale(costs.weight_grad))


def scaled_units(captured: Captured, factor: float) -> Captured:
    """A copy of `captured` whose unit times are multiplied by `factor` (marked measured)."""
    scaled = captured.copy()
    for v in scaled.order:
        node = scaled.nodes[v]
        node["cost_source"] = "measured"
        for key in ("forward_time", "backward_time", "input_grad_time", "weight_grad_time"):
            if key in node:
                node[key] = node[key] * factor
    return scaled


def propose_for_ranks(
    captured: Captured,
    plan: Plan,
    schedule: Schedule,
    calibration: Calibration,
    profiled: StageCosts,
    threshold: float = 0.05,
) -> tuple[Rebalance, Plan]:
    """Re-partition `captured` (profiled) for ranks of the measured speeds and compare both
    plans' predictions for `schedule` (means, no spread); applied when the predicted step
    shrinks by more than `threshold` and the stage sizes change."""
    if not captured.profiled:
        raise ValueError(
            "re-balancing a distributed job needs the units' profiled costs; build the Pipeline "
            "with balance='profile' or rebalance=True (global rank 0 profiles the units before "
            "the model is split)"
        )
    measured = calibrated_costs(calibration, profiled)
    speeds, base = rank_speeds(measured, profiled, schedule.placement)
    stage_speeds = [speeds[r] for r in schedule.placement]
    scaled = scaled_units(captured, base)
    new_plan = partition(scaled, schedule.num_stages, "profile", device_speeds=stage_speeds)
    lat, over = calibration.latency, calibration.overhead
    before = predict(schedule, measured, latency=lat, overhead=over).step_time
    after_costs = at_speeds(stage_costs(scaled, new_plan), stage_speeds)
    after = predict(schedule, after_costs, latency=lat, overhead=over).step_time
    report = Rebalance(
        before=plan.sizes, after=new_plan.sizes, predicted_before=before,
        predicted_after=after, threshold=threshold,
        applied=gain(before, after) > threshold and new_plan.sizes != plan.sizes,
    )
    return report, new_plan
