"""``Pipeline(stages="auto")`` under torch.distributed (4 gloo processes, launched as torchrun
does by test_distributed.launch): every process builds the layout global rank 0's auto-planner
ranked first for the world, each replica trains on its share of the global batch, and the loss
equals the unsplit model's on the global batch (float64, 1e-9), whatever layout was chosen; a
memory limit the whole model does not fit forces a deeper pipeline (same losses); settings that
stages="auto" decides itself are refused on every process.

This file is also the worker: ``python <this file> WORKER OUT_DIR``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.support.distributed import all_ok, init_worker, launch
from tests.support.models import global_batch, lm_loss, make_model

ROWS = 8  # the global batch


def _reference_losses(steps: int) -> list[float]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, ROWS)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _train_auto(memory_limit: float | None) -> tuple[int, int]:
    from pipeline import Pipeline
    from pipeline.elastic import replica_share

    x0, _ = global_batch(0, ROWS)
    # fx capture: 0.1 s, where torch.export takes seconds a process (the layout choice
    # ranks the same units either way)
    pipe = Pipeline(make_model(), stages="auto", schedule="1f1b", loss_fn=lm_loss,
                    memory_limit=memory_limit, example_input=x0, capture_method="fx")
    ctx, plan = pipe.distributed, pipe.autoplan
    assert ctx is not None and plan is not None
    best = plan.best
    assert (ctx.layout.stages, ctx.layout.data_parallel) == (best.pp, best.dp), (ctx, best)
    assert pipe.microbatches == best.microbatches and plan.world_size == 4
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    expected = _reference_losses(3)
    for step in range(3):
        x, y = global_batch(step, ROWS)
        pipe.zero_grad()
        loss = pipe.step(replica_share(x, best.dp, ctx.layout.dp_rank),
                         replica_share(y, best.dp, ctx.layout.dp_rank))
        opt.step()
        assert abs(float(loss) - expected[step]) < 1e-9, (step, float(loss), expected[step])
    return best.pp, best.dp


def worker_auto(out: Path) -> None:
    from pipeline import Pipeline

    init_worker()
    free = _train_auto(None)
    weights = sum(p.numel() * p.element_size() for p in make_model().parameters())
    deep = _train_auto(0.75 * 4 * weights)  # weights, grads, two moments: not on one rank
    assert deep[0] >= 2, deep
    print(f"layouts chosen: {free} without a limit, {deep} under it")
    x0, _ = global_batch(0, ROWS)
    for kwargs, text in (({}, "pass example_input="),
                         ({"example_input": x0, "data_parallel": 2}, "drop data_parallel=2"),
                         ({"example_input": x0, "schedule": "nope.txt"}, "needs a schedule")):
        with pytest.raises(ValueError, match=text):
            Pipeline(make_model(), stages="auto", loss_fn=lm_loss, **kwargs)  # type: ignore[arg-type]
    torch.distributed.destroy_process_group()
    print("worker auto: every check ran")


WORKERS = {"auto": worker_auto}


@pytest.mark.slow
def test_auto_stages_choose_the_layout_for_the_world(tmp_path: Path) -> None:
    ended = launch("auto", 4, tmp_path, script=__file__, deadline=240)
    all_ok(ended, "auto")
    print(next(line for line in ended[0].output.splitlines() if "layouts chosen" in line))


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
