"""An optimizer built from ``pipe.parameters()`` at any point after the Pipeline is built trains
the weights that run: on a model built on meta before its first step materialises it (once the
optimizer held the meta parameters and the loss never moved), before ``load_state_dict``
gives it its weights, and across a rebalance. The parameter objects are kept (their contents
swapped in place); where torch refuses that swap, the optimizer's step is an error naming it
and the fix. Each run equals the unsplit model trained with the same optimizer (float64)."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline import Pipeline

ATOL = 1e-10


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(8, 4, generator=g, dtype=torch.float64),
            torch.randn(8, 2, generator=g, dtype=torch.float64))


Reference = tuple[nn.Module, torch.optim.Optimizer]


def _train_alongside(pipe: Pipeline, opt: torch.optim.Optimizer, steps: range,
                     ref: nn.Module | None = None, ref_opt: torch.optim.Optimizer | None = None
                     ) -> Reference:
    """`steps` of pipe + opt, and of the unsplit `ref` (a copy of the pipeline's weights
    before the first of them, when not given) with its own SGD: same losses, same weights."""
    for step in steps:
        x, y = _batch(step)
        loss = pipe.step(x, y)
        if ref is None:  # the weights the pipeline materialised, not yet updated
            ref = _model()
            ref.load_state_dict(pipe.state_dict() or {})
        if ref_opt is None:
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        want = F.mse_loss(ref(x), y)
        want.backward()
        torch.testing.assert_close(loss, want.detach(), atol=ATOL, rtol=0)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert ref is not None and ref_opt is not None
    trained = dict(pipe.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trained[name], p, atol=ATOL, rtol=0, msg=name)
    return ref, ref_opt


def _meta_pipe(**kw: object) -> tuple[nn.Module, Pipeline]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _model()
    return model, Pipeline(model, stages=2, microbatches=2, loss_fn=F.mse_loss, **kw)


def test_optimizer_built_before_a_meta_model_is_materialised_trains_it() -> None:
    model, pipe = _meta_pipe(init_fn="reset_parameters")
    params = list(pipe.parameters())
    assert all(p.is_meta for p in params)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    _train_alongside(pipe, opt, range(3))
    # The very objects the optimizer holds now hold the trained values.
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert not any(p.is_meta for p in params)


def test_optimizer_built_before_load_state_dict_trains_the_loaded_weights() -> None:
    torch.manual_seed(1)
    source = _model()
    _, pipe = _meta_pipe()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    pipe.load_state_dict(source.state_dict())
    assert all(not p.is_meta for g in opt.param_groups for p in g["params"])
    _train_alongside(pipe, opt, range(3), ref=copy.deepcopy(source))


def test_optimizer_keeps_training_across_a_rebalance() -> None:
    model, pipe = _meta_pipe(init_fn="reset_parameters", balance=[1, 6])
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref, ref_opt = _train_alongside(pipe, opt, range(3))
    report = pipe.rebalance(threshold=-1.0)  # applied whatever the measured gain
    assert report.applied and pipe.plan.sizes != [1, 6]
    _train_alongside(pipe, opt, range(3, 6), ref, ref_opt)


def test_an_optimizer_over_replaced_parameters_is_an_error_at_its_step() -> None:
    """A weak reference of the caller's to a meta parameter: torch will not swap it in
    place, so it is replaced by a new object; the optimizer built over the old one fails at
    its first step instead of silently training nothing."""
    model, pipe = _meta_pipe(init_fn="reset_parameters")
    held = weakref.ref(next(model.parameters()))
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.1)
    pipe.step(*_batch(0))
    assert held() is not next(model.parameters())
    with pytest.raises(RuntimeError, match=r"AdamW holds 1 parameter\(s\) the Pipeline "
                                           r"replaced.*pipe\.parameters\(\)"):
        opt.step()
    fresh = torch.optim.AdamW(pipe.parameters(), lr=0.1)  # built after: trains
    fresh.step()
