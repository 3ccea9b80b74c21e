"""Optimizers for each shard mode (the optimizer side of `shard`):
`build_optimizer` makes the optimizer a shard mode needs (``Pipeline.optimizer``: plain, or
torch's `ZeroRedundancyOptimizer` over the "dp" group for ZeRO-1; the one whose state this
process holds, what checkpoints save and load, is pipeline.execution.processes.local_optimizer),
`state_bytes`, and `OptimizerCheck` catches, at its first step, an optimizer that would be
silently wrong or silently unsharded."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from pipeline.execution.distributed.context import DistContext
from pipeline.execution.distributed.dtensors import local
from pipeline.execution.executor import check_optimizer_class
from pipeline.execution.processes import local_optimizer


def build_optimizer(
    shard: str | None,
    params: Iterable[nn.Parameter],
    optimizer_class: type[torch.optim.Optimizer],
    ctx: DistContext | None,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """The optimizer for `shard`: ``optimizer_class(params, **kwargs)`` (None, "full": the
    state follows the DTensor parameters' sharding), or a `ZeroRedundancyOptimizer` of it over
    the "dp" group ("optimizer")."""
    check_optimizer_class(optimizer_class)
    params = list(params)
    if shard != "optimizer" or ctx is None:
        return optimizer_class(params, **kwargs)
    with ctx.guard("building the sharded optimizer"):
        return PartsZero(
            params, optimizer_class=optimizer_class, process_group=ctx.dp_group, **kwargs
        )


class PartsZero(ZeroRedundancyOptimizer):
    """torch's ZeRO-1 whose owners broadcast each parameter's local part: a tensor-parallel
    DTensor parameter's replicas (the "dp" group, at the same tp coordinate) hold the same
    part of it, and c10d's broadcast takes plain tensors only. Plain parameters are sent as
    torch sends them (their part is the whole tensor), one message per parameter (with
    ``parameters_as_bucket_view=True`` too)."""

    def _broadcast_params_from_rank(self, rank: int) -> list[Any]:
        source = dist.get_global_rank(self.process_group, rank)
        return [
            dist.broadcast(local(p.detach()), src=source, group=self.process_group,
                           async_op=True)
            for group in self._partition_parameters()[rank]  # type: ignore[attr-defined]
            for p in group["params"]
        ]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this process holds (local shards of DTensors)."""
    return sum(
        local(v).numel() * v.element_size()
        for state in local_optimizer(optimizer).state.values()
        for v in state.values() if isinstance(v, Tensor)
    )


class Sharded(Protocol):
    """What `OptimizerCheck` reads of the `Sharding`: the held stages, and whether a parameter
    is one that shard="full" replaced by a sharded one."""

    def held(self) -> Mapping[int, nn.Module]: ...

    def replaced(self, p: Tensor) -> bool: ...


class OptimizerCheck:
    """A step pre-hook (every optimizer's, as torch registers it) that, for the parameters of
    one executor's stages (its `Sharding`), stops an optimizer that would be silently wrong
    and warns of one that would be silently unsharded, at its first step:

    - it holds parameters that ``shard="full"`` replaced by sharded ones (built before the plan
      was made): its steps would change nothing the pipeline runs: ValueError;
    - under ``shard="optimizer"``, a plain optimizer over the pipeline's parameters: correct
      (the gradients are all-reduced) but every replica keeps the whole state: UserWarning.

    The fix named in both: ``pipe.optimizer(optimizer_class, **kwargs)`` once the plan is made.
    The `Sharding` is held weakly; the hook is removed with it."""

    def __init__(self, shard: str, sharding: Sharded) -> None:
        self.shard = shard
        self.sharding = weakref.ref(sharding)  # the hook lives in torch's global registry
        self.made: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        handle = register_optimizer_step_pre_hook(self)
        weakref.finalize(sharding, handle.remove)

    def allow(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer` was made by `build_optimizer` for this executor's stages."""
        self.made.add(optimizer)
        self.made.add(local_optimizer(optimizer))

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        sharding = self.sharding()
        if sharding is None or optimizer in self.made or optimizer in self.seen:
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        kind = type(local_optimizer(optimizer)).__name__
        fix = (f"build it with pipe.optimizer({kind}, ...) once the plan is "
               "made (pass example_input=... to Pipeline, or call it after the first step)")
        if any(sharding.replaced(p) for p in params):
            raise ValueError(
                f"this {type(optimizer).__name__} holds parameters that shard='full' replaced by "
                "sharded DTensors, so its steps would not change the model the pipeline runs; "
                + fix
            )
        own = {id(p) for m in sharding.held().values() for p in m.parameters()}
        if self.shard == "optimizer" and any(id(p) in own for p in params):
            warnings.warn(
                f"shard='optimizer', but this {type(optimizer).__name__} keeps the whole "
                "optimizer state of this process's parameters on every replica (correct, not "
                "sharded); " + fix, UserWarning, stacklevel=3,
            )
        self.seen.add(optimizer)
