"""Which executor runs a Pipeline: the distributed one inside torchrun (torch.distributed
initialised), else the local one (`executor_for`); and, for stages="auto", the job's processes
met before the layout is known (`Job`: how they plan the layout together, handed on to the
executor)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from pipeline.execution.distributed import DistributedExecutor
from pipeline.execution.distributed.agreement import Agreement
from pipeline.execution.distributed.context import job_agreement, process_device
from pipeline.execution.executor import Executor
from pipeline.execution.local import LocalExecutor, resolve_devices
from pipeline.planning.decision import Coordination
from pipeline.planning.settings import PipelineSettings


@dataclass(frozen=True)
class Job:
    """A torchrun job's processes met before its layout is chosen: `coordination` (global
    rank 0 leads; planning phases and sync points over the job's setup agreement), this
    process's `rank` of `world_size`; the executor built next takes over the agreement."""

    coordination: Coordination
    rank: int
    world_size: int
    agreement: Agreement


def job_before_layout(timeout: float) -> Job:
    """The job's processes met through a new setup agreement (torch.distributed initialised
    from the torchrun environment if it is not), planning on this process's device."""
    agreement = job_agreement(timeout)
    how = Coordination(leads=agreement.rank == 0, agree=agreement.sync, device=process_device(),
                       keeps_whole_model=False, phase=agreement.phase)
    return Job(how, agreement.rank, agreement.world_size, agreement)


def executor_for(settings: PipelineSettings, job: Job | None = None) -> Executor:
    """The distributed executor inside torchrun (torch.distributed initialised), else the
    local one, built with `settings`. `job`: the distributed Pipeline's processes when its
    layout was chosen with them already."""
    if dist.is_initialized():
        return DistributedExecutor(settings, agreement=None if job is None else job.agreement)
    return LocalExecutor(settings.devices or resolve_devices(None, settings.ranks), settings)
