"""CUDA paths: the stream layer and the local executor on GPU devices. These need a CUDA device
and are skipped without one (CI has none); every other test covers the same code on CPU, where
the stream layer is a no-op. On a one-GPU machine all ranks share cuda:0, which still exercises
the per-rank streams, events and copies."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from pipeline import Pipeline
from pipeline.app.models import SkipNet
from pipeline.execution import streams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ATOL = 1e-10


def test_stream_layer_orders_work_across_streams() -> None:
    device = torch.device("cuda:0")
    producer, consumer = streams.new_stream(device), streams.new_stream(device)
    assert isinstance(producer, torch.cuda.Stream)
    with streams.use_stream(producer):
        x = torch.ones(1 << 20, device=device)
        for _ in range(20):
            x = x * 1.0001
        event = streams.record_event(producer)
    streams.wait_event(consumer, event)
    with streams.use_stream(consumer):
        streams.record_stream(x, consumer)
        y = x.sum()
    torch.cuda.synchronize()
    expected = torch.full((1 << 20,), 1.0001**20, device=device).sum()
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved-1f1b", "zbv"])
def test_local_executor_on_cuda_matches_cpu(schedule: str) -> None:
    torch.manual_seed(0)
    model = SkipNet(dim=16, blocks=6).double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16, dtype=torch.float64)
    y = torch.randint(0, 10, (8,))
    pipe = Pipeline(
        model.cuda(),
        stages=2,
        schedule=schedule,
        microbatches=4,
        loss_fn=F.cross_entropy,
        balance="uniform",
        devices=["cuda:0", "cuda:0"],
    )
    loss = pipe.step(x.cuda(), y.cuda())
    ref_loss = sum(
        F.cross_entropy(reference(xm), ym) * len(xm) / len(x)
        for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True)
    )
    ref_loss.backward()
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), atol=ATOL, rtol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=ATOL, rtol=0, msg=name)
