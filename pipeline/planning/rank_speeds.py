"""The speeds of a distributed job's ranks, from what they measured: each pipeline rank's
speed is the profile's time for its stages over the measured time of them (a slower or busier
device, contention the profile did not see); the units keep the profile's relative costs
(scaled to the fastest rank's measured time), and the re-plan's proposer
(pipeline.planning.replan.propose_rebalance with by_rank) gives each stage the work its
rank's speed can carry (`partitioner.partition(device_speeds=...)`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from partitioner import Captured, UnitCosts
from pipeline.planning.costs import StageCosts


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
    return captured.with_costs({v: captured.costs.get(v, UnitCosts()).scaled(factor, factor)
                                for v in captured.order})
