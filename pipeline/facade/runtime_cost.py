"""The pipeline runtime's own CPU cost per action, microbenchmarked for the local CPU target:
two gloo processes on this host run a near-zero-compute `Pipeline` (a chain of 1 x 1 linear
layers, pp=2, 1F1B) with 2 and with 8 microbatches; each rank's main-thread CPU time per step
against its action count (one F and one B per microbatch) gives the cost of one action (the
slope: the interpreter's Python around each F/B, its send or receive through gloo) and of one
step (the intercept: splitting the batch, the loss, the gradient hand-over). Nothing of the
model being planned is run; the result is cached beside the other local constants."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.planning.hardware.local import cached

MICROBATCHES = (2, 8)
STEPS = 12
UNITS = 4


def _cpu_per_step(microbatches: int) -> float:
    import torch.distributed as dist

    from pipeline.api import Pipeline

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(UNITS)])
    pipe = Pipeline(model, 2, schedule="1f1b", microbatches=microbatches,
                    loss_fn=lambda out, y: (out - y).pow(2).mean())
    x, y = torch.randn(microbatches, 1), torch.randn(microbatches, 1)
    times = []
    for step in range(STEPS + 2):
        dist.barrier()
        start = time.thread_time()
        pipe.step(x, y)
        if step >= 2:
            times.append(time.thread_time() - start)
    return statistics.median(times)


def _worker(rank: int, path: str, result: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    cpu = [_cpu_per_step(m) for m in MICROBATCHES]
    both: list[Any] = [None, None]
    dist.all_gather_object(both, cpu)
    if rank == 0:
        Path(result).write_text(json.dumps(both))
    dist.destroy_process_group()


def measure() -> dict[str, float]:
    """Per action and per step CPU seconds of the runtime (the mean over the two ranks)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "runtime.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), result), nprocs=2, join=True)
        per_rank = json.loads(Path(result).read_text())
    small, large = MICROBATCHES
    slopes = [(cpu[1] - cpu[0]) / (2 * (large - small)) for cpu in per_rank]
    action = statistics.mean(slopes)
    step = statistics.mean(cpu[0] - 2 * small * action for cpu in per_rank)
    return {"action": max(0.0, action), "step": max(0.0, step),
            "per_rank_cpu": per_rank, "microbatches": list(MICROBATCHES)}


def runtime_cost(refresh: bool = False) -> dict[str, float]:
    """The runtime's cost per action and per step, from the cache unless `refresh`."""
    figures: dict[str, float] = cached("runtime", measure, refresh)
    return figures
