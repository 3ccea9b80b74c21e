"""checkpoint_activations="auto": the prices of each policy measured per block
(partitioner.activation_cost), the per-rank choice of the cheapest policies that fit a memory
limit (literal prices), and on a model: the choice in pipe.plan, the run exact in float64, and
each rank's predicted peak of held activation bytes within 10% of the bytes the runtime
counts; "auto" also joins the auto-plan search."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from pipeline import Pipeline
from pipeline.planning.activation_plan import PolicyPrices, choose, peaks
from pipeline.planning.costs import stage_costs
from pipeline.planning.decision import with_activations_of
from scheduler import build_schedule
from tests.support.models import lm_loss, make_model, token_batch

ATOL = 1e-10


def _prices() -> PolicyPrices:
    return PolicyPrices(
        kept={"none": [10.0, 10.0], "full": [1.0, 1.0], "selective": [5.0, 5.0],
              "offload": [0.0, 0.0]},
        forward={"none": [0.0, 0.0], "full": [0.0, 0.0], "selective": [0.5, 0.5],
                 "offload": [4.0, 4.0]},
        backward={"none": [0.0, 0.0], "full": [3.0, 3.0], "selective": [1.0, 1.0],
                  "offload": [4.0, 4.0]},
    )


def test_each_rank_gets_the_cheapest_policy_that_fits() -> None:
    """1F1B on 2 ranks, 4 microbatches: rank 0 holds 2 microbatches, rank 1 one. Under 12
    bytes rank 0 cannot keep everything (20) and takes the cheaper of the policies that fit
    (selective: 10 bytes, 1.5 s a microbatch; full 2 bytes but 3 s; offload 8 s); rank 1
    keeps everything (10)."""
    schedule = build_schedule("1f1b", 2, 4)
    choice = choose(schedule, _prices(), [0.0, 0.0], 12.0)
    assert choice is not None
    assert choice.policies == ("selective", "none")
    assert choice.peaks == (10.0, 10.0)
    assert peaks(schedule, _prices(), ["none", "none"]) == [20.0, 10.0]
    # Parameters count against the limit: with 3 bytes of them, rank 0 needs full recompute.
    tight = choose(schedule, _prices(), [3.0, 0.0], 12.0)
    assert tight is not None and tight.policies == ("full", "none")
    # Under 0.5 bytes only offloading fits; parameters over the limit fit under nothing.
    offloaded = choose(schedule, _prices(), [0.0, 0.0], 0.5)
    assert offloaded is not None and offloaded.policies == ("offload", "offload")
    assert choose(schedule, _prices(), [2.0, 0.0], 1.5) is None
    assert choose(schedule, _prices(), [0.0, 0.0], None).policies == ("none", "none")


def test_auto_needs_a_memory_limit() -> None:
    with pytest.raises(ValueError, match="pass memory_limit="):
        Pipeline(nn.Linear(2, 2), 2, checkpoint_activations="auto")


def _fixed(pipe: Pipeline) -> list[float]:
    return [4.0 * b for b in pipe.plan.stage_params]  # weights, grads, Adam's two moments


def test_auto_fits_the_limit_exactly_and_as_predicted() -> None:
    x, y = token_batch(0, rows=8)
    model = make_model()
    loss = lm_loss(model(x), y)
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    roomy = Pipeline(model, 2, microbatches=4, loss_fn=lm_loss, example_input=x,
                     checkpoint_activations="auto", memory_limit=1e12)
    assert roomy.plan.activations == ["none", "none"]  # nothing to save
    held = roomy.plan.activation_peaks
    assert held is not None and held[0] > held[1]  # 1F1B: rank 0 holds 2 microbatches
    # A limit rank 0 cannot meet keeping everything.
    limit = _fixed(roomy)[0] + 0.6 * held[0]
    pipe = Pipeline(model, 2, microbatches=4, loss_fn=lm_loss, example_input=x,
                    checkpoint_activations="auto", memory_limit=limit)
    assert pipe.plan.activations is not None and pipe.plan.activation_peaks is not None
    assert pipe.plan.activations[0] != "none"
    assert "activations (auto): stage 0" in str(pipe.plan)
    predicted = pipe.plan.activation_peaks
    assert all(f + p <= limit for f, p in zip(_fixed(pipe), predicted, strict=True))
    meters = pipe.count_saved_activations()
    torch.testing.assert_close(pipe.step(x, y), loss.detach(), atol=ATOL, rtol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], atol=ATOL, rtol=0, msg=name)
    measured = [meters[r].peak for r in range(2)]
    for rank, (m, p) in enumerate(zip(measured, predicted, strict=True)):
        assert abs(m - p) <= 0.1 * m, f"rank {rank}: measured {m}, predicted {p}"
    # A later partition (rebalance, re-capture) keeps the choice.
    bare = dataclasses.replace(pipe.plan, activations=None, activation_peaks=None)
    assert with_activations_of(bare, pipe.plan).activations == pipe.plan.activations


def test_prices_of_a_transformer_block() -> None:
    """"full" keeps a block's input only (rows x seq x dim float64 values); "selective" keeps
    more (some matmul outputs), at most half of what "none" keeps."""
    x, _ = token_batch(0, rows=4)
    model = make_model()
    pipe = Pipeline(model, 2, microbatches=2, loss_fn=lm_loss, example_input=x,
                    checkpoint_activations="auto", memory_limit=1e12)
    block = pipe.captured.costs["blocks_1"].policies
    assert block is not None
    rows, seq, dim = 2, x.shape[1], 16
    assert block.kept["full"] == rows * seq * dim * 8
    assert block.kept["full"] < block.kept["selective"] <= 0.5 * block.kept["none"]
    prices = stage_costs(pipe.captured, pipe.plan).prices
    assert prices is not None and prices.kept["offload"] == prices.kept["none"]  # on CPU


@pytest.mark.slow
def test_auto_joins_the_auto_plan_search() -> None:
    x, y = token_batch(0, rows=8)
    model = make_model()
    roomy = Pipeline(model, 2, microbatches=4, loss_fn=lm_loss, example_input=x,
                     checkpoint_activations="auto", memory_limit=1e12)
    assert roomy.plan.activation_peaks is not None
    limit = _fixed(roomy)[0] + 0.6 * roomy.plan.activation_peaks[0]
    pipe = Pipeline(model, 2, schedule="auto", microbatches="auto", loss_fn=lm_loss,
                    example_input=x, checkpoint_activations="auto", memory_limit=limit)
    assert pipe.autoplan is not None
    best = pipe.autoplan.best
    assert len(best.activations) == pipe.schedule.num_stages
    assert best.max_memory <= limit
    assert pipe.plan.activations is not None
    pipe.step(x, y)


def test_selective_keeps_what_the_planner_predicts() -> None:
    """The runtime decides what "selective" keeps per block by the rule the prices measured:
    each rank's counted peak within 10% of the prediction."""
    x, y = token_batch(0, rows=8)
    model = make_model()
    roomy = Pipeline(model, 2, microbatches=4, loss_fn=lm_loss, example_input=x,
                     checkpoint_activations="auto", memory_limit=1e12)
    prices = stage_costs(roomy.captured, roomy.plan).prices
    assert prices is not None
    predicted = peaks(roomy.schedule, prices, ["selective", "selective"])
    pipe = Pipeline(model, 2, microbatches=4, loss_fn=lm_loss, example_input=x,
                    checkpoint_activations="selective")
    meters = pipe.count_saved_activations()
    pipe.step(x, y)
    for rank in range(2):
        assert abs(meters[rank].peak - predicted[rank]) <= 0.1 * meters[rank].peak


