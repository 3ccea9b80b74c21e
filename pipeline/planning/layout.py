"""``Pipeline(model, stages="auto")`` (or ``tensor_parallel="auto"``): the first step of
planning chooses (tensor_parallel, stages, data_parallel, schedule, microbatches, virtual
stages) for the world size torchrun gives this run, by the auto-planner's ranking
(pipeline.planning.autoplan.search: every divisor of the world as the pipeline depth, the
fastest predicted step under ``memory_limit`` bytes per device). So a job restarted with fewer
processes re-plans for them.

The tensor-parallel degrees tried: the given ``tensor_parallel``, or with "auto" every divisor
of the world that divides the node's processes (``LOCAL_WORLD_SIZE``: a tp group stays inside
a node) and leaves a whole number of pipeline ranks, each priced at its shard shapes with its
collectives (pipeline.planning.tp_costs) fitted on this job's own process group: every
process times the collectives of its tp group of each size first
(pipeline.planning.hardware.group_collectives.measure_world). A degree whose plan splits
nothing is noted and not tried.

The example input is the global batch: each of the ``data_parallel`` replicas takes its share
(`replica_share`), so the global batch stays the same whatever the layout, and a replica runs
more microbatches when there are fewer replicas. Global rank 0 captures and profiles the model
with the planner (`Planner.survey`, on the device the executor will run on) and decides; the
others follow through the Pipeline's setup agreement (a `Coordination`: bounded by the
timeout, a failure on rank 0 named on every process). The planner later reuses that capture
and profile when its first microbatch has the same shapes."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from partitioner import Captured
from partitioner.capture import call_structure
from pipeline.planning.autoplan import AutoPlan, search
from pipeline.planning.custom_schedule import AUTO
from pipeline.planning.decision import Coordination, Surveyed
from pipeline.planning.hardware.group_collectives import GroupCollectives, measure_world
from pipeline.planning.microbatch import Batch, Microbatches, batch_size
from pipeline.planning.planner import Planner, PlannerHooks
from pipeline.planning.settings import PipelineSettings
from pipeline.planning.tp_costs import Width, whole, width
from scheduler import SCHEDULES, Schedule


@dataclass(frozen=True)
class LayoutChoice:
    """The layout chosen for the world: the settings to build the Pipeline with (the schedule
    itself when it was synthesised, else its name), the ranked candidates, this process's
    replica's share of the example batch, and the surveyed capture (global rank 0's; None
    elsewhere)."""

    stages: int
    data_parallel: int
    schedule: str | Schedule
    microbatches: int
    virtual_stages: int
    ranking: AutoPlan
    example: Batch
    surveyed: Surveyed | None
    tensor_parallel: int = 1

    @classmethod
    def of(cls, ranking: AutoPlan, global_batch: Batch, rank: int,
           surveyed: Surveyed | None = None) -> LayoutChoice:
        """The ranking's best layout, for global rank `rank` of the job."""
        best = ranking.best
        dp_rank = rank // (best.pp * best.tp)  # the (dp, pp, tp) mesh is row-major
        return cls(
            stages=best.pp, data_parallel=best.dp,
            schedule=best.built if best.built is not None else best.schedule,
            microbatches=best.microbatches, virtual_stages=best.virtual_stages,
            ranking=ranking, example=replica_share(global_batch, best.dp, dp_rank),
            surveyed=surveyed, tensor_parallel=best.tp,
        )


def replica_share(batch: Batch, data_parallel: int, dp_rank: int) -> Batch:
    """Replica `dp_rank`'s rows of a global `batch` (contiguous equal shares along dim 0), so
    the mean loss over replicas is the global batch's mean. ValueError if it does not divide."""
    size = batch_size(batch, "inputs")
    if size % data_parallel:
        raise ValueError(
            f"a global batch of {size} rows does not split into {data_parallel} equal replica "
            f"shares; use a global batch that is a multiple of {data_parallel}"
        )
    return Microbatches.split(batch, data_parallel, "inputs").parts[dp_rank]


