"""``Pipeline(model, stages="auto")``: choose (stages, data_parallel, schedule, microbatches,
virtual stages) for the world size torchrun gives this run, by the auto-planner's ranking
(pipeline.planning.autoplan.search: every divisor of the world as the pipeline depth, the
fastest predicted step under ``memory_limit`` bytes per device). So a job restarted with fewer
processes re-plans for them.

The example input is the global batch: each of the ``data_parallel`` replicas takes its share
(`replica_share`), so the global batch stays the same whatever the layout, and a replica runs
more microbatches when there are fewer replicas. Global rank 0 captures and profiles the model
and decides; the others follow through a setup sync point (bounded by the timeout; a failure
on rank 0 is named on every process)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from partitioner import capture, profile
from partitioner.capture import call_structure
from pipeline.execution.distributed.agreement import Agreement
from pipeline.planning.autoplan import AutoPlan, search
from pipeline.planning.microbatch import Batch, batch_size, split_microbatches
from scheduler import SCHEDULES, Schedule

AUTO = "auto"


@dataclass(frozen=True)
class AutoLayout:
    """The chosen layout (`plan.best`), the ranked candidates, and this process's replica's
    share of the example batch."""

    plan: AutoPlan
    example: Batch

    @property
    def settings(self) -> tuple[int, int, str | Schedule, int, int]:
        """(stages, data_parallel, schedule, microbatches, virtual_stages) to build with (the
        schedule itself when it was synthesised)."""
        best = self.plan.best
        schedule = best.built if best.built is not None else best.schedule
        return best.pp, best.dp, schedule, best.microbatches, best.virtual_stages


def replica_share(batch: Batch, data_parallel: int, dp_rank: int) -> Batch:
    """Replica `dp_rank`'s rows of a global `batch` (contiguous equal shares along dim 0), so
    the mean loss over replicas is the global batch's mean. ValueError if it does not divide."""
    size = batch_size(batch, "inputs")
    if size % data_parallel:
        raise ValueError(
            f"a global batch of {size} rows does not split into {data_parallel} equal replica "
            f"shares; use a global batch that is a multiple of {data_parallel}"
        )
    return split_microbatches(batch, data_parallel, "inputs")[dp_rank]


def _search_here(
    model: nn.Module, example: Batch, world_size: int, *, schedules: list[str] | None,
    virtual_stages: int | None, memory_limit: float | None,
    leaf_modules: tuple[type, ...] | None, capture_method: str,
) -> AutoPlan:
    """(Global rank 0) capture and profile the model on a microbatch of the global batch,
    then rank every layout for the world."""
    size = batch_size(example, "inputs")
    micro = split_microbatches(example, min(2 * world_size, size), "inputs")[0]
    args, kwargs = call_structure(micro)
    rows = micro if batch_size(micro, "inputs") > 1 else split_microbatches(example, 1)[0]
    captured = capture(model, *call_structure(rows), leaf_modules=leaf_modules,
                       method=capture_method)
    flat = tuple(tree_flatten((args, kwargs))[0])
    profile(captured, model, flat, device="cpu")
    return search(
        captured, world_size=world_size, batch_size=size, profiled_batch=batch_size(micro),
        memory_limit=memory_limit, schedules=schedules,
        virtual_stages=None if virtual_stages is None else [virtual_stages],
    )


def choose_layout(
    model: nn.Module, example_input: Batch | None, *, schedule: object, microbatches: object,
    virtual_stages: object, data_parallel: object, memory_limit: float | None,
    leaf_modules: tuple[type, ...] | None, capture_method: str, timeout: float,
) -> AutoLayout:
    """The layout for ``stages="auto"`` (see the module docstring); checks the settings that
    go with it first (ValueError naming the fix)."""
    if not dist.is_initialized():
        raise ValueError(
            'stages="auto" chooses (stages, data_parallel) for the world size under torchrun; '
            "in one process give stages=N"
        )
    if example_input is None:
        raise ValueError(
            'stages="auto" plans at construction: pass example_input= (the global batch, '
            "which the replicas share)"
        )
    if data_parallel is not None or microbatches not in (None, AUTO):
        raise ValueError(
            f'stages="auto" chooses data_parallel and microbatches; drop data_parallel='
            f"{data_parallel!r} and microbatches={microbatches!r}"
        )
    if isinstance(schedule, Schedule) or (
        isinstance(schedule, (str, os.PathLike)) and schedule not in (*SCHEDULES, AUTO)
    ):
        raise ValueError(
            f'stages="auto" needs a schedule name or "auto", not {schedule!r} (a custom '
            "schedule fixes the stage count)"
        )
    names = None if schedule == AUTO else [str(schedule)]
    fixed_v = virtual_stages if isinstance(virtual_stages, int) else None
    world, rank = dist.get_world_size(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    agreement = Agreement(store, rank, world, timeout)
    plan = None
    if rank == 0:
        with agreement.phase('the choice of stages="auto" (capture and profiling)'):
            plan = _search_here(
                model, example_input, world, schedules=names, virtual_stages=fixed_v,
                memory_limit=memory_limit, leaf_modules=leaf_modules,
                capture_method=capture_method,
            )
            plan.best  # noqa: B018 - nothing fits: the ValueError reaches every process
    chosen: Any = agreement.sync('the stages="auto" layout', plan)
    best = chosen.best
    dp_rank = rank // best.pp  # the (dp, pp) mesh is row-major: a replica is a row
    return AutoLayout(chosen, replica_share(example_input, best.dp, dp_rank))