def test_a_split_backward_holds_what_b_keeps_for_w() -> None:
    """Under ZB-H1 a recomputing stage's B keeps what its W reads (priced per block from the
    traced split: about a block's "none" bytes), held with its kept bytes until W; under
    1F1B both go at B."""
    x, _ = token_batch(0, rows=4)
    pipe = Pipeline(make_model(), 2, microbatches=2, loss_fn=lm_loss, example_input=x,
                    checkpoint_activations="auto", memory_limit=1e12)
    block = pipe.captured.costs["blocks_1"].policies
    assert block is not None
    assert block.kept["full"] < block.held_to_w["full"] <= 2 * block.kept["none"]
    assert block.held_to_w["selective"] > 0
    prices = PolicyPrices(kept={"full": [1.0, 1.0]}, forward={}, backward={},
                          held_to_w={"full": [10.0, 10.0]})
    # ZB-H1, rank 1: F0 B0 F1 B1 W0 ...: two microbatches' kept bytes and their B's; rank 0:
    # F0 F1 B0 W0 ...: two kept, one B's. 1F1B frees both at B.
    assert peaks(build_schedule("zb-h1", 2, 4), prices, ["full", "full"]) == [12.0, 22.0]
    assert peaks(build_schedule("1f1b", 2, 4), prices, ["full", "full"]) == [2.0, 1.0]
