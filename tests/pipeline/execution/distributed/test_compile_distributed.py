"""Compiled stages under torchrun (2 gloo processes, pp=2): a ZB-H1 step of the tiny
GPT with ``compile=`` equal the unsplit model (float64, 1e-10), and each process's recording
backend counted calls of its compiled graphs (a silent eager fallback fails). This file is also
the worker: ``python <this file> compile OUT_DIR``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx

from tests.support.distributed import ATOL, all_ok, global_batch, launch

CALLS = [0]


def recorder(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        CALLS[0] += 1
        return gm.forward(*args)

    return run


def worker_compile(out: Path) -> None:
    import torch.distributed as dist

    from pipeline import Pipeline
    from pipeline.checkpoint import gather_named
    from tests.support.distributed import init_worker
    from tests.support.models import lm_loss, make_model

    init_worker()
    x, y = global_batch(0, 8)
    ref = make_model()
    lm_loss(ref(x), y).backward()
    want = {k: p.grad for k, p in ref.named_parameters()}
    for schedule in ("zb-h1",):
        pipe = Pipeline(make_model(), stages=2, schedule=schedule, microbatches=4,
                        loss_fn=lm_loss, compile={"backend": recorder})
        before = CALLS[0]
        loss = pipe.step(x, y)
        torch.testing.assert_close(loss.double(), lm_loss(ref(x), y).detach(), atol=ATOL,
                                   rtol=0, msg=f"{schedule}: loss")
        assert CALLS[0] > before, f"{schedule}: no compiled graph ran"
        stats = pipe.compile_stats
        assert stats is not None and stats.eager == {}, stats
        ctx = pipe.distributed
        assert ctx is not None
        grads = gather_named({k: p.grad for k, p in pipe.named_parameters()}, ctx)
        if grads is not None:
            assert sorted(grads) == sorted(want), schedule
            for k, g in grads.items():
                torch.testing.assert_close(g, want[k], atol=ATOL, rtol=0,
                                           msg=f"{schedule}: grad of {k}")
    dist.destroy_process_group()
    print("worker compile: every check ran")


WORKERS = {"compile": worker_compile}


@pytest.mark.slow
def test_compiled_stages_under_torchrun(tmp_path: Path) -> None:
    ended = launch("compile", 2, tmp_path, timeout=120.0, deadline=300.0, script=__file__)
    all_ok(ended, "compile")


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
