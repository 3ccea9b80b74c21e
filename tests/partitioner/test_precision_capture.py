"""Mixed precision meets capture: an autocast block inside the model's forward is kept by
torch.export (and equals eager bitwise), follows its stage to another device, and is refused by
torch.fx, which would drop it; a block around the whole forward (nested blocks too) is cut
between its modules, every stage running its ops under it, or refused naming mixed_precision=
where its ops cannot be put in the graph; a block that switches autocast off, entered only
under autocast (Hugging Face's ``maybe_autocast``), is captured because capture runs under the
Pipeline's autocast; re-capture on a new sequence length stays exact; an export -> fx fallback
logs export's error. Tolerances and the reference as in
tests/pipeline/execution/test_precision.py."""

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


class Scaled(nn.Module):
    """A module whose own forward runs its ops under autocast (Hugging Face's rotary
    embedding does so): the block lies within its unit and stays whole."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.relu(x @ self.w)
        return y.float()


def test_autocast_block_follows_its_stage_to_another_device() -> None:
    """An autocast block captured on CPU names "cpu"; moving its stage retargets it, whole (a
    block within one unit) or op by op (a block over several units; both run on CUDA by
    tests/pipeline/execution/test_cuda.py)."""
    from partitioner.autocast import WRAP_WITH_AUTOCAST, Autocasted
    from partitioner.exported import retarget

    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(16, 16), Scaled(), nn.Linear(16, 8))
    for model, hops in ((whole, 1), (InnerAutocast(), 0)):
        pipe = Pipeline(model, stages=2, microbatches=M, loss_fn=mse, balance="uniform",
                        example_input=float_batch()[0])
        moved = [copy.deepcopy(m) for m in pipe.stage_modules]
        for stage in moved:
            retarget(stage, torch.device("cuda", 0))
        nodes = [n for m in moved for n in m.graph.nodes]
        blocks = [n.args[0] for n in nodes if n.target is WRAP_WITH_AUTOCAST]
        ops = [r.device_type for n in nodes if isinstance(n.target, Autocasted)
               for r in n.target.regions]
        assert len(blocks) == hops and (ops == []) == (hops == 1), (blocks, ops)
        assert set(blocks + ops) == {"cuda"}


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


class Block(nn.Module):
    def __init__(self, width: int = 16, out: int = 16) -> None:
        super().__init__()
        self.l = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.l(x))


class WholeAutocast(nn.Module):
    """The whole forward under one autocast block: torch.export records it as one op over
    every module, which the capture must cut between the blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block(), Block(), Block(16, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for block in self.blocks:
                x = block(x)
        return x.float()


class NestedAutocast(WholeAutocast):
    """An fp32 block over two modules nested in the bf16 one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = self.blocks[0](x)
            with torch.autocast("cpu", enabled=False):
                x = self.blocks[2](self.blocks[1](x.float()))
            x = self.blocks[3](x)
        return x.float()


class NoAutocast(WholeAutocast):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize(("model_type", "stages", "schedule"), [
    (WholeAutocast, 2, "1f1b"), (WholeAutocast, 4, "1f1b"), (WholeAutocast, 2, "zb-h1"),
    (NestedAutocast, 2, "1f1b"),
])
def test_autocast_around_the_whole_forward_is_cut_between_blocks(
    model_type: type[nn.Module], stages: int, schedule: str
) -> None:
    """Every stage runs its ops under the block (and a nested one under both): loss and grads
    bitwise equal to the unsplit model's, and not the fp32 run's."""
    from partitioner.autocast import Autocasted

    model = model_type()
    x, y = float_batch()
    pipe = Pipeline(model, stages=stages, microbatches=M, loss_fn=mse, schedule=schedule)
    loss = pipe.step(x, y)
    assert {f"blocks_{i}" for i in range(4)} <= set(pipe.captured.order)
    assert len(pipe.plan.sizes) == stages
    for stage in pipe.stage_modules[:-1]:  # the last may hold only the fp32 cast
        assert any(isinstance(n.target, Autocasted) for n in stage.graph.nodes)
    fp32 = reference(NoAutocast(), x, y, None)[1]
    assert_equal_run(pipe, model, loss, reference(model, x, y, None), fp32, model_type.__name__)


def test_autocast_block_that_cannot_be_cut_names_itself_and_mixed_precision() -> None:
    """A block whose result is read whole (not item by item, as torch.export writes it) cannot
    be put in the graph op by op: the error names the block and its modules, and the way out."""
    from partitioner.autocast import WRAP_WITH_AUTOCAST, inline_regions
    from partitioner.exported import export_flat, unit_key
    from partitioner.traced import is_default_leaf

    model = WholeAutocast()
    gm = export_flat(model, (float_batch()[0],), {}).gm
    hop = next(n for n in gm.graph.nodes if n.target is WRAP_WITH_AUTOCAST)
    with gm.graph.inserting_after(hop):
        gm.graph.call_function(len, (hop,))
    with pytest.raises(ValueError, match=r"WholeAutocast's forward runs blocks.0, blocks.1, "
                                         r"blocks.2, blocks.3 inside one torch.autocast\(\"cpu\", "
                                         r"dtype=torch.bfloat16.*mixed_precision=torch.bfloat16"):
        inline_regions(gm, lambda n: unit_key(n, model, is_default_leaf), "WholeAutocast")
