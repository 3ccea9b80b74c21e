"""Which executor runs a Pipeline: the distributed one inside torchrun (torch.distributed
initialised), else the local one (`executor_for`); and, for stages="auto", the job's processes
met before the layout is known (`Job`: how they plan the layout together, handed on to the
executor)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.execution.distributed import DistributedExecutor
from pipeline.execution.distributed.agreement import Agreement
from pipeline.execution.distributed.context import job_agreement, process_device
from pipeline.execution.distributed.shard import check_shard
from pipeline.execution.executor import Executor
from pipeline.execution.local import LocalExecutor, resolve_devices
from pipeline.planning.decision import Coordination


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


def executor_for(
    stages: int,
    devices: Sequence[str | torch.device] | None,
    data_parallel: int | None,
    timeout: float,
    shard: object = None,
    job: Job | None = None,
) -> Executor:
    """The distributed executor inside torchrun (torch.distributed initialised), else the
    local one (without `shard`: sharding needs data-parallel replicas). `job`: the
    distributed Pipeline's processes when its layout was chosen with them already."""
    shard = check_shard(shard)
    if shard is not None and not dist.is_initialized():
        raise ValueError(
            f"shard={shard!r} shards state over data-parallel replicas, which needs the "
            "distributed executor: launch with torchrun (torch.distributed initialised), "
            "or drop shard"
        )
    if dist.is_initialized():
        if devices is not None:
            raise ValueError(
                f"devices={devices!r} cannot be used under torch.distributed: each process "
                "runs on one device (cuda:LOCAL_RANK with NCCL, else cpu); drop devices"
            )
        return DistributedExecutor(stages, data_parallel, timeout=timeout, shard=shard,
                                   agreement=None if job is None else job.agreement)
    return LocalExecutor(resolve_devices(devices, stages), timeout=timeout)
