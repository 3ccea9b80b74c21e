"""Mixed precision (``Pipeline(mixed_precision=torch.bfloat16 | torch.float16)``) in one
process: the loss and every gradient equal the unsplit model run microbatch by microbatch under
``torch.autocast`` with fp32 parameters (the loss in fp32 on the upcast output; under fp16 each
microbatch's backward from ``loss * scale`` and the sum divided by the scale, as
torch.amp.GradScaler does), for every schedule, with activation checkpointing, and on Hugging
Face GPT-2 (tied) and Llama; every case also differs from the fp32 run, so dropping autocast
anywhere fails it.

Tolerance: bitwise (atol = rtol = 0). The pipeline runs the same aten kernels on the same
tensors in the same order as the reference: capture keeps the model's ops, autocast casts the
same way in a stage as in the whole model, and each parameter's fp32 grad sums the microbatches
in microbatch order. The one exception is a tied parameter (GPT-2's embedding / LM head): the
pipeline adds its two fp32 partial gradients in another order, one rounding of fp32 (rtol 2e-6).
Llama runs with eager attention: traced, Hugging Face's SDPA path materialises the causal mask
that eager SDPA replaces by ``is_causal``, a different kernel (equal in fp32, not bitwise in
bf16), which is capture's doing, not the pipeline's.

fp16 loss scaling is checked against torch.amp.GradScaler step by step (skips, backoff, growth,
parameters), with an injected overflow, and through a checkpoint round trip. A switch to eval
mode and back (the other mode captured on a fake stand-in) keeps the autocast dtypes: under
``mixed_precision`` and with an autocast block in the model's forward. Autocast blocks inside
forward and capture: tests/partitioner/test_precision_capture.py."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pipeline
from pipeline import Pipeline
from scheduler import SCHEDULES
from tests.support.capture_memo import memo_capture
from tests.support.precision import (
    M,
    assert_equal_run,
    float_batch,
    inject_overflow,
    mlp_model,
    mse,
    reference,
    res_model,
)

DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture
def memo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from pipeline.planning import planner

    monkeypatch.setattr(planner, "capture", memo_capture())
    yield


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_schedule_equals_unsplit_autocast(dtype: torch.dtype, memo: None) -> None:
    model = res_model()
    x, y = float_batch()
    fp32 = reference(model, x, y, None)[1]
    for schedule in sorted(SCHEDULES):
        model.zero_grad()
        pipe = Pipeline(model, stages=2, schedule=schedule, microbatches=M, loss_fn=mse,
                        balance="uniform", mixed_precision=dtype)
        loss = pipe.step(x, y)
        scale = pipe.scaler.get_scale() if pipe.scaler is not None else 1.0
        assert (pipe.scaler is not None) == (dtype == torch.float16)
        want = reference(model, x, y, dtype, scale=scale)
        assert_equal_run(pipe, model, loss, want, fp32, f"{dtype} {schedule}")


@pytest.mark.parametrize(("schedule", "policy"), [
    ("1f1b", True), ("zb-h1", "selective"),
    ("interleaved-1f1b", ["full", "selective", "offload", "none"])])
def test_activation_checkpointing_recomputes_under_autocast(
    schedule: str, policy: object, memo: None
) -> None:
    """Every activation policy (one per stage on the interleaved schedule) recomputes under
    the autocast its forward ran in."""
    model = res_model()
    x, y = float_batch()
    fp32 = reference(model, x, y, None)[1]
    pipe = Pipeline(model, stages=2, schedule=schedule, microbatches=M, loss_fn=mse,
                    balance="uniform", mixed_precision=torch.bfloat16,
                    checkpoint_activations=policy)
    loss = pipe.step(x, y)
    want = reference(model, x, y, torch.bfloat16)
    assert_equal_run(pipe, model, loss, want, fp32, f"checkpointed {schedule}")


@pytest.mark.parametrize(("build", "crossing"), [(mlp_model, torch.bfloat16),
                                                 (res_model, torch.float32)])
def test_activations_cross_stages_in_their_own_dtype(build: Any, crossing: torch.dtype) -> None:
    """A Linear's output crosses as bf16 (half the bytes); a residual stream stays fp32."""
    model = build()
    x, y = float_batch()
    pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                    mixed_precision=torch.bfloat16, example_input=x)
    seen: list[torch.dtype] = []
    pipe.stage_modules[0].register_forward_hook(
        lambda _m, _i, out: seen.extend(t.dtype for t in out if t.is_floating_point())
    )
    pipe.step(x, y)
    assert seen and set(seen) == {crossing}, seen
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
               for p in model.parameters())
    out = pipe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(out, model(x), atol=0, rtol=0)


