"""Calibration from measured traces and re-balancing from measured costs: exact on
constructed traces, and end to end on a Pipeline whose stages are far out of balance."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from partitioner import UnitCosts, capture, partition
from pipeline import Pipeline
from pipeline.app.models import ResidualMLP, mlp_stack
from pipeline.planning.calibration import (
    calibrate,
    calibrated_costs,
    held_out_check,
    predict_calibrated,
)
from pipeline.planning.costs import predict, stage_costs
from pipeline.planning.replan import propose_rebalance
from scheduler import Op, Timeline, build_schedule, simulate


def measured_like(schedule_name: str, compute: list[float], o: float, latency: float) -> Timeline:
    """A trace as the runtime records it: each action computes `compute[stage]` (B and W of a
    split backward: half each), then the rank spends `o` before its next action, and a tensor
    reaches another rank `latency` after that."""
    s = build_schedule(schedule_name, 2, 4)
    f = [c + o for c in compute]
    b = [c / (2 if s.splits_backward else 1) + o for c in compute]
    w = [c / 2 + o for c in compute] if s.splits_backward else 0.0
    t = simulate(s, f, b, w, latency)
    events = tuple(dataclasses.replace(e, end=e.end - o) for e in t.events)
    return Timeline(events, t.num_ranks, t.splits_backward, t.name)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_calibration_recovers_compute_overhead_and_latency(name: str) -> None:
    trace = measured_like(name, [3.0, 5.0], o=0.25, latency=1.5)
    schedule = build_schedule(name, 2, 4)
    cal = calibrate(schedule, [trace, trace])
    assert cal.forward == pytest.approx([3.0, 5.0])
    half = 2 if schedule.splits_backward else 1
    assert cal.backward == pytest.approx([3.0 / half, 5.0 / half])
    assert cal.overhead == pytest.approx(0.25) and cal.latency == pytest.approx(1.5)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    graph = capture(model, (torch.randn(1, 2),))
    graph = graph.with_costs(
        dict.fromkeys(graph.order, UnitCosts(forward=1.0, input_grad=1.0, weight_grad=1.0)))
    profiled = stage_costs(graph, partition(graph, 2, "uniform"))
    costs = calibrated_costs(cal, profiled)
    predicted = predict(schedule, costs, latency=cal.latency, overhead=cal.overhead)
    # The prediction ends with the last action's overhead, which the trace does not show.
    assert predicted.step_time == pytest.approx(trace.step_time + 0.25)
    if not schedule.splits_backward:  # an unsplit backward is divided as the profile says
        assert costs.input_grad == pytest.approx([1.5, 2.5])


def test_prediction_is_the_median_step_not_the_step_of_median_figures() -> None:
    """Three measured steps: a fast one, one with 2x the compute, one with 20x the latency.
    Each figure's median is the fast step's, so a prediction from the medians is that step;
    the median of the per-step predictions is the median measured step."""
    schedule = build_schedule("1f1b", 2, 4)
    traces = [
        measured_like("1f1b", [3.0, 5.0], o=0.0, latency=0.1),
        measured_like("1f1b", [6.0, 10.0], o=0.0, latency=0.1),
        measured_like("1f1b", [3.0, 5.0], o=0.0, latency=2.0),
    ]
    cal = calibrate(schedule, traces)
    assert len(cal.step_calibrations) == 3 and cal.latency == pytest.approx(0.1)
    graph = capture(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), (torch.randn(1, 2),))
    # Profiled without the B/W split: the whole backward counts as B.
    graph = graph.with_costs(dict.fromkeys(graph.order, UnitCosts(forward=1.0, input_grad=2.0)))
    profiled = stage_costs(graph, partition(graph, 2, "uniform"))
    predicted = predict_calibrated(schedule, cal, lambda c: calibrated_costs(c, profiled))
    steps = sorted(t.step_time for t in traces)
    assert predicted.step_time == pytest.approx(steps[1])
    of_medians = predict(schedule, calibrated_costs(cal, profiled), latency=cal.latency)
    assert of_medians.step_time == pytest.approx(steps[0]) and steps[0] < steps[1]
    # One step is its own calibration; a given latency replaces the measured one.
    single = calibrate(schedule, traces[2:])
    assert single.step_calibrations == (single,)
    forced = predict_calibrated(schedule, single, lambda c: calibrated_costs(c, profiled), 0.1)
    assert forced.step_time == pytest.approx(steps[0])


def test_calibration_scales_the_simulated_step_to_the_measured_one() -> None:
    """Ranks that share cores run one after the other: the measured step is longer than its
    own figures simulate (each rank a core of its own). The calibration measures that factor
    and every prediction from it carries it, of the schedule it ran and of another."""
    schedule = build_schedule("1f1b", 2, 4)
    trace = measured_like("1f1b", [3.0, 5.0], o=0.0, latency=0.1)
    late = tuple(dataclasses.replace(e, start=e.start + 40.0, end=e.end + 40.0)
                 if e.rank == 1 else e for e in trace.events)  # rank 1 waited for a core
    shared = Timeline(late, trace.num_ranks, trace.splits_backward, trace.name)
    cal = calibrate(schedule, [shared])
    graph = capture(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), (torch.randn(1, 2),))
    # Profiled without the B/W split: the whole backward counts as B.
    graph = graph.with_costs(dict.fromkeys(graph.order, UnitCosts(forward=1.0, input_grad=2.0)))
    profiled = stage_costs(graph, partition(graph, 2, "uniform"))
    costs = calibrated_costs(cal, profiled)
    simulated = predict(schedule, costs, latency=cal.latency, overhead=cal.overhead)
    assert cal.scale > 1.05 and simulated.step_time < shared.step_time / 1.05
    predicted = predict_calibrated(schedule, cal, lambda c: calibrated_costs(c, profiled))
    assert predicted.step_time == pytest.approx(shared.step_time)
    other = build_schedule("gpipe", 2, 4)
    unscaled = predict(other, costs, latency=cal.latency, overhead=cal.overhead)
    scaled = predict_calibrated(other, cal, lambda c: calibrated_costs(c, profiled))
    assert scaled.step_time == pytest.approx(unscaled.step_time * cal.scale)


def test_rebalance_proposal_follows_the_measured_costs() -> None:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(6)))
    graph = capture(model, (torch.randn(1, 2),))
    graph = graph.with_costs(
        dict.fromkeys(graph.order, UnitCosts(forward=1.0, input_grad=1.0, weight_grad=1.0)))
    plan = partition(graph, 2, "uniform")
    schedule = build_schedule("1f1b", 2, 4)
    trace = measured_like("1f1b", [9.0, 3.0], o=0.0, latency=0.0)  # stage 0 is 3x slower
    cal = calibrate(schedule, [trace])
    report, new = propose_rebalance(graph, plan, schedule, cal, stage_costs(graph, plan))
    # Per node F+B measured: 6 on stage 0, 2 on stage 1, so [2, 4] is 12 | 6 + 6 = 12.
    assert report.applied and report.before == [3, 3] and new.sizes == [2, 4]
    assert report.gain > 0.05 and "applied" in str(report)
    kept, _ = propose_rebalance(graph, plan, schedule, cal, stage_costs(graph, plan), 0.99)
    assert not kept.applied and "kept the plan" in str(kept)


def test_pipeline_calibrates_and_rebalances_a_lopsided_plan() -> None:
    torch.manual_seed(0)
    # Enough compute per block (milliseconds) that the measured imbalance, not the runtime's
    # per-action overhead, sets the step.
    model = mlp_stack(blocks=16, dim=128).double()
    x, y = torch.randn(64, 128, dtype=torch.float64), torch.randn(64, 128, dtype=torch.float64)
    pipe = Pipeline(model, 2, microbatches=4, loss_fn=F.mse_loss, balance=[1, 16],
                    leaf_modules=(ResidualMLP,), rebalance=True, example_input=x)
    profiled = pipe.simulate()
    assert pipe.calibration is None  # nothing measured yet
    for _ in range(3):
        pipe.step(x, y)
    report = pipe.rebalanced
    assert report is not None and report.applied, report
    assert report.before == [1, 16] and pipe.plan.sizes == report.after != [1, 16]
    assert pipe.calibration is None  # the old stages' traces were dropped
    pipe.step(x, y)
    pipe.step(x, y)
    calibrated = pipe.simulate()
    assert pipe.calibration is not None and pipe.calibration.steps == 2
    assert calibrated.events != profiled.events
    assert pipe.simulate(calibrated=False).step_time == pytest.approx(
        predict(pipe.schedule, pipe.profiled_costs()).step_time
    )
    # Still exact after the re-partition: the stages share the model's parameters.
    model.zero_grad()
    loss = pipe.step(x, y)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    expected = F.mse_loss(model(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-10, rtol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-10, rtol=0)
    assert {e.op for e in calibrated.events} == {Op.F, Op.B}


def test_held_out_check_takes_turns_and_reports_the_step_noise() -> None:
    """After one warm-up step, held-out and calibration steps alternate (3 + 3: the 1st, 3rd
    and 5th are held out); "measured" is the held-out steps' median, the step noise half their
    interquartile range over it, and the calibrated prediction comes from the other steps."""
    torch.manual_seed(0)
    model = mlp_stack(blocks=4, dim=32)
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    pipe = Pipeline(model, 2, microbatches=4, loss_fn=F.mse_loss, example_input=x)
    traces: list[Timeline] = []
    step = pipe.step

    def recording_step(*args: object) -> torch.Tensor:
        loss = step(*args)
        assert pipe.trace is not None
        traces.append(pipe.trace)
        return loss

    pipe.step = recording_step  # type: ignore[method-assign]
    check = held_out_check(pipe, x, y, calibration_steps=3, measured_steps=3)
    assert check is not None and len(traces) == 7
    held = sorted(t.step_time for t in (traces[1], traces[3], traces[5]))
    assert check.measured == held[1]
    q1, median, q3 = statistics.quantiles(held, n=4)
    assert check.step_noise == pytest.approx((q3 - q1) / (2 * median))
    calibration_steps = [traces[2], traces[4], traces[6]]
    cal = calibrate(pipe.schedule, calibration_steps)
    profiled = pipe.profiled_costs()
    expected = predict_calibrated(pipe.schedule, cal, lambda c: calibrated_costs(c, profiled))
    assert check.calibrated == pytest.approx(expected.step_time)
    remeasured = statistics.median(t.step_time for t in calibration_steps)
    assert check.remeasured == remeasured
    assert check.remeasured_error == pytest.approx(remeasured / check.measured - 1)
    assert check.fit_error == pytest.approx(expected.step_time / remeasured - 1)


def test_held_out_check_takes_given_profiled_costs() -> None:
    """`profiled=` stands in for pipe.profiled_costs() (a distributed Pipeline not built with
    balance="profile" cannot profile once split): the profiled prediction is made from it."""
    torch.manual_seed(0)
    model = mlp_stack(blocks=4, dim=32)
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    pipe = Pipeline(model, 2, microbatches=4, loss_fn=F.mse_loss, balance="uniform",
                    example_input=x)
    own = pipe.profiled_costs()
    given = dataclasses.replace(own, forward=[10 * f for f in own.forward])
    check = held_out_check(pipe, x, y, calibration_steps=2, measured_steps=2, profiled=given)
    assert check is not None
    assert check.profiled == pytest.approx(predict(pipe.schedule, given).step_time)
    assert check.profiled > 2 * pipe.simulate(calibrated=False).step_time


def test_recompute_prices_run_at_the_measured_speed() -> None:
    """Calibrated costs scale "full" and "selective"'s added time with the stage's measured
    over profiled compute (recomputation is compute); bytes and offload copies stay."""
    from pipeline.planning.activation_plan import PolicyPrices
    from pipeline.planning.costs import StageCosts

    per = {"none": [0.0, 0.0], "full": [1.0, 2.0], "selective": [0.5, 0.5],
           "offload": [3.0, 3.0]}
    prices = PolicyPrices(kept=dict(per), forward=dict(per), backward=dict(per))
    profiled = StageCosts([1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0], prices)
    # F and B 6 s on stage 0, 3 s on stage 1: 4x and 2x the profiled 1 + 1 + 1.
    trace = measured_like("1f1b", [6.0, 3.0], o=0.0, latency=0.0)
    costs = calibrated_costs(calibrate(build_schedule("1f1b", 2, 4), [trace]), profiled)
    assert costs.prices is not None
    assert costs.prices.backward["full"] == pytest.approx([4.0, 4.0])
    assert costs.prices.backward["selective"] == pytest.approx([2.0, 1.0])
    assert costs.prices.backward["offload"] == [3.0, 3.0]
    assert costs.prices.kept == prices.kept
