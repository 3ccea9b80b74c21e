"""Pipelines of real models (Hugging Face GPT-2 with its tied embedding, Llama, BERT, T5 with its
default cache setting, Mistral, GPT-NeoX, OPT; timm ViT, ConvNeXt and Swin; the `tok(idx) +
pos[:T]` idiom), captured by torch.export: same loss, every gradient on the user's own
parameters and the same forward output as the unsplit model (float64, 1e-9) at 2 and 4 stages; a
later batch of another size and sequence length; keyword inputs and Hugging Face outputs; the
model's own state_dict keys; a clear error for a static dim. A timm ResNet's BatchNorm against
the unsplit model run microbatch by microbatch, running statistics included."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from partitioner import capture
from pipeline import Pipeline
from pipeline.planning import planner
from tests.support.capture_memo import memo_capture
from tests.support.real_models import SPECS, build, check_step, class_loss, resnet

ATOL = 1e-9


def _call(model: torch.nn.Module, x: Any) -> Any:
    return model(**x) if isinstance(x, dict) else model(x)


def _logits(out: Any) -> torch.Tensor:
    return out["logits"] if isinstance(out, dict) else out


_MODELS: dict[str, torch.nn.Module] = {}  # one model object per family for both sizes
_CAPTURE = memo_capture()


@pytest.fixture
def capture_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both pipeline sizes capture the same 2-row first microbatch of one model object, so
    torch.export (seconds a call, most of this test's time) runs once per family; each
    Pipeline still partitions, splits and runs a copy of the real capture."""
    monkeypatch.setattr(planner, "capture", _CAPTURE)


# The families whose capture costs most here run in the slow set (-m "not slow" keeps the rest).
_SLOW_FAMILIES = {"t5", "mistral", "albert", "llama"}


@pytest.mark.usefixtures("capture_once")
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in _SLOW_FAMILIES else n for n in sorted(SPECS)
])
def test_real_model_transparency(name: str, stages: int) -> None:
    spec = SPECS[name]
    if name not in _MODELS:
        _MODELS[name] = build(name)
    model = _MODELS[name]
    ref = copy.deepcopy(model)  # the model as it is now (an earlier size left only grads)
    torch.manual_seed(1)
    x, y = spec.batch(5, 8)  # 5 rows in 4 microbatches: uneven splits
    pipe = Pipeline(model, stages, microbatches=4, loss_fn=spec.loss_fn, balance="parameters")
    check_step(pipe, model, ref, x, y)
    assert pipe.captured.method == "export"
    # Stages hold the user's Parameter objects themselves.
    own = {id(p) for p in model.parameters()}
    assert all(id(p) in own for s in pipe.stage_modules for p in s.parameters())
    assert len(pipe.plan.stages) == stages
    # A later batch with another batch size and sequence length runs on the same stages.
    x2, y2 = spec.batch(6, 6) if name not in ("vit", "convnext", "swin") else spec.batch(7, 0)
    check_step(pipe, model, ref, x2, y2)
    with torch.no_grad():
        out = pipe(x2)
        expected = _call(ref, x2)
    assert type(out) is type(expected) or isinstance(expected, dict)
    torch.testing.assert_close(_logits(out), _logits(expected), atol=ATOL, rtol=0)
    assert set(pipe.state_dict() or {}) == set(model.state_dict())


@pytest.mark.parametrize(("name", "schedule"), [pytest.param("t5", "zbv", marks=pytest.mark.slow),
                                              ("t5", "zb-h1"),
                                              ("gpt2", "zb-h2")])
def test_real_model_split_backward(name: str, schedule: str) -> None:
    """Zero-bubble schedules (backward split into B and W) on real models: T5's relative
    position bias is made in its stack's first block and reused by every later one, so the
    stage making it sends it on and W reaches its weight two ways."""
    spec = SPECS[name]
    model = build(name)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    x, y = spec.batch(6, 8)
    pipe = Pipeline(model, 2 if schedule == "zbv" else 4, schedule=schedule, microbatches=4,
                    loss_fn=spec.loss_fn, balance="parameters")
    check_step(pipe, model, ref, x, y)


def test_capture_turns_off_every_cache_and_restores_it() -> None:
    model = build("t5")
    x, _ = SPECS["t5"].batch(2, 8)
    capture(model, (), x)  # T5's decoder stack reads a config copy of its own: with its
    # cache on, torch.export fails on the EncoderDecoderCache output
    assert model.config.use_cache and model.decoder.config.use_cache
    assert not model.encoder.config.use_cache  # T5 builds its encoder with the cache off


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "recompute"),
                         [("1f1b", False), ("1f1b", True), ("zb-h1", True)])
