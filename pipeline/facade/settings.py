"""The checks `Pipeline(...)` makes on its arguments before anything is built, and the choice
of executor (local threads, or torch.distributed inside torchrun)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from pipeline.execution.distributed import DistributedExecutor
from pipeline.execution.distributed.agreement import Agreement
from pipeline.execution.distributed.shard import check_shard
from pipeline.execution.executor import Executor
from pipeline.execution.local import LocalExecutor, resolve_devices


def check_int(value: object, what: str, minimum: int, fix: str) -> int:
    """`value` as an int >= `minimum`; TypeError / ValueError naming it and the fix."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}; {fix}")
    return value


def check_settings(
    stages: object,
    microbatches: object,
    virtual_stages: object,
    memory_limit: object,
    data_parallel: object,
) -> int:
    """Check the numeric settings of `Pipeline(...)`; returns the stage count."""
    checked = check_int(stages, "stages", 1, "give the number of pipeline ranks")
    if microbatches not in (None, "auto"):
        check_int(microbatches, "microbatches", 1, "split each batch into at least 1")
    if virtual_stages not in (None, "auto"):
        check_int(virtual_stages, "virtual_stages", 1, "give model chunks per rank")
    if memory_limit is not None and (
        isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float))
        or memory_limit <= 0
    ):
        raise ValueError(f"memory_limit must be a number of bytes > 0, got {memory_limit!r}")
    if data_parallel not in (None, 1) and not dist.is_initialized():
        raise ValueError(
            f"data_parallel={data_parallel} needs the distributed executor: launch with "
            "torchrun (torch.distributed initialised), or drop data_parallel"
        )
    return checked


def executor_for(
    stages: int,
    devices: Sequence[str | torch.device] | None,
    data_parallel: int | None,
    timeout: float,
    shard: object = None,
    agreement: Agreement | None = None,
    tensor_parallel: int = 1,
    tp_plan: object = None,
) -> Executor:
    """The distributed executor inside torchrun (torch.distributed initialised), else the
    local one (without `shard`: sharding needs data-parallel replicas; without
    `tensor_parallel`: one process per tp rank). `agreement`: the distributed Pipeline's
    setup agreement when its layout was chosen with it already."""
    shard = check_shard(shard)
    tensor_parallel = check_int(tensor_parallel, "tensor_parallel", 1,
                                "give the number of processes sharing each stage's width")
    if tp_plan is not None and not isinstance(tp_plan, Mapping):
        raise TypeError(
            f"tp_plan must be a dict of module path glob -> 'colwise' | 'rowwise' | "
            f"'replicate', got {tp_plan!r} ({type(tp_plan).__name__})")
    if tensor_parallel > 1 and not dist.is_initialized():
        raise ValueError(
            f"tensor_parallel={tensor_parallel} runs each stage's width on {tensor_parallel} "
            "processes, which needs the distributed executor: launch with torchrun "
            "(world = data_parallel x stages x tensor_parallel), or drop tensor_parallel"
        )
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
                                   agreement=agreement, tensor_parallel=tensor_parallel,
                                   tp_plan=tp_plan)
    return LocalExecutor(resolve_devices(devices, stages), timeout=timeout)
