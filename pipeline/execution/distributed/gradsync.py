"""Data-parallel gradient averaging and replica consistency: each stage's gradients are averaged
over its replicas (the process's "dp" mesh group) in dtype buckets all-reduced as soon as
the stage's last backward is done, replicas start from replica 0's weights, and the buffers a
step or forward changes in place (BatchNorm's running statistics) are copied from replica 0
after it, as DDP's broadcast_buffers does.

Hook for tied parameters (one weight used by stages on different pipeline ranks): their
gradients need a sum over the ranks that hold a copy before the replica average; that is a
second bucket list over its own group, started from the same `start`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipeline.execution.distributed.context import DistContext
from pipeline.execution.distributed.dtensors import local
from scheduler import Op, Schedule

BUCKET_BYTES = 25 * 2**20  # gradient all-reduce bucket cap (as DDP's 25 MB)


def finish_order(schedule: Schedule, rank: int) -> list[int]:
    """`rank`'s stages in the order their last backward (W when backward is split) runs."""
    final = Op.W if schedule.splits_backward else Op.B
    last = {stage: -1 for stage in schedule.stages_of(rank)}
    for i, action in enumerate(schedule.actions[rank]):
        if action.op is final:
            last[action.stage] = i
    return sorted(last, key=last.__getitem__)


class GradSync:
    """Averages each stage's gradients over its replicas: per stage, buckets of at most
    `bucket_bytes` (one dtype each) are flattened and all-reduced asynchronously when `start`
    is called (RankRuntime's on_stage_done), and copied back in `finish` at the end of step.

    `stage_params` lists this process's stages in the order their last backward finishes. A
    parameter used by several of them (a tied embedding and LM head both on rank 0 under a V
    placement) is reduced once, with the last of them: only then is its gradient complete.
    `reduce_dtype` (e.g. torch.bfloat16): the dtype the floating-point buckets travel and are
    summed in (half the bytes; default: the gradients' own, fp32); averaged back in theirs."""

    def __init__(
        self,
        ctx: DistContext,
        stage_params: Mapping[int, Sequence[nn.Parameter]],
        bucket_bytes: int | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        cap = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.ctx = ctx
        self.reduce_dtype = reduce_dtype
        self.size = ctx.layout.data_parallel
        self.buckets: dict[int, list[list[nn.Parameter]]] = {}
        last_user = {id(p): stage for stage, params in stage_params.items() for p in params}
        for stage, params in stage_params.items():
            buckets: list[list[nn.Parameter]] = []
            current: dict[torch.dtype, tuple[list[nn.Parameter], int]] = {}
            mine = [p for p in params if p.requires_grad and last_user[id(p)] == stage]
            for p in reversed(mine):
                group, used = current.get(p.dtype, ([], 0))
                if group and used + p.numel() * p.element_size() > cap:
                    buckets.append(group)
                    group, used = [], 0
                group.append(p)
                current[p.dtype] = (group, used + p.numel() * p.element_size())
            buckets.extend(g for g, _ in current.values() if g)
            self.buckets[stage] = buckets
        self._pending: list[tuple[Any, Tensor, list[nn.Parameter]]] = []

    @property
    def _peer(self) -> int | None:
        """The one other member of a two-replica group (to name it if it fails)."""
        others = [r for r in self.ctx.layout.replica_ranks() if r != self.ctx.layout.rank]
        return others[0] if len(others) == 1 else None

    def start(self, stage: int) -> None:
        if self.size == 1:
            return
        for params in self.buckets.get(stage, []):
            # A tensor-parallel parameter's gradient is averaged shard by shard (this
            # process's part; its replicas hold the same part).
            grads = [torch.zeros_like(local(p)) if p.grad is None else local(p.grad)
                     for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if self.reduce_dtype is not None and flat.is_floating_point():
                flat = flat.to(self.reduce_dtype)
            work = dist.all_reduce(flat, group=self.ctx.dp_group, async_op=True)
            self._pending.append((work, flat, params))

    def finish(self) -> None:
        try:
            for work, flat, params in self._pending:
                self.ctx.wait_work(work, self._peer, "the gradient all-reduce")
                flat = flat.to(params[0].dtype).div_(self.size)
                offset = 0
                for p in params:
                    part = local(p)
                    n = part.numel()
                    value = flat[offset : offset + n].view_as(part)
                    if p.grad is None:
                        p.grad = DTensor.from_local(
                            value.clone(), p.device_mesh, p.placements, run_check=False,
                            shape=p.shape, stride=p.stride(),
                        ) if isinstance(p, DTensor) else value.clone()
                    else:
                        local(p.grad).copy_(value)
                    offset += n
        finally:
            self._pending.clear()


def _from_replica_0(ctx: DistContext, tensors: Sequence[Tensor], what: str) -> None:
    """Overwrite `tensors` (the same list on every replica) with replica 0's values: one
    broadcast over the dp group per dtype."""
    src = ctx.layout.global_rank(ctx.layout.pp_rank, 0)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with ctx.guard("replica sync"), torch.no_grad():
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            work = dist.broadcast(flat, src=src, group=ctx.dp_group, async_op=True)
            ctx.wait_work(work, None if ctx.layout.rank == src else src, what)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def sync_replicas(ctx: DistContext, modules: Sequence[nn.Module]) -> None:
    """Copy replica 0's parameters and buffers of these stages to the other replicas (as DDP
    does at construction), so replicas start equal even when processes seeded differently.
    Meta tensors (weights still to be loaded) and sharded ones (each replica holds its own
    shard) are skipped."""
    if ctx.layout.data_parallel == 1:
        return
    tensors = [local(t) for m in modules for t in (*m.parameters(), *m.buffers())
               if not t.is_meta and (not isinstance(t, DTensor) or _tensor_parallel(t))]
    _from_replica_0(ctx, tensors, "replica 0's weights")


def _tensor_parallel(t: DTensor) -> bool:
    """Whether `t` is a tensor-parallel DTensor (its replicas hold the same part of it)."""
    return t.device_mesh.mesh_dim_names == ("tp",)


class BufferSync:
    """Keeps the replicas' buffers equal, as DDP's broadcast_buffers does: `finish` copies from
    replica 0 the buffers the step or forward wrote, which are the `running` ones (see
    `pipeline.execution.grads.running_statistics`: BatchNorm updates them inside its kernel) and
    every other buffer whose version counter moved since `begin` (an in-place write:
    `copy_`, `add_`); constant buffers cost nothing. Every replica runs the same graph in
    the same mode, so the buffers written are the same on each. Without it each replica's
    running statistics would follow its own data, and evaluation or a checkpoint would
    depend on the replica."""

    def __init__(self, ctx: DistContext, modules: Sequence[nn.Module], running: set[str]) -> None:
        self.ctx = ctx
        named: dict[int, tuple[str, Tensor]] = {}
        if ctx.layout.data_parallel > 1:
            for module in modules:
                for name, b in module.named_buffers():
                    if not b.is_meta:
                        named.setdefault(id(b), (name, b))
        self.running = [b for name, b in named.values() if name in running]
        self.watched = [b for name, b in named.values() if name not in running]
        self.versions: list[int] = []

    def begin(self) -> None:
        self.versions = [b._version for b in self.watched]

    def finish(self) -> None:
        written = [b for b, v in zip(self.watched, self.versions, strict=True) if b._version != v]
        self.versions = []
        if self.running or written:
            _from_replica_0(self.ctx, [*self.running, *written], "replica 0's buffers")
