"""`Pipeline(...)`'s arguments checked once into the frozen `PipelineSettings` record
(pipeline.planning.settings) the planner and the executor are built with (the executor itself
is chosen by pipeline.execution.choose)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeline.execution.compiled import compile_options
from pipeline.execution.local import resolve_devices
from pipeline.execution.precision import make_precision
from pipeline.execution.timeouts import resolve_compile_timeout, resolve_timeout
from pipeline.facade.running import check_grad_accumulation
from pipeline.planning.activation_policies import check_policies
from pipeline.planning.settings import PipelineSettings, check_shard
from pipeline.planning.shapes import check_dims
from scheduler import Schedule

TP_STYLES = ("colwise", "rowwise", "replicate")


def check_int(value: object, what: str, minimum: int, fix: str) -> int:
    """`value` as an int >= `minimum`; TypeError / ValueError naming it and the fix."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}; {fix}")
    return value


def _check_layout(stages: object, microbatches: object, virtual_stages: object,
                  memory_limit: object, data_parallel: object) -> None:
    """The numeric settings of the layout."""
    if stages != "auto":
        check_int(stages, "stages", 1, "give the number of pipeline ranks")
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


def _check_width(stages: object, tensor_parallel: object, tp_plan: object,
                 sequence_parallel: object) -> int | str:
    """The tensor-parallel settings; the tensor-parallel degree ("auto": chosen with the
    layout, pipeline.planning.layout)."""
    tp: int | str
    if tensor_parallel == "auto":
        if not dist.is_initialized():
            raise ValueError(
                'tensor_parallel="auto" chooses the tensor-parallel ranks for the world size '
                "under torchrun; launch with torchrun, or give tensor_parallel=N")
        tp = "auto"
    else:
        tp = check_int(tensor_parallel, "tensor_parallel", 1,
                       'give the processes each stage is sharded over (1: none), or "auto"')
    if isinstance(tp, int) and tp > 1 and not dist.is_initialized():
        raise ValueError(
            f"tensor_parallel={tp} shards each stage over {tp} processes: tensor parallelism "
            "needs torchrun (torch.distributed initialised); launch with torchrun (world = "
            "data_parallel x stages x tensor_parallel), or use tensor_parallel=1"
        )
    if tp_plan is not None:
        if not isinstance(tp_plan, Mapping) or not all(isinstance(k, str) for k in tp_plan):
            raise TypeError(f"tp_plan must map module path globs (str) to a style, got "
                            f"{tp_plan!r}")
        bad = {k: v for k, v in tp_plan.items() if isinstance(v, str) and v not in TP_STYLES}
        if bad:
            raise ValueError(f"tp_plan styles {bad} are not {TP_STYLES} (or a torch "
                             "ParallelStyle)")
        if tp == 1:
            raise ValueError("tp_plan shards modules over the tensor-parallel ranks, but "
                             "tensor_parallel=1: pass tensor_parallel=N, or drop tp_plan")
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel=True shards the regions between tensor-parallel "
                         "layers along the sequence, but tensor_parallel=1: pass "
                         "tensor_parallel=N, or drop sequence_parallel")
    return tp


def _check_sharing(devices: object, shard: object) -> str | None:
    """What only one process, or only torchrun, can do."""
    checked = check_shard(shard)
    if checked is not None and not dist.is_initialized():
        raise ValueError(
            f"shard={checked!r} shards state over data-parallel replicas, which needs the "
            "distributed executor: launch with torchrun (torch.distributed initialised), "
            "or drop shard"
        )
    if dist.is_initialized() and devices is not None:
        raise ValueError(
            f"devices={devices!r} cannot be used under torch.distributed: each process "
            "runs on one device (cuda:LOCAL_RANK with NCCL, else cpu); drop devices"
        )
    return checked


def check_settings(
    stages: int | str, *, schedule: str | os.PathLike[str] | Schedule,
    microbatches: int | str | None, balance: str | Sequence[int],
    devices: Sequence[str | torch.device] | None, virtual_stages: int | str | None,
    memory_limit: float | None, checkpoint_activations: object, data_parallel: int | None,
    timeout: float | None, leaf_modules: tuple[type, ...] | None, rebalance: bool,
    capture_method: str, mixed_precision: torch.dtype | None, dynamic_dims: Sequence[int],
    grad_accumulation: str, shard: str | None, reduce_dtype: torch.dtype | None,
    compile: bool | Mapping[str, Any],  # noqa: A002 - torch.compile's name
    compile_timeout: float | None, tensor_parallel: int | str = 1,
    tp_plan: Mapping[str, Any] | None = None, sequence_parallel: bool = False,
) -> PipelineSettings:
    """`Pipeline(...)`'s arguments checked (TypeError / ValueError naming the value and the
    fix) into the record the planner and the executor are built with."""
    _check_layout(stages, microbatches, virtual_stages, memory_limit, data_parallel)
    _check_width(stages, tensor_parallel, tp_plan, sequence_parallel)
    checked_shard = _check_sharing(devices, shard)
    make_precision(mixed_precision, reduce_dtype, checked_shard)  # the dtypes checked
    options = compile_options(compile)
    resolved = None  # one device per pipeline rank, in one process
    if isinstance(stages, int) and not dist.is_initialized():
        resolved = tuple(resolve_devices(devices, stages))
    return PipelineSettings(
        stages=stages, schedule=schedule, microbatches=microbatches,
        virtual_stages=virtual_stages,
        balance=balance if isinstance(balance, str) else tuple(balance),
        memory_limit=memory_limit,
        checkpoint_activations=check_policies(checkpoint_activations, memory_limit),
        data_parallel=data_parallel, leaf_modules=leaf_modules, rebalance=rebalance,
        capture_method=capture_method, mixed_precision=mixed_precision,
        reduce_dtype=reduce_dtype, dynamic_dims=check_dims(dynamic_dims),
        grad_accumulation=check_grad_accumulation(grad_accumulation), shard=checked_shard,
        compile=None if options is None else dict(compile) if isinstance(compile, Mapping)
        else {},
        tensor_parallel=tensor_parallel, tp_plan=tp_plan, sequence_parallel=sequence_parallel,
        devices=resolved, timeout=resolve_timeout(timeout),
        compile_timeout=resolve_compile_timeout(compile_timeout),
    )