def test_caller_autocast_refused_or_agreeing() -> None:
    model = res_model()
    x, y = float_batch()
    plain = Pipeline(model, stages=2, microbatches=M, loss_fn=mse, balance="uniform")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match=r"mixed_precision=torch.bfloat16"):
            plain.step(x, y)
        with pytest.raises(ValueError, match=r"mixed_precision="):
            plain(x)
    bf16 = Pipeline(model, stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                    mixed_precision=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(ValueError, match=r"built with mixed_precision=torch.bfloat16"):
            bf16.step(x, y)
    assert all(p.grad is None for p in model.parameters())  # refused before running
    fp32 = reference(model, x, y, None)[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # agrees: applied in every stage
        loss = bf16.step(x, y)
    assert_equal_run(bf16, model, loss, reference(model, x, y, torch.bfloat16), fp32,
                     "autocast around step")


def test_a_model_cast_to_bf16_is_told_about_master_weights(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="hybridpipe"):
        Pipeline(res_model().to(torch.bfloat16), stages=2, microbatches=M, loss_fn=mse)
    assert "no fp32 master weights" in caplog.text and "mixed_precision=" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridpipe"):
        Pipeline(res_model(), stages=2, microbatches=M, loss_fn=mse,
                 mixed_precision=torch.bfloat16)
    assert "master weights" not in caplog.text


def test_bad_mixed_precision_values() -> None:
    with pytest.raises(TypeError, match="mixed_precision must be"):
        Pipeline(res_model(), stages=2, mixed_precision="bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mixed_precision=None"):
        Pipeline(res_model(), stages=2, mixed_precision=torch.float32)
    with pytest.raises(TypeError, match="reduce_dtype must be"):
        Pipeline(res_model(), stages=2, reduce_dtype=torch.float64)


# -- fp16 loss scaling ---------------------------------------------------------------------------


def test_fp16_scaling_follows_grad_scaler_step_by_step() -> None:
    """From a scale that overflows (2**40): the same skipped steps, backoffs, growth (interval
    2) and parameters as torch.amp.GradScaler on the unsplit model."""
    model = mlp_model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                    mixed_precision=torch.float16)
    assert pipe.scaler is not None
    pipe.scaler.load_state_dict({"scale": 2.0**40, "_growth_tracker": 0, "growth_interval": 2})
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    skipped = 0
    for step in range(30):
        x, y = float_batch(step)
        pipe.step(x, y)
        stepped = pipe.optimizer_step(opt)
        opt.zero_grad()
        for xm, ym in zip(x.tensor_split(M), y.tensor_split(M), strict=True):
            with torch.autocast("cpu", dtype=torch.float16):
                out = ref(xm)
            scaler.scale(mse(out.float(), ym) * (len(ym) / len(y))).backward()
        before = scaler.get_scale()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        assert stepped == (scaler.get_scale() >= before), f"step {step}"
        skipped += not stepped
        assert pipe.scaler.get_scale() == scaler.get_scale(), f"step {step}"
        for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, atol=0, rtol=0, msg=f"step {step}: {k}")
    assert skipped >= 3 and pipe.scaler.get_scale() < 2.0**40  # overflowed, then trained
    assert pipe.scaler.state_dict()["_growth_tracker"] == scaler.state_dict()["_growth_tracker"]


def test_fp16_injected_overflow_skips_and_backs_off(tmp_path: Path) -> None:
    model = mlp_model()
    pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                    mixed_precision=torch.float16, example_input=float_batch()[0])
    assert pipe.scaler is not None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = inject_overflow(pipe.stage_modules[1])
    pipe.step(*float_batch())
    handle.remove()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    assert pipe.scaler.found_inf
    assert not pipe.optimizer_step(opt)
    assert pipe.scaler.get_scale() == 2.0**15 and not pipe.scaler.found_inf
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters())
    opt.zero_grad()
    pipe.step(*float_batch(1))
    assert pipe.optimizer_step(opt)
    assert any(not torch.equal(p, before[k]) for k, p in model.named_parameters())
    # The scale (and growth tracker) survive a checkpoint round trip.
    pipe.save_checkpoint(tmp_path / "ckpt", opt, extra={"epoch": 3})
    again = Pipeline(mlp_model(), stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                     mixed_precision=torch.float16, example_input=float_batch()[0])
    assert again.scaler is not None and again.scaler.get_scale() == 2.0**16
    assert again.load_checkpoint(tmp_path / "ckpt") == {"epoch": 3}
    assert again.scaler.state_dict() == pipe.scaler.state_dict()


