"""A peer compiling is not a stuck peer (2 gloo processes, pp=2, GPipe, ``timeout=3`` s): a
compile made 6 s slow on one rank is waited for under the compile allowance in setup (rank 0
profiles compiled units while rank 1 waits for its plan), in the first step (rank 1 compiles
its stage while rank 0 waits for its gradients) and in a step of a new, uneven batch (7 rows:
rank 0 compiles the 3-row last microbatch's backward after rank 1 has ended the step, so
rank 1's next step must not wait under the timeout until it is done: the compiling step's
closing barrier); each step equals the eager pipeline's (float64, loss and every gradient).
The same 6 s outside any compile, before a step of known shapes, still fails after the 3 s
timeout, naming the wait. In one process the compile allowance bounds the wait for a
compiling stage too. This file is also the worker:
``python <this file> slow OUT_DIR``."""

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
SLOW = [""]  # this process's next compile ("any") or backward compile ("backward") sleeps


def backend(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """A compiler that runs the graph as it is, DELAY seconds late as SLOW says (a backward
    graph takes the tangents)."""
    backward = any("tangents" in n.name for n in gm.graph.nodes if n.op == "placeholder")
    if SLOW[0] == "any" or (SLOW[0] == "backward" and backward):
        SLOW[0] = ""
        time.sleep(DELAY)
    return gm.forward


def _steps(pipe: Any, batches: list[tuple[torch.Tensor, torch.Tensor]],
           slow: list[str]) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Each batch's loss and this process's gradients; before batch i this process's next
    compile is slowed as slow[i] says (see SLOW), and must have happened within that step."""
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
    batches = [(x, y), (x[:7], y[:7]), (x, y)]  # the second: a partial batch, uneven
    settings = dict(stages=2, schedule="gpipe", microbatches=2, loss_fn=lm_loss)
    eager = _steps(Pipeline(make_model(), **settings), batches, ["", "", ""])

    SLOW[0] = "any" if rank == 0 else ""  # setup: rank 0 profiles the compiled units
    pipe = Pipeline(make_model(), **settings, example_input=x, compile={"backend": backend},
                    compile_timeout=60)
    assert not SLOW[0], "rank 0 compiled nothing while planning"
    compiled = _steps(pipe, batches, ["any" if rank == 1 else "", "backward" if rank == 0 else "",
                                      ""])
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
    """Local executor, timeout=0.5 s: rank 1 waits for rank 0's compile (tracing, then the
    compiler slowed by DELAY) past its timeout, but no longer than compile_timeout=1.5 s; the
    error names both."""
    from pipeline import Pipeline
    from tests.support.models import lm_loss, make_model

    x, y = global_batch(0, BATCH)
    pipe = Pipeline(make_model(), stages=2, microbatches=2, loss_fn=lm_loss, balance="uniform",
                    compile={"backend": backend}, timeout=0.5, compile_timeout=1.5)
    SLOW[0] = "any"
    with pytest.raises(TimeoutError, match=r"pipeline rank 1 waited 1\.5 s for activations of "
                       r"stage 0 microbatch 0 .*\(or compile_timeout=\.\.\., if a stage compiled"):
        pipe.step(x, y)
    SLOW[0] = ""  # (waited past the timeout only because a stage was compiling: "1.5 s")


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