def test_batchnorm_matches_the_microbatched_run(schedule: str, recompute: bool) -> None:
    """BatchNorm normalises each microbatch by that microbatch's statistics and updates its
    running statistics once per microbatch, so the reference is the unsplit model run
    microbatch by microbatch (each loss weighted by its rows): loss, every gradient and every
    buffer (running mean and variance, batches tracked) match. Also with activation
    checkpointing, whose recomputation (twice under a split backward: B, then W) would
    update the statistics again."""
    torch.manual_seed(0)
    model = resnet().double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(10, 3, 32, 32, dtype=torch.float64), torch.randint(0, 5, (10,))
    pipe = Pipeline(model, 2, schedule=schedule, microbatches=4, loss_fn=class_loss,
                    balance="parameters", checkpoint_activations=recompute)
    loss = pipe.step(x, y)
    expected = sum(class_loss(ref(xm), ym) * len(ym) / len(y)
                   for xm, ym in zip(x.tensor_split(4), y.tensor_split(4), strict=True))
    assert isinstance(expected, torch.Tensor)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=ATOL, rtol=0)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, ref_params[name].grad, atol=ATOL, rtol=0, msg=name)
    ref_buffers = dict(ref.named_buffers())
    assert any(name.endswith("running_mean") for name in ref_buffers)
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, ref_buffers[name], atol=ATOL, rtol=0, msg=name)
    assert ref_buffers["bn1.num_batches_tracked"].item() == 4


def test_groups_are_blocks_not_aten_ops() -> None:
    model = build("gpt2")
    x, _ = SPECS["gpt2"].batch(2, 8)
    graph = capture(model, (), x)
    flat = sum(1 for n in graph.graph_module.graph.nodes if n.op == "call_function")
    blocks = [v for v in graph.order if graph.nodes[v]["module"] in ("transformer.h.0",
                                                                     "transformer.h.1")]
    assert blocks == ["transformer_h_0", "transformer_h_1"]
    assert len(graph) < flat / 5, (len(graph), flat)
    # The tied head reads the embedding's Parameter: one object, held under both names.
    assert graph.aliases["lm_head.weight"] == ["transformer.wte.weight", "lm_head.weight"]


def test_static_dim_fails_before_running() -> None:
    model = build("vit")
    pipe = Pipeline(model, 2, microbatches=2, loss_fn=SPECS["vit"].loss_fn, balance="uniform")
    x, y = SPECS["vit"].batch(4, 0)
    pipe.step(x, y)
    model.zero_grad(set_to_none=True)
    bigger = torch.randn(4, 3, 48, 48, dtype=torch.float64)
    for _ in range(2):  # checked batch shapes are cached: a failing one never is
        with pytest.raises(ValueError, match=r"size 48 in dim 2; the captured model needs 32"):
            pipe.step(bigger, y)
    assert all(p.grad is None for p in model.parameters())
    pipe.step(x, y)  # the batch shapes checked at the first step pass again (cached)


def test_input_structure_must_match() -> None:
    model = build("bert")
    spec = SPECS["bert"]
    pipe = Pipeline(model, 2, microbatches=2, loss_fn=spec.loss_fn, balance="uniform")
    x, y = spec.batch(4, 8)
    pipe.step(x, y)
    with pytest.raises(ValueError, match=r"inputs are \(\(\), \{'input_ids': T\}\) but the model "
                                         r"was captured with \(\(\), \{.*'attention_mask': T"):
        pipe.step({"input_ids": x["input_ids"]}, y)


def test_capture_failure_names_both_fronts() -> None:
    class DataDependent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # control flow on a value: neither export nor fx can capture it
                return self.a(x)
            return x

    with pytest.raises(ValueError, match=r"torch.export could not capture .*then torch.fx"):
        capture(DataDependent(), (torch.randn(2, 4),))


def test_mode_change_after_export_switches() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5),
                                torch.nn.Linear(4, 2))
    pipe = Pipeline(model, 2, microbatches=2, loss_fn=torch.nn.functional.mse_loss,
                    balance="uniform")
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    pipe.step(x, y)
    pipe.eval()  # dropout off from here: the pipeline equals the model's eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x), atol=1e-6, rtol=0)
