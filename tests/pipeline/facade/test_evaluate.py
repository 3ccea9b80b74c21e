"""Train and evaluate in one Pipeline: pipe.train()/pipe.eval() switch, pipe.evaluate(x, y) runs a
forward-only pass with the step's loss. Train steps interleaved with evaluations give exactly the
losses and weights of the unsplit model doing the same (float64, BatchNorm, every schedule);
with dropout, an evaluation after training equals the unsplit model's eval() loss on the same
weights; an evaluation leaves .grad, the RNG and BatchNorm statistics (eval mode) untouched."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline.api import Pipeline
from scheduler import SCHEDULES


def bn_model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(),
        nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3),
    ).double()


def batch(seed: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (rows,), generator=g))


def reference_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int,
                   backward: bool) -> torch.Tensor:
    """The unsplit model on the pipeline's microbatches: sum of loss_m * n_m / n."""
    total = torch.zeros((), dtype=torch.float64)
    for xm, ym in zip(x.tensor_split(m), y.tensor_split(m), strict=True):
        loss = F.cross_entropy(model(xm), ym) * len(xm) / len(x)
        if backward:
            loss.backward()
        total += loss.detach()
    return total


def assert_same_state(model: nn.Module, ref: nn.Module) -> None:
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=name)


def train_and_evaluate(pipe: Pipeline, model: nn.Module, ref: nn.Module, m: int,
                       steps: int = 4) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k in range(steps):
        x, y = batch(k)
        loss = pipe.step(x, y)
        expected = reference_loss(ref, x, y, m, backward=True)
        torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if k % 2 == 1:
            pipe.eval()
            ref.eval()
            vx, vy = batch(100 + k, rows=6)
            got = pipe.evaluate(vx, vy)
            torch.testing.assert_close(got, F.cross_entropy(ref(vx), vy).detach(),
                                       atol=1e-12, rtol=0)
            pipe.train()
            ref.train()
        assert_same_state(model, ref)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_interleaved_training_and_evaluation_equal_the_unsplit_model(schedule: str) -> None:
    model = bn_model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, stages=2, schedule=schedule, microbatches=4, loss_fn=F.cross_entropy,
                    capture_method="fx")
    train_and_evaluate(pipe, model, ref, m=4)


def test_evaluate_after_training_with_dropout_equals_unsplit_eval() -> None:
    model = bn_model(dropout=0.3)
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=F.cross_entropy,
                    capture_method="fx")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for k in range(3):
        pipe.step(*batch(k))
        opt.step()
        opt.zero_grad()
    x, y = batch(50)
    pipe.eval()
    ref = copy.deepcopy(model).eval()
    loss, out = pipe.evaluate(x, y, return_outputs=True)
    torch.testing.assert_close(loss, F.cross_entropy(ref(x), y).detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(out, ref(x).detach(), atol=1e-12, rtol=0)


def test_evaluate_leaves_grads_rng_and_statistics_alone() -> None:
    model = bn_model(dropout=0.3)
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=F.cross_entropy,
                    capture_method="fx")
    pipe.step(*batch(0))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    pipe.eval()
    stats = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    loss, out = pipe.evaluate(*batch(1), return_outputs=True)
    assert not loss.requires_grad and not out.requires_grad and out.grad_fn is None
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in model.state_dict().items():
        assert torch.equal(value, stats[name]), name
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    pipe.train()  # in train mode dropout draws, from a forked RNG: the training stream is kept
    pipe.evaluate(*batch(1))
    assert torch.equal(torch.get_rng_state(), rng)


def test_evaluate_needs_a_loss() -> None:
    pipe = Pipeline(bn_model(), stages=2, capture_method="fx")
    with pytest.raises(ValueError, match="evaluate needs a loss"):
        pipe.evaluate(*batch(0))
