"""Mixed precision meets capture: an autocast block inside the model's forward is kept by
torch.export (and equals eager bitwise), follows its stage to another device, and is refused by
torch.fx, which would drop it; a block that switches autocast off, entered only under autocast
(Hugging Face's ``maybe_autocast``), is captured because capture runs under the Pipeline's
autocast; re-capture on a new sequence length stays exact; an export -> fx fallback logs
export's error. Tolerances and the reference as in tests/pipeline/execution/test_precision.py."""

from __future__ import annotations

import copy
import importlib
import logging
from typing import Any

import pytest
import torch
from torch import nn

from partitioner.capture import CaptureError
from pipeline import Pipeline
from tests.support.precision import M, assert_equal_run, float_batch, mse, reference, res_model


class InnerAutocast(nn.Module):
    """A forward that runs its middle layers under its own autocast block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.d = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = torch.relu(self.c(torch.relu(self.b(x))))
        return self.d(x.float())


class WithoutBlock(InnerAutocast):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


def test_autocast_block_in_forward_is_captured_by_export() -> None:
    model = InnerAutocast()
    x, y = float_batch()
    fp32 = reference(WithoutBlock(), x, y, None)[1]
    pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=mse, balance="uniform")
    loss = pipe.step(x, y)
    assert pipe.captured.method == "export"
    assert_equal_run(pipe, model, loss, reference(model, x, y, None), fp32, "inner autocast")


def test_autocast_block_follows_its_stage_to_another_device() -> None:
    """An autocast block captured on CPU names "cpu"; moving its stage retargets it (run on
    CUDA by tests/pipeline/execution/test_cuda.py)."""
    from partitioner.autocast import WRAP_WITH_AUTOCAST
    from partitioner.exported import retarget

    pipe = Pipeline(InnerAutocast(), stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                    example_input=float_batch()[0])
    holding = [m for m in pipe.stage_modules
               if any(n.target is WRAP_WITH_AUTOCAST for n in m.graph.nodes)]
    assert len(holding) == 1
    moved = copy.deepcopy(holding[0])
    retarget(moved, torch.device("cuda", 0))
    assert [n.args[0] for n in moved.graph.nodes if n.target is WRAP_WITH_AUTOCAST] == ["cuda"]
    assert "'cuda'" in moved.code


def test_autocast_block_in_forward_refused_by_fx() -> None:
    pipe = Pipeline(InnerAutocast(), stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                    capture_method="fx")
    with pytest.raises(CaptureError, match=r"torch.fx cannot record an autocast block.*"
                                           r"capture_method='export'"):
        pipe.step(*float_batch())


class Fp32Island(nn.Module):
    """Hugging Face's ``maybe_autocast`` pattern: a block that switches autocast off, entered
    only when autocast is on (so an fp32 capture never sees it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                h = h.float()
                h = torch.softmax(h @ h.transpose(-1, -2), -1) @ h
        else:
            h = torch.softmax(h @ h.transpose(-1, -2), -1) @ h
        return self.b(h)


def test_autocast_off_block_entered_only_under_autocast_is_captured() -> None:
    """Capture runs under the Pipeline's autocast, so the fp32 island is in the graph; fx,
    which would drop it, refuses."""
    model = Fp32Island()
    x, y = torch.randn(8, 5, 16), torch.randn(8, 5, 8)
    fp32 = reference(model, x, y, None)[1]
    pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                    mixed_precision=torch.bfloat16)
    loss = pipe.step(x, y)
    assert_equal_run(pipe, model, loss, reference(model, x, y, torch.bfloat16), fp32,
                     "fp32 island")
    fx = Pipeline(Fp32Island(), stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                  mixed_precision=torch.bfloat16, capture_method="fx")
    with pytest.raises(CaptureError, match=r"enabled=False"):
        fx.step(x, y)


def test_recapture_on_a_new_sequence_length_keeps_autocast() -> None:
    model = res_model()
    pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                    mixed_precision=torch.bfloat16)
    for seq in (4, 6):
        torch.manual_seed(seq)
        x, y = torch.randn(8, seq, 16), torch.randn(8, seq, 8)
        model.zero_grad()
        loss = pipe.step(x, y)
        fp32 = reference(model, x, y, None)[1]
        assert_equal_run(pipe, model, loss, reference(model, x, y, torch.bfloat16), fp32,
                         f"sequence length {seq}")


def test_fx_fallback_logs_exports_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    capture_module = importlib.import_module("partitioner.capture")  # not the function

    def broken(*_: Any) -> Any:
        raise RuntimeError("export exploded on purpose")

    monkeypatch.setattr(capture_module, "export_flat", broken)
    with caplog.at_level(logging.WARNING, logger="hybridpipe"):
        pipe = Pipeline(res_model(), stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                        example_input=float_batch()[0])
    assert pipe.captured.method == "fx"
    assert any("torch.fx instead" in r.message and "export exploded on purpose" in r.message
               for r in caplog.records), caplog.text
