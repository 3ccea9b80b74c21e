"""A peer compiling is not a stuck peer (2 gloo processes, pp=2, ``timeout=3`` s): a compile
made 6 s slow on one rank, in setup (rank 0 profiles compiled units while rank 1 waits for its
plan), in the first step (rank 1 compiles its stage while rank 0 waits for its gradients) and
in a step of a new batch shape (rank 0 compiles it again), is waited for under the compile
allowance, and each step equals the eager pipeline's (float64, loss and every gradient). The
same 6 s outside any compile, before a step of known shapes, still fails after the 3 s
timeout, naming the wait. In one process the compile allowance bounds the wait for a
compiling stage too. This file is also the worker: ``python <this file> slow OUT_DIR``."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx

from tests.support.distributed import ATOL, BATCH, all_ok, dump, global_batch, launch

DELAY = 6.0  # seconds a slowed compile sleeps: twice the launch's timeout
SLOW = [False]  # this process's next compile sleeps DELAY (then the flag drops)


def backend(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """A compiler that runs the graph as it is, DELAY seconds late when SLOW is set."""
    if SLOW[0]:
        SLOW[0] = False
        time.sleep(DELAY)
    return gm.forward


def _steps(pipe: Any, batches: list[tuple[torch.Tensor, torch.Tensor]],
           slow: list[bool]) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Each batch's loss and this process's gradients; before batch i this process's next
    compile is slowed if slow[i], and must have happened within that step."""
    out = []
    for (x, y), s in zip(batches, slow, strict=True):
        SLOW[0] = s
        pipe.zero_grad()
        loss = pipe.step(x, y)
        assert not SLOW[0], "the slowed compile did not happen in this step"
        out.append((float(loss), {k: p.grad.clone() for k, p in pipe.named_parameters()}))
    return out


def worker_slow(out: Path) -> None:
    import torch.distributed as dist

    from pipeline import Pipeline
    from pipeline.execution.distributed import RankFailure
    from tests.support.distributed import init_worker
    from tests.support.models import lm_loss, make_model

    init_worker()
    rank = dist.get_rank()
    x, y = global_batch(0, BATCH)
    batches = [(x, y), (x[:6], y[:6])]  # the second: a new shape (partial batch)
    settings = dict(stages=2, microbatches=2, loss_fn=lm_loss)
    eager = _steps(Pipeline(make_model(), **settings), batches, [False, False])

    SLOW[0] = rank == 0  # setup: rank 0 profiles the compiled units for the balance
    pipe = Pipeline(make_model(), **settings, example_input=x, compile={"backend": backend},
                    compile_timeout=60)
    assert not SLOW[0], "rank 0 compiled nothing while planning"
    compiled = _steps(pipe, batches, [rank == 1, rank == 0])
    stats = pipe.compile_stats
    assert stats is not None and stats.graphs > 0 and not stats.eager, stats
    for i, ((loss, grads), (want_loss, want)) in enumerate(zip(compiled, eager, strict=True)):
        assert abs(loss - want_loss) <= ATOL, (i, loss, want_loss)
        assert grads.keys() == want.keys() and grads
        for k, g in want.items():
            torch.testing.assert_close(grads[k], g, atol=ATOL, rtol=0, msg=f"step {i}: {k}")

    # The same delay outside any compile (shapes known, nothing to compile): the timeout.
    if rank == 0:
        time.sleep(DELAY)
    with pytest.raises(RankFailure) as failed:
        pipe.step(x, y)
    print(f"failed as expected: {failed.value}")
    print("worker slow: every check ran")


WORKERS = {"slow": worker_slow}


@pytest.mark.slow
def test_compile_waits_under_the_allowance_not_the_timeout(tmp_path: Path) -> None:
    ended = launch("slow", 2, tmp_path, timeout=3.0, deadline=300.0, script=__file__)
    all_ok(ended, "slow")
    waited = ("rank 1 (pipeline rank 1 of replica 0) waiting for the batch-shape key from "
              "rank 0 (pipeline rank 0 of replica 0) failed (timeout 3 s; set "
              "Pipeline(timeout=...) or $HYBRIDPIPE_TIMEOUT)")
    assert waited in ended[1].output, dump(ended)
    assert "because rank 0 (pipeline rank 0 of replica 0) stopped responding" in ended[1].output
    assert "because rank 1" in ended[0].output or waited in ended[0].output, dump(ended)


@pytest.mark.slow
def test_one_process_waits_for_a_compile_up_to_the_allowance() -> None:
    """Local executor, timeout=0.5 s: rank 1 waits for rank 0's compile (slowed by DELAY)
    past its timeout, but no longer than compile_timeout=1.5 s; the error names both."""
    from pipeline import Pipeline
    from tests.support.models import lm_loss, make_model

    x, y = global_batch(0, BATCH)
    pipe = Pipeline(make_model(), stages=2, microbatches=2, loss_fn=lm_loss, balance="uniform",
                    compile={"backend": backend}, timeout=0.5, compile_timeout=1.5)
    SLOW[0] = True
    with pytest.raises(TimeoutError, match=r"pipeline rank 1 waited 1\.5 s for activations of "
                       r"stage 0 microbatch 0 .*\(or compile_timeout=\.\.\., if a stage compiled"):
        pipe.step(x, y)
    assert not SLOW[0]


def test_compile_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.execution.timeouts import (
        DEFAULT_COMPILE_TIMEOUT,
        ENV_COMPILE_TIMEOUT,
        resolve_compile_timeout,
    )

    monkeypatch.delenv(ENV_COMPILE_TIMEOUT, raising=False)
    assert resolve_compile_timeout(None) == DEFAULT_COMPILE_TIMEOUT == 1800.0
    assert resolve_compile_timeout(60) == 60.0
    monkeypatch.setenv(ENV_COMPILE_TIMEOUT, "600")
    assert resolve_compile_timeout(None) == 600.0
    assert resolve_compile_timeout(5) == 5.0  # the argument wins
    monkeypatch.setenv(ENV_COMPILE_TIMEOUT, "long")
    with pytest.raises(ValueError, match=r"\$HYBRIDPIPE_COMPILE_TIMEOUT='long' is not a number"):
        resolve_compile_timeout(None)
    with pytest.raises(ValueError, match="compile_timeout must be > 0 seconds"):
        resolve_compile_timeout(-1)


if __name__ == "__main__":
    WORKERS[sys.argv[1]](Path(sys.argv[2]))
