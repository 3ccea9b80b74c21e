"""The checks `Pipeline(...)` makes on its arguments before anything is built (the executor is
chosen by pipeline.execution.choose)."""

from __future__ import annotations

import torch.distributed as dist


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
