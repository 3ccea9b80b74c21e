"""A ZeRO-1 optimizer (``shard="optimizer"``: torch's `ZeroRedundancyOptimizer`) through a
re-balance: each replica keeps the state of only the parameters it owns, and the ownership is
a partition of this pipeline rank's parameters, which the move changes. So before the move
every replica of a pipeline rank gathers the whole state of its parameters from their owners
(tensor broadcasts over the "dp" group after a JSON manifest of keys, shapes and dtypes), the
move carries it like a plain optimizer's (`ZeroView` has the two attributes a move reads),
and after it the optimizer is partitioned anew over the new parameters, in place, each replica
keeping the state of the ones it now owns."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.optim import ZeroRedundancyOptimizer

from pipeline.execution.distributed.context import DistContext


def _dtype(text: str) -> torch.dtype:
    dtype = getattr(torch, text.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {text!r} in an optimizer-state manifest")
    return dtype


class ZeroView:
    """`zero`'s param groups (every parameter of this process) and the whole state of each of
    them, gathered from the replicas that own it; `rebuild` partitions `zero` anew."""

    def __init__(self, zero: ZeroRedundancyOptimizer, ctx: DistContext) -> None:
        self.zero, self.ctx = zero, ctx
        self.param_groups = zero.param_groups
        self.state: dict[Tensor, dict[str, Any]] = {}

    def _all_gather_text(self, text: str) -> list[str]:
        """Every replica's `text` (over the "dp" group)."""
        group, device = self.ctx.dp_group, self.ctx.device
        size = dist.get_world_size(group)
        data = text.encode()
        lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
        work = dist.all_gather(lengths, torch.tensor([len(data)], device=device), group=group,
                               async_op=True)
        self.ctx.wait_work(work, None, "the size of an optimizer-state manifest")
        longest = max(int(t.item()) for t in lengths)
        mine = torch.zeros(longest, dtype=torch.uint8, device=device)
        mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        parts = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(size)]
        work = dist.all_gather(parts, mine, group=group, async_op=True)
        self.ctx.wait_work(work, None, "an optimizer-state manifest")
        return [bytes(p[: int(n.item())].cpu().numpy()).decode()
                for p, n in zip(parts, lengths, strict=True)]

    def gather(self) -> None:
        """The whole state of every parameter of this process, from its owner."""
        zero: Any = self.zero  # ZeRO's private partition, as its own state_dict reads it
        group = self.ctx.dp_group
        params = list(zero._all_params)
        owner = zero._param_to_rank
        mine = {
            str(i): [[k, list(v.shape), str(v.dtype), v.device.type == "cpu"]
                     if isinstance(v, Tensor) else [k, None, v]
                     for k, v in sorted(zero.optim.state.get(p, {}).items())]
            for i, p in enumerate(params) if owner[p] == zero.rank
        }
        manifests: dict[str, Any] = {}
        for text in self._all_gather_text(json.dumps(mine)):
            manifests.update(json.loads(text))
        for i, p in enumerate(params):
            held = zero.optim.state.get(p, {})
            state: dict[str, Any] = {}
            for key, shape, dtype, *rest in manifests.get(str(i), []):
                if shape is None:
                    state[key] = dtype  # a plain value ([key, None, value])
                    continue
                t = (held[key].detach().to(self.ctx.device).clone() if owner[p] == zero.rank
                     else torch.empty(shape, dtype=_dtype(dtype), device=self.ctx.device))
                src = dist.get_global_rank(group, owner[p])
                work = dist.broadcast(t, src=src, group=group, async_op=True)
                self.ctx.wait_work(work, src, "a parameter's optimizer state")
                state[key] = t.cpu() if rest and rest[0] else t
            if state:
                self.state[p] = state

    def rebuild(self) -> None:
        """Partition `zero` over its (new) parameters, keeping the state of those this
        replica now owns."""
        zero: Any = self.zero
        groups = [dict(g) for g in zero.param_groups]
        ZeroRedundancyOptimizer.__init__(
            zero, groups, optimizer_class=zero._optim_constructor,
            process_group=zero.process_group,
            parameters_as_bucket_view=zero.parameters_as_bucket_view,
            **zero._optim_defaults,
        )
        owner = zero._param_to_rank
        for p, state in self.state.items():
            if owner.get(p) == zero.rank:
                zero.optim.state[p] = state