def check_layout_settings(
    example_input: Batch | None, *, schedule: object, microbatches: object,
    data_parallel: object, what: str = "stages",
) -> None:
    """The settings that go with ``stages="auto"`` (or ``tensor_parallel="auto"``, named
    `what`): ValueError naming the fix."""
    if not dist.is_initialized():
        raise ValueError(
            f'{what}="auto" chooses (stages, data_parallel) for the world size under torchrun; '
            "in one process give stages=N"
        )
    if example_input is None:
        raise ValueError(
            f'{what}="auto" plans at construction: pass example_input= (the global batch, '
            "which the replicas share)"
        )
    if data_parallel is not None or microbatches not in (None, AUTO):
        raise ValueError(
            f'{what}="auto" chooses data_parallel and microbatches; drop data_parallel='
            f"{data_parallel!r} and microbatches={microbatches!r}"
        )
    if isinstance(schedule, Schedule) or (
        isinstance(schedule, (str, os.PathLike)) and schedule not in (*SCHEDULES, AUTO)
    ):
        raise ValueError(
            f'{what}="auto" needs a schedule name or "auto", not {schedule!r} (a custom '
            "schedule fixes the stage count)"
        )


def tp_degrees(settings: PipelineSettings, world_size: int, node_size: int) -> list[int]:
    """The tensor-parallel degrees to try: the given one, or with "auto" every divisor of the
    world inside a node (dividing `node_size`) that leaves whole pipeline ranks for the given
    `stages`."""
    if isinstance(settings.tensor_parallel, int):
        return [settings.tensor_parallel]
    stages = settings.stages if isinstance(settings.stages, int) else 1
    return [d for d in range(1, world_size + 1)
            if world_size % (d * stages) == 0 and node_size % d == 0]


def _widths(captured: Captured, degrees: Sequence[int],
            collectives: GroupCollectives | None, settings: PipelineSettings,
            notes: list[str]) -> list[Width]:
    """Each degree's costs; a degree > 1 whose plan splits nothing is noted and left out."""
    out = []
    for d in degrees:
        if d == 1:
            out.append(whole(captured))
            continue
        if collectives is None:
            raise RuntimeError(f"tp={d} is priced with the collectives measured on its groups")
        priced = width(captured, d, collectives, sequence_parallel=settings.sequence_parallel,
                       rules=settings.tp_plan)
        if priced.plan is not None and not priced.plan.sharded:
            notes.append(f"tp={d}: its plan splits no parameter of this model; not tried")
            continue
        out.append(priced)
    return out


def choose_layout(
    model: nn.Module, example_input: Batch, how: Coordination, settings: PipelineSettings, *,
    world_size: int, rank: int, hooks: PlannerHooks | None = None,
) -> LayoutChoice:
    """The layout for ``stages="auto"`` or ``tensor_parallel="auto"`` (see the module
    docstring), the settings checked by `check_layout_settings` first. `hooks`: the
    planner's, so the units are profiled as they will run (compiled, under ``compile=``).
    Every process calls it (the collectives of the tp groups are timed on all of them)."""
    virtual_stages = settings.virtual_stages
    fixed_v = virtual_stages if isinstance(virtual_stages, int) else None
    schedule = str(settings.schedule)
    node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    degrees = tp_degrees(settings, world_size, node)
    if not degrees:
        raise ValueError(
            f"no tensor-parallel degree fits: stages={settings.stages} on a world of "
            f"{world_size} with {node} processes per node; give stages that divide the world")
    wide = [d for d in degrees if d > 1]
    collectives = measure_world(wide) if wide else None
    ranking = surveyed = None
    if how.leads:
        with how.phase('the choice of the layout (capture and profiling)'):
            surveying = dataclasses.replace(
                settings, stages=world_size, schedule=schedule, microbatches=None,
                virtual_stages=fixed_v, balance="profile", tensor_parallel=1,
                tp_plan=None, sequence_parallel=False,
            )
            planner = Planner(model, surveying, hooks=hooks)
            leaves, call_spec = tree_flatten(call_structure(example_input))
            surveyed = planner.survey(tuple(leaves), call_spec, how)
            notes: list[str] = []
            widths = _widths(surveyed.captured, degrees, collectives, settings, notes)
            ranking = search(
                surveyed.captured, world_size=world_size,
                batch_size=batch_size(example_input, "inputs"),
                profiled_batch=batch_size(surveyed.example, "inputs"),
                memory_limit=settings.memory_limit,
                pp=None if settings.stages == AUTO else [int(settings.stages)],
                schedules=None if schedule == AUTO else [schedule],
                virtual_stages=None if fixed_v is None else [fixed_v],
                widths=widths,
            )
            ranking.notes.extend(notes)
            ranking.best  # noqa: B018 - nothing fits: the ValueError reaches every process
    chosen: AutoPlan = how.agree('the "auto" layout', ranking)
    return LayoutChoice.of(chosen, example_input, rank, surveyed)
