"""Activation policies per stage (pipeline.execution.activations): the accepted values and the
errors for the others; every policy ("none", "full", "selective", "offload", a list mixing
them, a Selective with its own op list) trains exactly as the unsplit model in float64 under
a plain, a split-backward and an interleaved schedule; dropout draws the same numbers when
recomputed; and a stage's forward is recomputed block by block."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from partitioner.blocks import BlockChain, block_key
from pipeline import Pipeline, Selective
from pipeline.planning import planner
from tests.support import real_models
from tests.support.capture_memo import memo_capture
from tests.support.models import lm_loss, make_model

ATOL = 1e-10
_CAPTURE = memo_capture()


@pytest.fixture(autouse=True)
def _capture_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planner, "capture", _CAPTURE)


@pytest.fixture(scope="module")
def gpt() -> tuple[nn.Module, torch.Tensor, torch.Tensor, dict[str, Any]]:
    model = make_model()
    x, y = torch.randint(0, 32, (8, 6)), torch.randint(0, 32, (8, 6))
    loss = lm_loss(model(x), y)
    loss.backward()
    want = {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()
                                      if p.grad is not None}}
    model.zero_grad(set_to_none=True)
    return model, x, y, want


def _check(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor, want: dict[str, Any]) -> None:
    pipe.module.zero_grad(set_to_none=True)
    torch.testing.assert_close(pipe.step(x, y), want["loss"], atol=ATOL, rtol=0)
    for name, p in pipe.module.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, want[name], atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("bad", ["sometimes", "Full", 2, None, [], ["full", "always"]])
def test_other_values_are_refused_naming_the_accepted_ones(bad: object) -> None:
    with pytest.raises(ValueError, match=r"checkpoint_activations=.*'none', 'full', "
                       r"'selective', 'offload'.*True.*False.*one of those per stage"):
        Pipeline(nn.Linear(2, 2), 2, checkpoint_activations=bad)


def test_a_list_needs_one_policy_per_stage(gpt: Any) -> None:
    model, x, y, _ = gpt
    pipe = Pipeline(model, 2, microbatches=2, loss_fn=lm_loss, balance="uniform",
                    checkpoint_activations=["full", "none", "selective"])
    with pytest.raises(ValueError, match=r"3 policies for 2 stages; give one per stage"):
        pipe.step(x, y)


def test_selective_takes_op_overloads() -> None:
    with pytest.raises(TypeError, match="torch.ops.aten.mm.default"):
        Selective(save=("mm",))  # type: ignore[arg-type]


@pytest.mark.parametrize("budget", [1.5, -0.1, "half", True])
def test_selective_budget_is_a_fraction(budget: object) -> None:
    with pytest.raises(ValueError, match=r"Selective\(budget=.*from 0 to 1, or None"):
        Selective(budget=budget)  # type: ignore[arg-type]


POLICIES: list[object] = [False, True, "none", "full", "selective", "offload",
                          Selective(save=(torch.ops.aten.mm.default,)),
                          Selective(budget=None), Selective(budget=0.2)]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_every_policy_is_exact(gpt: Any, schedule: str, policy: object) -> None:
    model, x, y, want = gpt
    pipe = Pipeline(model, 2, schedule=schedule, microbatches=4, loss_fn=lm_loss,
                    balance="uniform", checkpoint_activations=policy)
    _check(pipe, x, y, want)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_one_policy_per_stage_is_exact(gpt: Any, schedule: str) -> None:
    model, x, y, want = gpt
    pipe = Pipeline(model, 2, schedule=schedule, microbatches=4, loss_fn=lm_loss,
                    balance="uniform",
                    checkpoint_activations=["selective", "offload", "full", "none"])
    _check(pipe, x, y, want)
    assert [str(p) for p in pipe._executor.activations] == [
        "selective", "offload", "full", "none"]


class _Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.gelu(self.fc(x)))


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_dropout_draws_the_same_numbers_when_recomputed(policy: str) -> None:
    """One rank (one thread, so the RNG is drawn in a fixed order): the recomputing run equals
    the run keeping its activations, dropout masks included."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Noisy() for _ in range(3)]).double()
    x, y = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    runs = []
    for p in ("none", policy):
        copy_ = copy.deepcopy(model)
        pipe = Pipeline(copy_, 1, microbatches=3, loss_fn=F.mse_loss, balance="uniform",
                        checkpoint_activations=p, example_input=x)
        torch.manual_seed(1)
        loss = pipe.step(x, y)
        runs.append((loss, [q.grad for q in copy_.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    torch.testing.assert_close(loss_b, loss_a, atol=ATOL, rtol=0)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
    torch.manual_seed(1)
    assert not torch.equal(torch.nn.functional.dropout(torch.ones(64), 0.5),
                           torch.nn.functional.dropout(torch.ones(64), 0.5))  # it is random


def test_a_stage_runs_as_one_block_per_transformer_layer(gpt: Any) -> None:
    model, x, _, _ = gpt
    pipe = Pipeline(model, 2, microbatches=2, loss_fn=lm_loss, balance="uniform",
                    example_input=x)
    keys = []
    values: tuple[Any, ...] = (x[:4],)
    for stage in pipe.stage_modules:
        chain = BlockChain(stage)
        keys.append([block_key(next(n for n in b.module.graph.nodes
                                    if block_key(n) is not None)) for b in chain.blocks])
        out = chain(*values, run=lambda m, *a: m(*a))
        ref = stage(*values)
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
        values = ref
    # The embedding (top-level ops), each layer, and the final norm with the head.
    assert keys == [["", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", ""]]


@pytest.mark.parametrize(("name", "policy"), [("albert", "full"), ("llama", "selective"),
                                              ("gpt2", ["offload", "full"])])
def test_real_models_under_a_policy(name: str, policy: object) -> None:
    """Hugging Face models no one here wrote: ALBERT (one layer called at every depth: each
    call is a block of its own), Llama (rotary tables read by every layer), GPT-2 (tied
    embedding across the stages); float64, exact against the unsplit model."""
    spec = real_models.SPECS[name]
    torch.manual_seed(0)
    model = spec.build().double()
    ref = copy.deepcopy(model)
    x, y = spec.batch(4, 8)
    pipe = Pipeline(model, 2, microbatches=2, loss_fn=spec.loss_fn, balance="parameters",
                    checkpoint_activations=policy)
    real_models.check_step(pipe, model, ref, x, y)
    if name == "albert":
        keys = {block_key(n) for stage in pipe.stage_modules
                for b in BlockChain(stage).blocks for n in b.module.graph.nodes}
        assert "albert.encoder.albert_layer_groups.0@1" in keys


def _saves(block: nn.Module, x: torch.Tensor) -> int:
    """How many tensors the block's forward saves that are not parameters (or their views)."""
    count = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        count[0] += not (base.is_leaf and base.requires_grad)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x.clone())
    return count[0]


def test_offload_hooks_copy_out_and_back_exactly() -> None:
    """The offload hooks' bookkeeping, run on CPU (copies within host memory): every saved
    tensor but the parameters goes out, comes back for the backward (twice under
    retain_graph, as a split backward's W reads it again) and the grads are exact."""
    from pipeline.app.models import TransformerBlock
    from pipeline.execution.activations.offload import Offloader

    torch.manual_seed(0)
    block = TransformerBlock(16, 2).double()
    x = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(block(x.clone()).sum(), [x, *block.parameters()])
    offloader = Offloader(torch.device("cpu"))
    with offloader.hooks():
        out = block(x.clone())
    assert offloader.copied == _saves(block, x) > 0
    first = torch.autograd.grad(out.sum(), [x], retain_graph=True)
    got = torch.autograd.grad(out.sum(), [x, *block.parameters()])
    torch.testing.assert_close(first[0], want[0], atol=0, rtol=0)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, atol=0, rtol=0)


def _runners(pipe: Pipeline) -> list[Any]:
    """The recomputing stages' block runners (pipeline.execution.activations.graph)."""
    from pipeline.execution.activations.graph import GraphRecomputed

    runs = [run for rt in pipe._executor.runtimes for run in rt._runs.values()]
    assert all(isinstance(run, GraphRecomputed) for run in runs)
    return [r for run in runs for r in run.runners]


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_runs_at_graph_level(gpt: Any, policy: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block of the demo GPT runs its traced graphs (no torch.utils.checkpoint), also
    under a split backward, whose W then runs apart from B (nothing recomputed twice)."""
    import torch.utils.checkpoint as ckpt

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.utils.checkpoint ran")

    monkeypatch.setattr(ckpt, "checkpoint", refused)
    model, x, y, want = gpt
    pipe = Pipeline(model, 2, schedule="zb-h1", microbatches=4, loss_fn=lm_loss,
                    balance="uniform", checkpoint_activations=policy)
    _check(pipe, x, y, want)
    runners = _runners(pipe)
    assert len(runners) == 6
    assert all(r.graph_calls == 4 and r.checkpointed_calls == 0 for r in runners)
    assert not any(rt._runs[s].checkpoints for rt in pipe._executor.runtimes
                   for s in rt._runs)


def test_a_block_that_does_not_trace_is_checkpointed() -> None:
    """A BatchNorm updates its running statistics in place, which the joint trace refuses:
    its block runs under torch.utils.checkpoint (statistics updated once per microbatch), the
    others at graph level; loss, grads and buffers equal the unsplit microbatched run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 4))
    model = model.double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe = Pipeline(model, 2, schedule="zb-h1", microbatches=2, loss_fn=F.mse_loss,
                    balance="uniform", checkpoint_activations="full", example_input=x)
    loss = pipe.step(x, y)
    expected = sum(F.mse_loss(ref(xm), ym) / 2
                   for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True))
    assert isinstance(expected, torch.Tensor)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=ATOL, rtol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0, msg=name)
    for (name, b), c in zip(model.named_buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(b, c, atol=ATOL, rtol=0, msg=name)
    calls = {r.name.split("region ")[1]: (r.graph_calls, r.checkpointed_calls)
             for r in _runners(pipe)}
    assert calls["'1'"] == (0, 2)  # the BatchNorm
    assert calls["'0'"] == (2, 0) and calls["'3'"] == (2, 0)


def test_graph_level_recompute_traces_each_new_shape() -> None:
    """A batch of another size and sequence length (dynamic_dims): the blocks trace again
    for the new shapes and stay exact."""
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, 2, schedule="zb-h1", microbatches=2, loss_fn=lm_loss,
                    balance="uniform", checkpoint_activations="selective", dynamic_dims=(1,))
    for rows, seq in ((4, 6), (6, 5)):
        x, y = torch.randint(0, 32, (rows, seq)), torch.randint(0, 32, (rows, seq))
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)
        want = sum(lm_loss(ref(xm), ym) * len(xm) / rows
                   for xm, ym in zip(x.tensor_split(2), y.tensor_split(2), strict=True))
        assert isinstance(want, torch.Tensor)
        want.backward()
        torch.testing.assert_close(loss, want.detach(), atol=ATOL, rtol=0)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0)
    runners = _runners(pipe)
    assert all(r.checkpointed_calls == 0 and len(r.signatures) == 2 for r in runners)
