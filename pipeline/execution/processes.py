"""`Processes`: the job's processes as the code above the executor sees them (checkpoints,
elastic training, metrics, data sharding): where this process sits in the (data_parallel,
stages) layout and the few collective steps that code takes (agree on the leader's value,
gather values to it, meet at a barrier, learn whether any process failed), each bounded and
named. Here one process runs every pipeline rank and each step is trivial; under
torch.distributed the executor's `DistContext` (pipeline.execution.distributed.context) takes
them over the job's process groups. With the helpers for the state a process holds of a
sharded optimizer or tensor (ZeRO-1's inner optimizer, a DTensor's shard), which mean the same
in one process."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, distribute_tensor


class Processes:
    """This process among the job's: `stages` pipeline ranks per replica, `data_parallel`
    replicas, this process's replica (`dp_rank`), pipeline rank (`pp_rank`, the lowest it
    runs) and tensor-parallel rank (`tp_rank`), its global `rank` of `world_size` processes,
    its `device`. Here: one process."""

    def __init__(self, stages: int, device: torch.device) -> None:
        self._stages = stages
        self.device = device

    @property
    def stages(self) -> int:
        return self._stages

    @property
    def data_parallel(self) -> int:
        return 1

    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def pp_rank(self) -> int:
        return 0

    @property
    def tp_rank(self) -> int:
        return 0

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def guard(self, what: str) -> AbstractContextManager[None]:
        """The context collective work `what` runs in (turning a peer's failure into an error
        naming it)."""
        return nullcontext()

    def agree(self, value: Any) -> Any:
        """Global rank 0's `value` on every process."""
        return value

    def barrier(self, what: str) -> None:
        """Return once every process reached this point (`what` names it in errors)."""

    def gather(self, part: dict[str, Any], *, replicas: bool = False
               ) -> list[dict[str, Any]] | None:
        """Every pipeline rank's `part` (replica 0's; every process's with `replicas`, for
        state the replicas hold different shares of) on global rank 0, None elsewhere."""
        return [part]

    def gather_all(self, value: Any) -> list[Any] | None:
        """Every process's `value` on global rank 0, in rank order; None elsewhere."""
        return [value]

    def minimum(self, value: Tensor) -> Tensor:
        """The elementwise minimum of `value` over every process."""
        return value

    def side_channel(self, timeout: float) -> Callable[[bool, float], bool]:
        """For work that ends in the background (an asynchronous checkpoint): a function
        telling, every process calling it, whether any process passed True, bounded by its
        seconds. Make it on every process at the same point."""
        return lambda flag, seconds: flag


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state this process holds: ZeRO's inner one over the parameters
    this replica owns; `optimizer` itself otherwise."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        inner: torch.optim.Optimizer = optimizer.optim
        return inner
    return optimizer


def hyperparameters_loaded(optimizer: torch.optim.Optimizer) -> None:
    """After loading into ZeRO's inner optimizer: copy its hyper-parameters to the outer
    param groups (ZeRO copies outer to inner at each step, which would undo the load)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        for outer, inner in zip(optimizer.param_groups, optimizer.optim.param_groups,
                                strict=True):
            outer.update({k: v for k, v in inner.items() if k != "params"})


def laid_out_as(target: Tensor, value: Tensor) -> Tensor:
    """`value` (a whole tensor) as `target` is laid out: for a DTensor target, this process's
    shard of it (cut locally: every process holds the whole value); otherwise `value`."""
    if isinstance(target, DTensor) and not isinstance(value, DTensor):
        device = target.device_mesh.device_type if target.is_meta else target.device
        return distribute_tensor(value.to(device), target.device_mesh, target.placements,
                                 src_data_rank=None)
    return value