def test_optimizer_step_without_scaling_just_steps() -> None:
    model = res_model()
    pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                    mixed_precision=torch.bfloat16)
    assert pipe.scaler is None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    pipe.step(*float_batch())
    assert pipe.optimizer_step(opt)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    with pytest.raises(TypeError, match="optimizer_step needs an optimizer"):
        pipe.optimizer_step(object())  # type: ignore[arg-type]


# -- train/eval switches ------------------------------------------------------------------------


class UpcastDropout(nn.Module):
    """Dropout (so eval mode is another capture) and a ``.float()`` export checks the input
    dtype of: bf16 under autocast."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.drop, self.b = nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(self.a(x)).float())


class AutocastBlockNorm(nn.Module):
    """BatchNorm inside the model's own bf16 autocast block: eval mode is another capture."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.norm, self.b = nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.norm(self.a(x))
        return self.b(h.float())


def test_eval_switch_under_mixed_precision_equals_unsplit_autocast() -> None:
    model = UpcastDropout()
    x, y = float_batch()
    pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=mse,
                    mixed_precision=torch.bfloat16)
    pipe.step(x, y)
    pipe.eval()
    assert not model.training
    with torch.no_grad():
        got = pipe(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = torch.cat([model(c) for c in x.tensor_split(M)])
        fp32 = torch.cat([model(c) for c in x.tensor_split(M)])
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert not torch.equal(got.float(), fp32)


def _unsplit_step(ref: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`ref` microbatch by microbatch as `Pipeline.step` runs it (grads and statistics kept)."""
    total = torch.zeros(())
    for xm, ym in zip(x.tensor_split(M), y.tensor_split(M), strict=True):
        loss = mse(ref(xm), ym) * (len(ym) / len(y))
        loss.backward()
        total += loss.detach()
    return total


def test_autocast_block_switches_to_eval_and_back_exactly() -> None:
    model = AutocastBlockNorm()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=mse)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k in range(3):
        x, y = float_batch(k)
        if k:  # eval between training steps, then back to train mode
            pipe.eval()
            ref.eval()
            with torch.no_grad():
                got = pipe(x)
                assert torch.equal(got, torch.cat([ref(c) for c in x.tensor_split(M)]))
            pipe.train()
            ref.train()
        assert torch.equal(pipe.step(x, y), _unsplit_step(ref, x, y))
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values(),
                                strict=True):
            assert torch.equal(a, b), name


class Upcast(nn.Module):
    """A ``.float()`` in the forward (export checks the dtype it meets) and no randomness."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).float())


@pytest.mark.parametrize("build", [Upcast, AutocastBlockNorm])
def test_meta_built_model_under_mixed_precision_equals_unsplit_autocast(
    build: type[nn.Module],
) -> None:
    """Built on meta, captured on meta (where autocast does nothing), run in bf16: the
    pipeline equals the unsplit model with the weights it materialised under the same
    autocast (before the fix, the first step failed on the dtype export recorded on meta)."""
    torch.manual_seed(0)
    with pipeline.meta_init():
        model = build()
    pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=mse, init_fn="reset_parameters",
                    mixed_precision=torch.bfloat16)
    x, y = float_batch()
    loss = pipe.step(x, y)
    ref = build()
    ref.load_state_dict(pipe.state_dict())
    fp32 = copy.deepcopy(ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _unsplit_step(ref, x, y)
    assert torch.equal(loss, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert not torch.equal(loss, _unsplit_step(fp32, x, y))  # autocast really ran


# -- real models ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_real_models_bf16_and_fp16(name: str) -> None:
    from tests.support.real_models import SPECS, build

    model = build(name).float()
    if name == "llama":
        model.set_attn_implementation("eager")  # see the module docstring
    tied = frozenset({"transformer.wte.weight"}) if name == "gpt2" else frozenset()
    spec = SPECS[name]
    torch.manual_seed(1)
    x, y = spec.batch(8, 8)
    fp32 = reference(model, x, y, None, loss_fn=spec.loss_fn)[1]
    for dtype, schedule in [(torch.bfloat16, "1f1b"), (torch.float16, "zb-h1")]:
        model.zero_grad()
        pipe = Pipeline(model, stages=2, schedule=schedule, microbatches=M,
                        loss_fn=spec.loss_fn, balance="parameters", mixed_precision=dtype)
        loss = pipe.step(x, y)
        scale = pipe.scaler.get_scale() if pipe.scaler is not None else 1.0
        want = reference(model, x, y, dtype, scale=scale, loss_fn=spec.loss_fn)
        assert_equal_run(pipe, model, loss, want, fp32, f"{name} {dtype}", tied)
