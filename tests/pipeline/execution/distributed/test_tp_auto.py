"""``tensor_parallel="auto"`` and ``stages="auto"`` choosing the tensor-parallel degree:
the degrees tried (divisors of the world inside a node), the settings refused outside
torchrun, and (`auto_layout_case`, run inside the launch of test_tensor_parallel.py at world 4
with nodes of 2) the ranking holding tp=1 and tp=2 layouts and the chosen one training a step
exactly as the unsplit model."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pipeline.planning.layout import tp_degrees
from pipeline.planning.settings import PipelineSettings

ATOL = 1e-9


def test_degrees_tried_stay_inside_a_node() -> None:
    auto = PipelineSettings(stages="auto", tensor_parallel="auto")
    assert tp_degrees(auto, world_size=8, node_size=8) == [1, 2, 4, 8]
    assert tp_degrees(auto, world_size=8, node_size=2) == [1, 2]
    assert tp_degrees(PipelineSettings(stages=4, tensor_parallel="auto"), 8, 8) == [1, 2]
    assert tp_degrees(PipelineSettings(stages="auto", tensor_parallel=2), 8, 8) == [2]
    laid = auto.laid_out(stages=2, data_parallel=1, schedule="1f1b", microbatches=4,
                         virtual_stages=1, tensor_parallel=4)
    assert laid.tp_degree == 4 and laid.stages == 2
    with pytest.raises(RuntimeError, match="has no layout yet"):
        _ = auto.tp_degree


def test_auto_needs_torchrun() -> None:
    from pipeline import Pipeline

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match='tensor_parallel="auto" chooses the tensor-parallel'):
        Pipeline(model, stages=2, tensor_parallel="auto")
    with pytest.raises(TypeError, match="tensor_parallel must be an int"):
        Pipeline(model, stages=2, tensor_parallel="wide")


def auto_layout_case(build: Callable[[str], nn.Module],
                     batch: Callable[[int, int], tuple[dict[str, torch.Tensor], torch.Tensor]],
                     loss_fn: Callable[..., torch.Tensor], tensor_parallel: int | str = "auto"
                     ) -> str:
    """(In a world of 4 under torchrun) a Llama with stages="auto" and `tensor_parallel`
    ("auto", or a degree) on nodes of 2 processes: the ranking holds tp=1 and tp=2 layouts
    (with "auto"; else that degree's), the Pipeline runs the best one, and its step gives the
    unsplit model's loss and every gradient."""
    from torch.distributed.tensor import DTensor

    from pipeline import Pipeline

    started = time.perf_counter()
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # nodes of 2: tp=4 would span two
    rows = 8
    x, y = batch(0, rows)
    ref, model = build("llama"), build("llama")
    pipe = Pipeline(model, stages="auto", tensor_parallel=tensor_parallel, loss_fn=loss_fn,
                    example_input=x)
    ranking = pipe.autoplan
    assert ranking is not None
    tried = {c.tp for c in ranking.candidates}
    assert tried == ({1, 2} if tensor_parallel == "auto" else {tensor_parallel}), \
        ranking.table()
    best, layout = ranking.best, pipe.distributed.layout  # type: ignore[union-attr]
    assert (layout.tensor_parallel, layout.stages, layout.data_parallel) == (
        best.tp, best.pp, best.dp), ranking.table()
    assert f"chosen {best.label()}" in ranking.why()
    dp, d, m = best.dp, layout.dp_rank, best.microbatches
    share = rows // dp
    ids, targets = x["input_ids"], y
    expected = sum(
        loss_fn(ref(input_ids=xm), ym) * len(xm) / rows
        for r in range(dp)
        for xm, ym in zip(ids[r * share:(r + 1) * share].tensor_split(m),
                          targets[r * share:(r + 1) * share].tensor_split(m), strict=True))
    expected.backward()
    loss = pipe.step({"input_ids": ids[d * share:(d + 1) * share]},
                     targets[d * share:(d + 1) * share])
    torch.testing.assert_close(loss.double(), expected.detach(), atol=ATOL, rtol=0)
    want = dict(ref.named_parameters(remove_duplicate=False))
    held = list(pipe.named_parameters())
    assert held
    for k, p in held:
        grad: Any = p.grad
        assert grad is not None, k
        whole = grad.full_tensor() if isinstance(grad, DTensor) else grad
        torch.testing.assert_close(whole, want[k].grad, atol=ATOL, rtol=0, msg=k)
    return (f"chose {best.label()} of {len(ranking.candidates)} candidates (tp {sorted(tried)}) "
            f"in {time.perf_counter() - started:.1f} s")
