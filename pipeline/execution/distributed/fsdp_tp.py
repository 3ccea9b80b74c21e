"""FSDP2 (``shard="full"``) over parameters that are tensor-parallel DTensors already, the 2-D
(dp, tp) mesh: which dim ``fully_shard`` cuts each one along over the replicas (`fsdp_dim`),
and the parameters it cannot cut, kept whole on every replica but laid out on the same (dp,
tp) mesh as the sharded ones (`WholeOnReplicas`), so an optimizer step or a gradient norm over
all of them runs on one mesh.

FSDP2 cuts a parameter's tp part into contiguous pieces along its shard dim and describes the
result as a DTensor on the (dp, tp) mesh. When tensor parallelism splits that dim in strided
chunks (a fused q/k/v projection split per head, ``_StridedShard``), a contiguous piece of
the part (q's heads and some of k's) has no DTensor layout: its ``full_tensor()``, state dicts
and checkpoints would be wrong. Such a parameter is cut along another dim where one divides
evenly, else (a fused projection's bias) kept whole."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from pipeline.execution.distributed.context import DistContext
from pipeline.execution.distributed.dtensors import local
from pipeline.execution.grads import parameter_slots


def _strided_dims(p: Tensor) -> set[int]:
    """The dims a tensor-parallel placement of `p` splits in strided chunks."""
    if not isinstance(p, DTensor):
        return set()
    return {q.dim for q in p.placements if isinstance(q, _StridedShard)}


def fsdp_dim(p: Tensor, replicas: int) -> int | None:
    """The dim ``fully_shard`` shards parameter `p` (plain, or a tensor-parallel DTensor)
    along over `replicas` processes: 0, as torch does, unless tensor parallelism splits dim 0
    in strided chunks; then the first dim it does not stride whose part the replicas divide
    evenly (torch shards dims past 0 evenly only); None when there is none: `p` stays whole
    on the replicas (`WholeOnReplicas`)."""
    strided = _strided_dims(p)
    if 0 not in strided:
        return 0
    part = local(p)
    return next((d for d in range(1, part.dim())
                 if d not in strided and part.shape[d] % replicas == 0), None)


def fsdp_placement(replicas: int) -> Callable[[nn.Parameter], Shard]:
    """``fully_shard``'s ``shard_placement_fn`` for `replicas` processes (see `fsdp_dim`;
    the parameters it keeps whole are ``ignored_params``, never passed to it)."""

    def placement(p: nn.Parameter) -> Shard:
        return Shard(fsdp_dim(p, replicas) or 0)

    return placement


class WholeOnReplicas:
    """Tensor-parallel parameters FSDP2 leaves out (`fsdp_dim` None), each kept whole on every
    replica. Between steps the stages hold, for each, a Parameter on the (dp, tp) mesh
    (Replicate over the replicas, the tp placement over tp) sharing its storage, as the
    sharded ones are; a step runs on the tp parameter itself (`enter`). `reduce` averages its
    gradient over the replicas into the (dp, tp) one's `.grad` (added, as FSDP2 adds into its
    shards), and `leave` drops the step's gradient and puts the (dp, tp) ones back."""

    def __init__(self, ctx: DistContext, stages: Sequence[nn.Module],
                 params: Sequence[nn.Parameter]) -> None:
        self.ctx = ctx
        ids = {id(p) for p in params}
        self.slots = [(owner, name, p) for s in stages for owner, name, p in parameter_slots(s)
                      if id(p) in ids]
        self.mesh = ctx.mesh["dp", "tp"]
        self.laid_out: dict[int, nn.Parameter] = {}  # id of a tp parameter -> its (dp, tp) one
        self.placements: dict[int, list[Placement]] = {}
        for p in params:
            assert isinstance(p, DTensor), "only a tensor-parallel parameter is kept whole"
            self.placements[id(p)] = [Replicate(), *p.placements]
            on_mesh = DTensor.from_local(local(p.detach()), self.mesh, self.placements[id(p)],
                                         run_check=False, shape=p.shape, stride=p.stride())
            self.laid_out[id(p)] = nn.Parameter(on_mesh, requires_grad=p.requires_grad)
        self.params = list(params)
        self.leave()

    def enter(self) -> None:
        """The stages hold the tp parameters, for a step or forward."""
        for owner, name, tp in self.slots:
            owner._parameters[name] = tp  # type: ignore[assignment]

    def leave(self) -> None:
        """Drop the step's gradients on the tp parameters; the stages hold the (dp, tp) ones."""
        for p in self.params:
            p.grad = None
        for owner, name, tp in self.slots:
            owner._parameters[name] = self.laid_out[id(tp)]

    def reduce(self) -> None:
        """Average the step's gradients over the replicas into the (dp, tp) parameters'."""
        done = [p for p in self.params if p.grad is not None]
        parts = [local(p.grad) for p in done if p.grad is not None]
        with self.ctx.guard("the kept-whole gradients' average"):
            for work in [dist.all_reduce(g, group=self.ctx.dp_group, async_op=True)
                         for g in parts]:
                self.ctx.wait_work(work, None, "the kept-whole gradients' average")
        with torch.no_grad():
            for p, g in zip(done, parts, strict=True):
                g.div_(self.ctx.layout.data_parallel)
                held = self.laid_out[id(p)]
                if held.grad is None:
                    held.grad = DTensor.from_local(g, self.mesh, self.placements[id(p)],
                                                   run_check=False, shape=p.shape,
                                                   stride=p.stride())
                else:
                    local(held.grad).add_(g)
        self.leave()
