"""The cost model: the profiler's B/W split on composite nodes and the one adapter from a
profiled graph to simulated action costs (Pipeline.simulate and the demo read the same)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from partitioner import UnitCosts, capture, partition, profile
from pipeline import Pipeline
from pipeline.app.demo import compare_schedules
from pipeline.app.models import ResidualMLP, mlp_stack
from pipeline.planning.costs import action_costs, predict, stage_costs
from scheduler import Op, build_schedule


def test_composite_block_input_grad_is_measured_and_weight_grad_is_the_rest() -> None:
    torch.manual_seed(0)
    model = mlp_stack(blocks=2, dim=32)
    x = torch.randn(8, 32)
    graph = capture(model, (x,), leaf_modules=(ResidualMLP,))
    graph = graph.with_costs(profile(graph, model, (x,), repeats=2, warmup=1))
    blocks = [v for v in graph.order if graph.nodes[v].get("param_bytes", 0) > 0]
    assert len(blocks) == 3  # two residual blocks (one node each) and the read-out
    for v in blocks:
        unit = graph.costs[v]
        # W = backward - B: timing the weight grads alone would walk the whole block again.
        assert 0 < unit.input_grad <= unit.backward and unit.weight_grad >= 0
    plan = partition(graph, 2, "profile")
    costs = stage_costs(graph, plan)
    for k, stage in enumerate(plan.stages):
        assert costs.input_grad[k] == pytest.approx(
            sum(graph.costs[v].input_grad for v in stage)
        )
        assert costs.backward[k] == pytest.approx(plan.backward_times[k])


def test_node_with_weights_only_is_all_weight_grad() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4))
    idx = torch.randint(0, 10, (4, 3))
    graph = capture(model, (idx,))
    emb = profile(graph, model, (idx,), repeats=1, warmup=0)[graph.order[0]]
    assert emb.input_grad == 0.0 and emb.weight_grad == emb.backward > 0


def test_adapter_uses_input_grad_for_b_and_empties_stage_zero_b() -> None:
    # The figures for a residual block: backward 13.5, input grad 6.4, so W = 7.1.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    graph = capture(model, (torch.randn(2, 4),))
    graph = graph.with_costs(
        dict.fromkeys(graph.order, UnitCosts(forward=5.0, input_grad=6.4, weight_grad=7.1)))
    plan = partition(graph, 3, "uniform")
    costs = stage_costs(graph, plan)
    assert costs.input_grad == [6.4] * 3 and costs.weight_grad == [7.1] * 3
    split = build_schedule("zb-h1", 3, 3)
    f, b, w = action_costs(costs, split)
    assert b[0] == 0.0 and w[0] == pytest.approx(costs.backward[0])
    assert b[1:] == costs.input_grad[1:] and w[1:] == costs.weight_grad[1:]
    f, b, w = action_costs(costs, build_schedule("1f1b", 3, 3))
    assert b == costs.backward and w == [0.0] * 3
    timeline = predict(split, costs, overhead=1.0)
    durations = {(e.stage, e.op) for e in timeline.events if e.duration == 1.0}
    assert (0, Op.B) in durations  # stage 0's empty B costs just the overhead
    with pytest.raises(ValueError, match="costs cover 3 stages but schedule 'zbv' has 6"):
        action_costs(costs, build_schedule("zbv", 3, 5))


def test_pipeline_simulate_and_demo_comparison_agree() -> None:
    torch.manual_seed(0)
    model = mlp_stack(blocks=4, dim=16)
    pipe = Pipeline(
        model, 2, schedule="zb-h1", microbatches=4, loss_fn=F.mse_loss,
        example_input=torch.randn(8, 16), leaf_modules=(ResidualMLP,),
    )
    by_name = {t.name: t for t in compare_schedules(pipe, 4)}
    assert by_name["zb-h1"].events == pipe.simulate().events
    # A schedule with more stages is predicted on the plan Pipeline would make for it.
    assert by_name["zbv"].events == pipe.simulate("zbv").events
    assert len({e.stage for e in by_name["zbv"].events}) == 4


def test_measured_spread_lengthens_the_predicted_step_and_is_reproducible() -> None:
    """A pipeline waits for its slowest actions: with actions drawn from a spread around their
    mean the median replayed step is longer than the step of mean actions (1F1B, p=2)."""
    from pipeline.planning.costs import StageCosts

    costs = StageCosts(
        forward=[1.0, 1.0], input_grad=[1.0, 1.0], weight_grad=[1.0, 1.0],
        activation_bytes=[0.0, 0.0], param_bytes=[0.0, 0.0],
    )
    schedule = build_schedule("1f1b", 2, 8)
    mean_step = predict(schedule, costs).step_time
    assert predict(schedule, costs, spread=(1.0,)).step_time == pytest.approx(mean_step)
    spread = (0.5, 1.5)  # mean 1: the same total work per rank on average
    wide = predict(schedule, costs, spread=spread).step_time
    assert wide > mean_step * 1.05
    assert predict(schedule, costs, spread=spread).step_time == wide  # seeded
    # Overhead is not scaled: with no compute the spread changes nothing.
    idle = StageCosts(**{**costs.__dict__, "forward": [0.0, 0.0], "input_grad": [0.0, 0.0],
                         "weight_grad": [0.0, 0.0]})
    assert predict(schedule, idle, overhead=0.1, spread=spread).step_time == pytest.approx(
        predict(schedule, idle, overhead=0.1).step_time
    )


def test_unit_costs_round_trip_through_a_checkpoints_plain_data() -> None:
    """What a checkpoint keeps of the unit costs (costs_as_data) loads back with
    weights_only=True, equal, a NumPy scalar and the policy prices included."""
    import io

    import numpy as np

    from partitioner.unit_costs import PolicyCosts, costs_as_data, costs_from_data

    costs = {"a": UnitCosts(forward=1.5, input_grad=2.0, source="estimate",
                            forward_flops=3.0, policies=PolicyCosts(
                                kept={"none": 1.0}, kept_later={"none": 2.0},
                                added={"full": 0.3}, recompute_flops={"full": 5.0},
                                held_to_w={}, offload_time=None)),
             "b": UnitCosts(weight_grad=np.float64(0.25))}  # a float subclass
    buffer = io.BytesIO()
    torch.save(costs_as_data(costs), buffer)
    buffer.seek(0)
    back = costs_from_data(torch.load(buffer, weights_only=True))
    assert back == costs and type(back["b"].weight_grad) is float
