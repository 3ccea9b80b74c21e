"""Train and evaluate in one Pipeline: pipe.train()/pipe.eval() switch, pipe.evaluate(x, y) runs a
forward-only pass with the step's loss. Train steps interleaved with evaluations give exactly the
losses and weights of the unsplit model doing the same (float64, BatchNorm, every schedule);
with dropout, an evaluation after training equals the unsplit model's eval() loss on the same
weights; an evaluation leaves .grad, the RNG and BatchNorm statistics (eval mode) untouched."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline.api import Pipeline
from scheduler import SCHEDULES
from tests.support.models import bn_batch as batch
from tests.support.models import bn_model, lm_loss, microbatched_loss, token_batch


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
        expected = microbatched_loss(ref, x, y, m, backward=True)
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
    pipe = Pipeline(model, stages=2, schedule=schedule, microbatches=4, loss_fn=F.cross_entropy)
    train_and_evaluate(pipe, model, ref, m=4)
    assert pipe.captured.method == "export" and pipe.captured.training is not None


def test_fx_capture_follows_the_modes_as_it_runs() -> None:
    model = bn_model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, stages=2, microbatches=4, loss_fn=F.cross_entropy,
                    capture_method="fx")
    train_and_evaluate(pipe, model, ref, m=4)


def test_evaluate_after_training_with_dropout_equals_unsplit_eval() -> None:
    model = bn_model(dropout=0.3)
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=F.cross_entropy)
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
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=F.cross_entropy)
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
    pipe = Pipeline(bn_model(), stages=2)
    with pytest.raises(ValueError, match="evaluate needs a loss"):
        pipe.evaluate(*batch(0))


def test_each_mode_is_captured_once_over_the_same_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pipeline.facade import train_eval as modes

    captures: list[int] = []
    original = modes.stages_in_mode
    monkeypatch.setattr(modes, "stages_in_mode",
                        lambda *a, **k: captures.append(1) or original(*a, **k))
    model = bn_model(dropout=0.3)
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=F.cross_entropy)
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    for _ in range(2):
        pipe.step(*batch(0))
        model.eval()  # the model's own switch works as pipe.eval() does
        pipe(batch(1)[0])
        model.train()
    assert len(captures) == 1
    held = {id(t) for m in pipe.stage_modules for t in (*m.parameters(), *m.buffers())}
    assert held <= own  # no second copy of any weight


def _dropout_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=48, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)  # dropout 0.1 everywhere (defaults)
    return GPT2LMHeadModel(config).double()


def _dropout_llama_on_meta() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=16, attention_dropout=0.1, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    with torch.device("meta"):
        return LlamaForCausalLM(config).double()


@pytest.mark.parametrize("build", [_dropout_gpt2, _dropout_llama_on_meta])
def test_real_models_evaluate_as_their_eval_after_training(build: Any) -> None:
    model = build()
    meta = any(p.is_meta for p in model.parameters())
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=lm_loss,
                    init_fn="reset_parameters" if meta else None)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)  # before the weights exist on meta
    before: dict[str, torch.Tensor] = {}
    for step in range(2):
        x, y = token_batch(step, rows=4, seq=8, vocab=48)
        pipe.step(x, y)
        before = before or {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    # The optimizer built first trains the weights the model and the stages hold.
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, unchanged
    x, y = token_batch(9, rows=4, seq=8, vocab=48)
    pipe.eval()
    loss = pipe.evaluate(x, y)
    with torch.no_grad():  # one process holds the whole model: run it unsplit
        expected = lm_loss(model.eval()(x), y)
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0)


@pytest.mark.slow
def test_compiled_stages_switch_modes_too() -> None:
    model = bn_model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, stages=2, microbatches=4, loss_fn=F.cross_entropy,
                    compile={"backend": "eager"})
    train_and_evaluate(pipe, model, ref, m=4, steps=2)


class ConstantsNet(nn.Module):
    """Dropout, a tensor attribute that is neither parameter nor buffer, and a tensor made in
    forward: the eval capture reads both as constants of the stages' code."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.drop, self.b = nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 3)
        self.scale = torch.linspace(0, 1, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(self.a(x)) * self.scale + torch.tensor([0.5]))


def test_a_model_with_tensor_constants_switches_to_eval() -> None:
    model = ConstantsNet().double()
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=F.cross_entropy)
    pipe.step(*batch(0))
    x, y = batch(1)
    pipe.eval()
    loss, out = pipe.evaluate(x, y, return_outputs=True)
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(loss, F.cross_entropy(want, y), atol=1e-12, rtol=0)
