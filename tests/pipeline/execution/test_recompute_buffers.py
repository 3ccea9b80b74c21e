"""Modules that update buffers in train mode (BatchNorm's running statistics, a module keeping
a running average and a call count of its own) under every activation policy (the recomputing
ones on every schedule):
loss, every gradient and every buffer equal the unsplit model run microbatch by microbatch,
over two steps (the second after the recompute learned which buffers each block updates).
"selective" once failed at the first backward: its replay put the running statistics back
inside torch's selective-checkpoint replay, whose cache had never seen those copies. A
torchvision ResNet-18 does the same under every policy."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline import Pipeline
from pipeline.planning import planner
from scheduler import SCHEDULES
from tests.support.capture_memo import memo_capture
from tests.support.models import microbatched_loss

POLICIES = ("none", "full", "selective", "offload")
ATOL = 1e-12


class Average(nn.Module):
    """Keeps a running average of what it sees and counts its calls (buffers updated in
    place in train mode), and subtracts the average: a recomputation that reads the updated
    average, or updates it again, changes the loss, the grads and the buffers."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("average", torch.zeros(width, dtype=torch.float64))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.average.mul_(0.5).add_(x.mean(0), alpha=0.5)
                self.calls += 1
        return torch.tanh(x - self.average) * x


class Updating(nn.Module):
    """Linear -> BatchNorm1d -> Tanh -> Average -> Linear -> BatchNorm1d -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm_a = nn.Linear(4, 8), nn.BatchNorm1d(8)
        self.average = Average(8)
        self.b, self.norm_b, self.out = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.average(torch.tanh(self.norm_a(self.a(x))))
        return self.out(torch.relu(self.norm_b(self.b(h))))


torch.manual_seed(0)
_MODEL = Updating().double()  # one object, so that every case captures it once
_START = copy.deepcopy(_MODEL.state_dict())
_CAPTURE = memo_capture()


@pytest.fixture
def capture_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planner, "capture", _CAPTURE)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,),
                                                                              generator=g)


def _assert_same(model: nn.Module, ref: nn.Module) -> None:
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, ref_params[name].grad, atol=ATOL, rtol=0, msg=name)
    ref_buffers = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, ref_buffers[name], atol=ATOL, rtol=0, msg=name)


# Every policy under 1F1B and "selective" under ZB-H1 (a split backward) stay in the quick
# suite; the recomputing policies on every other schedule are marked slow ("none" and
# "offload", which on CPU runs as "none", replay nothing a schedule could change).
_QUICK = {("1f1b", p) for p in POLICIES} | {("zb-h1", "selective")}
CASES = [pytest.param(s, p, marks=() if (s, p) in _QUICK else pytest.mark.slow)
         for s in sorted(SCHEDULES) for p in POLICIES
         if (s, p) in _QUICK or p in ("full", "selective")]


@pytest.mark.usefixtures("capture_once")
@pytest.mark.parametrize(("schedule", "policy"), CASES)
def test_buffers_updated_in_train_mode_equal_the_unsplit_run(schedule: str, policy: str
                                                             ) -> None:
    model = _MODEL
    model.load_state_dict(_START)
    model.zero_grad(set_to_none=True)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, 2, schedule=schedule, microbatches=4, loss_fn=F.cross_entropy,
                    balance="uniform", checkpoint_activations=policy)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        x, y = _batch(step)
        loss = pipe.step(x, y)
        expected = microbatched_loss(ref, x, y, 4, backward=True)
        torch.testing.assert_close(loss, expected, atol=ATOL, rtol=0)
        _assert_same(model, ref)
    assert int(model.average.calls) == 8 and int(model.norm_b.num_batches_tracked) == 8


_RESNET: dict[str, Any] = {}  # one model object and its first state, for every policy


@pytest.mark.slow
@pytest.mark.usefixtures("capture_once")
@pytest.mark.parametrize("policy", POLICIES)
def test_torchvision_resnet18_under_every_policy(policy: str) -> None:
    """torchvision's resnet18 (BatchNorm after every convolution), 16x16 inputs, float64."""
    from torchvision.models import resnet18

    if not _RESNET:
        torch.manual_seed(0)
        _RESNET["model"] = resnet18(num_classes=3).double()
        _RESNET["start"] = copy.deepcopy(_RESNET["model"].state_dict())
    model = _RESNET["model"]
    model.load_state_dict(_RESNET["start"])
    model.zero_grad(set_to_none=True)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 16, 16, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=g)
    pipe = Pipeline(model, 2, schedule="1f1b", microbatches=2, loss_fn=F.cross_entropy,
                    balance="parameters", checkpoint_activations=policy)
    loss = pipe.step(x, y)
    torch.testing.assert_close(loss, microbatched_loss(ref, x, y, 2, backward=True),
                               atol=1e-9, rtol=0)
    _assert_same(model, ref)


@pytest.mark.slow
def test_compiled_stages_checkpoint_blocks_that_update_buffers() -> None:
    """compile=True: a compiled stage's blocks recompute under torch.utils.checkpoint, which
    puts the updated buffers back the same way."""
    torch.manual_seed(0)
    model = Updating().double()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, 2, microbatches=4, loss_fn=F.cross_entropy, balance="uniform",
                    checkpoint_activations="selective", compile=True)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        x, y = _batch(step)
        torch.testing.assert_close(pipe.step(x, y), microbatched_loss(ref, x, y, 4, True),
                                   atol=ATOL, rtol=0)
        _assert_same(model, ref)
