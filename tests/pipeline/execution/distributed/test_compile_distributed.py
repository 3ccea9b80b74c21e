"""Compiled stages under torchrun (4 gloo processes, pp=2 x dp=2): a ZB-H1 step of the tiny
GPT with ``compile=`` and shard="optimizer" (ZeRO-1) equals the unsplit model on the global
batch (float64, 1e-10: the loss and the parameters after the sharded SGD step); bf16 mixed
precision equals the eager pipeline of the same settings (1e-6); shard="full" runs eager with
a warning naming it. Each process's recording backend counts calls of its compiled graphs, so
a silent eager fallback fails. This file is also the worker: ``python <this file> combos
OUT_DIR``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx

from tests.support.distributed import ATOL, BATCH, all_ok, global_batch, launch

CALLS = [0]


def recorder(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        CALLS[0] += 1
        return gm.forward(*args)

    return run


def _half(t: torch.Tensor, d: int) -> torch.Tensor:
    return t[d * BATCH : (d + 1) * BATCH]


def _optimizer_shard(x: torch.Tensor, y: torch.Tensor) -> None:
    """shard="optimizer", float64: loss, grads and the sharded SGD step equal the unsplit
    model on the global batch (two equal halves: its mean loss is theirs)."""
    from pipeline import Pipeline
    from tests.support.models import lm_loss, make_model

    ref = make_model()
    want_loss = lm_loss(ref(x), y)
    want_loss.backward()
    pipe = Pipeline(make_model(), stages=2, schedule="zb-h1", microbatches=4, loss_fn=lm_loss,
                    shard="optimizer", compile={"backend": recorder})
    ctx = pipe.distributed
    assert ctx is not None and ctx.layout.data_parallel == 2
    before = CALLS[0]
    d = ctx.layout.dp_rank
    loss = pipe.step(_half(x, d), _half(y, d))
    assert CALLS[0] > before and pipe.compile_stats is not None
    assert pipe.compile_stats.eager == {}, pipe.compile_stats
    torch.testing.assert_close(loss.double(), want_loss.detach(), atol=ATOL, rtol=0)
    assert pipe.optimizer_step(pipe.optimizer(torch.optim.SGD, lr=0.1))
    state = pipe.state_dict()
    if state is not None:
        for k, p in ref.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(state[k], p.detach() - 0.1 * p.grad, atol=ATOL,
                                       rtol=0, msg=f"shard=optimizer: stepped {k}")


def _mixed_precision(x: torch.Tensor, y: torch.Tensor) -> None:
    """bf16 autocast: the compiled pipeline equals the eager one (the casts are traced into
    the compiled graphs, nothing cast twice), loss and every averaged grad."""
    from pipeline import Pipeline
    from pipeline.checkpoint import gather_named
    from tests.support.models import lm_loss, make_model

    runs = []
    for option in (False, {"backend": recorder}):
        pipe = Pipeline(make_model().float(), stages=2, microbatches=4, loss_fn=lm_loss,
                        mixed_precision=torch.bfloat16, compile=option)
        ctx = pipe.distributed
        assert ctx is not None
        before = CALLS[0]
        loss = pipe.step(_half(x, ctx.layout.dp_rank), _half(y, ctx.layout.dp_rank))
        assert (CALLS[0] > before) == bool(option)
        runs.append((loss, gather_named({k: p.grad for k, p in pipe.named_parameters()}, ctx)))
    (eager_loss, eager), (loss, grads) = runs
    torch.testing.assert_close(loss, eager_loss, atol=1e-6, rtol=0)
    if grads is not None and eager is not None:
        for k, g in eager.items():
            torch.testing.assert_close(grads[k], g, atol=1e-6, rtol=0, msg=f"bf16: grad of {k}")


def _full_shard_runs_eager(x: torch.Tensor, y: torch.Tensor) -> None:
    """shard="full" (FSDP2): every stage runs eager, with a RuntimeWarning naming it and
    why; the step is still the unsplit model's."""
    from pipeline import Pipeline
    from tests.support.models import lm_loss, make_model

    want = lm_loss(make_model()(x), y).detach()
    pipe = Pipeline(make_model(), stages=2, microbatches=4, loss_fn=lm_loss, shard="full",
                    compile={"backend": recorder})
    ctx = pipe.distributed
    assert ctx is not None
    before = CALLS[0]
    with pytest.warns(RuntimeWarning, match=r"stage \d runs eager: shard='full'"):
        loss = pipe.step(_half(x, ctx.layout.dp_rank), _half(y, ctx.layout.dp_rank))
    assert CALLS[0] == before, "shard='full' ran compiled graphs"
    stats = pipe.compile_stats
    assert stats is not None and all("shard='full'" in r for r in stats.eager.values()), stats
    assert stats.eager, stats
    torch.testing.assert_close(loss.double(), want, atol=ATOL, rtol=0)


def worker_combos(out: Path) -> None:
    import torch.distributed as dist

    from tests.support.distributed import init_worker

    init_worker()
    x, y = global_batch(0, 2 * BATCH)
    _optimizer_shard(x, y)
    _mixed_precision(x, y)
    _full_shard_runs_eager(x, y)
    dist.destroy_process_group()
    print("worker combos: every check ran")


WORKERS = {"combos": worker_combos}


@pytest.mark.slow
def test_compiled_combinations_pp2_dp2(tmp_path: Path) -> None:
    ended = launch("combos", 4, tmp_path, timeout=120.0, deadline=500.0, script=__file__)
    all_ok(ended, "combos")


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
