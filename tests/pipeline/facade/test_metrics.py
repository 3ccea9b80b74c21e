"""Per-step metrics (pipe.metrics, pipe.log_metrics): the FLOP count equals FlopCounterMode on
the unsplit model doing the same step (a transformers GPT-2 config, a timm ConvNeXt, a Llama
config built on meta), samples and tokens, MFU against a given peak, the measured bubble, the
memory per rank, the log line every N steps, and the bad settings."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipeline.api import Pipeline
from pipeline.facade import metrics
from tests.support.real_models import SPECS, build


def unsplit_flops(model: nn.Module, x: Any) -> int:
    """FLOPs of forward + backward of the unsplit model on batch `x`."""
    with FlopCounterMode(display=False) as counter:
        out = model(**x) if isinstance(x, dict) else model(x)
        logits = out.logits if hasattr(out, "logits") else out
        logits.sum().backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def test_gpt2_figures_and_log_line() -> None:
    model = build("gpt2")
    x, y = SPECS["gpt2"].batch(4, 8)
    expected = unsplit_flops(model, x)
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=SPECS["gpt2"].loss_fn)
    lines: list[str] = []
    pipe.log_metrics(every=2, peak_flops=1e9, to=lines.append)
    assert pipe.metrics is None
    for _ in range(3):
        loss = pipe.step(x, y)
    got = pipe.metrics
    assert got is not None and got.step == 3 and got.loss is loss
    assert (got.samples, got.tokens, got.devices) == (4, 32, 2)
    assert got.flops == pytest.approx(expected)
    assert got.samples_per_s == pytest.approx(4 / got.seconds)
    assert got.tokens_per_s == pytest.approx(32 / got.seconds)
    assert got.mfu == pytest.approx(expected / got.seconds / (1e9 * 2))
    assert got.bubble == pytest.approx(pipe.trace.bubble_fraction)  # every rank in one process
    assert 0 < got.bubble < 1
    assert set(got.peak_memory) == {0, 1} and min(got.peak_memory.values()) > 2**20
    assert len(lines) == 1 and lines[0].startswith("hybridpipe: step 2 | loss ")
    for part in ("samples/s", "tokens/s", "MFU", "bubble", "rank0", "process peak RSS"):
        assert part in lines[0], part
    # The process's lifetime peak RSS: MiB alone, GiB after a suite's worth of models.
    assert re.search(r"rank0 [\d.]+ [MG]iB", lines[0]), lines[0]
    pipe.log_metrics(None)
    pipe.step(x, y)
    assert len(lines) == 1


def test_images_have_no_tokens_and_the_flops_of_the_unsplit_model() -> None:
    model = build("convnext")
    x, y = SPECS["convnext"].batch(4, 0)
    expected = unsplit_flops(model, x)
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=SPECS["convnext"].loss_fn)
    pipe.step(x, y)
    got = pipe.metrics
    assert got is not None and got.tokens is None and got.tokens_per_s is None
    assert got.flops == pytest.approx(expected)
    assert got.mfu is None  # no peak known on CPU, none given
    assert "no peak known" in got.line()


def test_meta_model_counts_without_storage() -> None:
    real = build("llama")
    # Captured on meta, attention is counted as its matmuls; CPU sdpa is not counted at all.
    real.config._attn_implementation = "eager"
    with torch.device("meta"):
        meta = build("llama")
    x, y = SPECS["llama"].batch(4, 8)
    expected = unsplit_flops(real, x)
    pipe = Pipeline(meta, stages=2, microbatches=2, loss_fn=SPECS["llama"].loss_fn,
                    init_fn="reset_parameters")
    pipe.step(x, y)
    assert pipe.metrics is not None and pipe.metrics.flops == pytest.approx(expected)


def test_peak_from_the_device_name(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=None: "NVIDIA H100 80GB HBM3")
    assert metrics.device_peak_flops(cuda, "bf16") == 989e12
    assert metrics.device_peak_flops(cuda, "fp16") == 989e12
    assert metrics.device_peak_flops(cuda, "float64") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=None: "NVIDIA H100 PCIe")
    assert metrics.device_peak_flops(cuda, "tf32") == 378e12
    assert metrics.device_peak_flops(torch.device("cpu"), "bf16") is None
    assert metrics.arithmetic(torch.bfloat16) == "bf16"
    assert metrics.arithmetic(torch.float64) == "float64"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"every": 0}, "every=0"), ({"every": 2.5}, "every=2.5"),
    ({"peak_flops": -1.0}, "peak_flops=-1.0"),
])
def test_bad_settings(kwargs: dict[str, Any], message: str) -> None:
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), stages=2)
    with pytest.raises(ValueError, match=message):
        pipe.log_metrics(**kwargs)


def test_format() -> None:
    assert metrics.format_flops(3.83e6) == "3.83 MFLOP"
    assert metrics.format_flops(4.12e14) == "412 TFLOP"
    assert metrics.format_bytes(31.4 * 2**20) == "31.4 MiB"
    assert metrics.format_bytes(512) == "512 B"
    assert metrics.format_bytes(1000 * 2**20) == "1000 MiB"  # not "1e+03 MiB"
    assert metrics.format_bytes(2.5 * 2**40) == "2560 GiB"


def _gpt_pipe() -> tuple[Pipeline, torch.Tensor]:
    from pipeline.app.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=32, dim=16, layers=2, heads=2, max_seq=8)
    x = torch.randint(0, 32, (4, 8))
    return Pipeline(model, stages=2, microbatches=2,
                    loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1),
                                                                       y.flatten())), x


def test_printed_metrics_read_as_figures_and_lines_reach_the_user(
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """print(pipe.metrics): samples/s, tokens/s, MFU, bubble and peak memory in MiB or GiB,
    not the dataclass's fields. log_metrics() without `to` prints the line when logging is
    not set up to show INFO (Python's default drops it), and logs it when it is."""
    pipe, x = _gpt_pipe()
    pipe.log_metrics(every=1, peak_flops=1e9)
    pipe.step(x, x)
    out = capsys.readouterr().out
    assert out.startswith("hybridpipe: step 1 | loss "), out
    text = str(pipe.metrics)
    for part in ("samples/s", "tokens/s", "MFU", "of 1 GFLOP/s x 2", "bubble", "peak memory"):
        assert part in text, text
    assert re.search(r"rank0 [\d.]+ [MG]iB", text) and "seconds=" not in text, text
    assert text.splitlines()[0].startswith("step 1: loss ")
    caplog.set_level("INFO", logger="hybridpipe")
    pipe.step(x, x)
    assert capsys.readouterr().out == ""
    assert [r.getMessage()[:20] for r in caplog.records if r.name == "hybridpipe"] == [
        "hybridpipe: step 2 |"]


def test_step_numbers_continue_after_a_resume(tmp_path: Any,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A Checkpointer's resume sets steps_done: the metrics and their lines number the next
    step after the resumed one, not 1 again."""
    from pipeline import Checkpointer

    pipe, x = _gpt_pipe()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ckpt = Checkpointer(pipe, tmp_path / "ckpt", opt, every=3)
    for step in range(3):
        pipe.step(x, x)
        ckpt.maybe_save(step + 1)
    again, _ = _gpt_pipe()
    resumed = Checkpointer(again, tmp_path / "ckpt", torch.optim.SGD(again.parameters(),
                                                                     lr=0.1)).resume()
    assert resumed is not None and resumed.step == again.steps_done == 3
    again.log_metrics(every=1, to=print)
    again.step(x, x)
    assert again.metrics is not None and again.metrics.step == 4
    assert capsys.readouterr().out.startswith("hybridpipe: step 4 | loss ")
    with pytest.raises(ValueError, match="steps_done=-1"):
        again.steps_done = -1
