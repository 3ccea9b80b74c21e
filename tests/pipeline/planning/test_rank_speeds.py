"""Re-partitioning for measured rank speeds (pipeline.planning.rank_speeds, through the re-plan's
proposer with by_rank) on a graph of fixed costs: a rank measured slower than its profile gets
less work; equal speeds keep the plan."""

from __future__ import annotations

import pytest
import torch

from partitioner import capture, partition
from pipeline.app.models import mlp_stack
from pipeline.planning.calibration import Calibration, calibrated_costs
from pipeline.planning.costs import stage_costs
from pipeline.planning.rank_speeds import rank_speeds
from pipeline.planning.replan import propose_rebalance
from scheduler import build_schedule
from tests.support.graphs import synthetic_graph


def _measured(profiled_f: list[float], profiled_b: list[float], slow: list[float]) -> Calibration:
    """Stage times as the profile says, times each stage's slowness."""
    return Calibration(
        forward=[f * s for f, s in zip(profiled_f, slow, strict=True)],
        backward=[b * s for b, s in zip(profiled_b, slow, strict=True)],
        weight=[0.0] * len(slow), overhead=0.0, latency=0.0, steps=1, splits_backward=False,
    )


def test_a_slower_rank_gets_less_work() -> None:
    graph = synthetic_graph()
    schedule = build_schedule("1f1b", 2, 4)
    plan = partition(graph, 2, "profile")
    costs = stage_costs(graph, plan)
    measured = calibrated_costs(_measured(costs.forward, costs.backward, [2.0, 6.0]), costs)
    speeds, base = rank_speeds(measured, costs, schedule.placement)
    assert speeds == pytest.approx([1.0, 1 / 3]) and base == pytest.approx(2.0)
    report, new = propose_rebalance(graph, plan, schedule,
                                    _measured(costs.forward, costs.backward, [1.0, 3.0]), costs,
                                    by_rank=True)
    assert report.applied and report.before == plan.sizes and report.after == new.sizes
    assert new.sizes[1] < plan.sizes[1], (plan.sizes, new.sizes)
    assert report.predicted_after < report.predicted_before


def test_equal_speeds_keep_the_plan() -> None:
    graph = synthetic_graph()
    schedule = build_schedule("1f1b", 2, 4)
    plan = partition(graph, 2, "profile")
    costs = stage_costs(graph, plan)
    report, new = propose_rebalance(graph, plan, schedule,
                                    _measured(costs.forward, costs.backward, [1.5, 1.5]), costs,
                                    by_rank=True)
    assert not report.applied and new.sizes == plan.sizes


def test_unprofiled_units_are_a_value_error() -> None:
    graph = capture(mlp_stack(blocks=4, dim=4, hidden=4), (torch.randn(4, 4),))
    plan = partition(graph, 2, "parameters")
    costs = stage_costs(graph, plan)
    with pytest.raises(ValueError, match="needs every unit's profiled costs"):
        propose_rebalance(graph, plan, build_schedule("1f1b", 2, 4),
                          _measured(costs.forward, costs.backward, [1.0, 1.0]), costs,
                          by_rank=True)
