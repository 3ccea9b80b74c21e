"""A fully sharded pipeline rank (``shard="full"``: FSDP2) through a re-balance: the move runs
on whole tensors, as for plain replicas (pipeline.execution.distributed.moves).

Before it, `Unsharded.gather` all-gathers over the "dp" group (``DTensor.full_tensor``) every
sharded parameter of this process, its gradient and its optimizer state into a plain Parameter,
swapped in wherever the sharded one was (the model, its captured graph, the stage modules, the
optimizers' param groups and state), and drops the FSDP2 unit, so each replica briefly holds its
stages whole. After the move, `stash_grads` takes the gradients off (``fully_shard`` makes new
Parameters without them), the executor is rebuilt for the new plan (which shards its stages
anew, as at load), and `reshard` swaps the new sharded Parameters into the optimizers, each
replica keeping its own dim-0 shard of the gradients and the state (``distribute_tensor`` with
the new Parameter's placements, split locally: every replica holds the same whole tensor).

The optimizers stay the same objects: their param groups and state are updated in place."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from pipeline.execution.distributed.context import DistContext
from pipeline.execution.distributed.moves import OptimizerLike
from pipeline.execution.distributed.shard import Sharding


def swap_parameters(roots: Iterable[nn.Module], new: Mapping[int, Tensor]) -> None:
    """Put `new[id(p)]` in every slot of the modules under `roots` that holds a `p`."""
    seen: set[int] = set()
    for root in roots:
        for owner in root.modules():
            if id(owner) in seen:
                continue
            seen.add(id(owner))
            for name, held in owner._parameters.items():
                if held is not None and id(held) in new:
                    owner._parameters[name] = new[id(held)]  # type: ignore[assignment]


def _whole(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _shard_like(value: Any, param: Tensor) -> Any:
    """`value` (a whole tensor shaped like `param`) as `param`'s shard on this replica."""
    if not (isinstance(param, DTensor) and isinstance(value, Tensor)
            and value.dim() > 0 and value.shape == param.shape):
        return value  # a step count or a plain value: the same on every replica
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                             src_data_rank=None)


def _swap_optimizers(optimizers: Sequence[OptimizerLike], new: Mapping[int, Tensor],
                     whole: bool) -> None:
    """Replace the optimizers' parameters by `new`'s, their state gathered (`whole`) or
    sharded like the new parameter."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [new.get(id(p), p) for p in group["params"]]
        for p in [p for p in opt.state if id(p) in new]:
            q = new[id(p)]
            opt.state[q] = {k: _whole(v) if whole else _shard_like(v, q)
                            for k, v in opt.state.pop(p).items()}


class Unsharded:
    """This process's stages of `sharding` unsharded for a move, and sharded again after it
    (see the module docstring). `roots`: every module that may hold the parameters."""

    def __init__(self, ctx: DistContext, sharding: Sharding,
                 optimizers: Sequence[OptimizerLike], roots: Sequence[nn.Module]) -> None:
        self.ctx, self.sharding = ctx, sharding
        self.optimizers, self.roots = list(optimizers), list(roots)
        self.held: list[Tensor] = []  # the plain Parameters, alive until `reshard`
        self.grads: dict[int, Tensor] = {}

    def gather(self) -> None:
        """Whole plain Parameters (with their gradients and optimizer state) for the sharded
        ones; the FSDP2 unit is dropped."""
        full = self.sharding.full
        assert full is not None, "gather needs a sharded executor"
        plain: dict[int, Tensor] = {}
        with torch.no_grad():
            for p in full.unit.parameters():
                if not isinstance(p, DTensor):
                    continue
                q = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
                if p.grad is not None:
                    q.grad = _whole(p.grad)
                plain[id(p)] = q
            # The parameters FSDP2 replaced may still sit where it did not look (the captured
            # graph's attribute holders, which a re-partition copies into the new stages).
            for old_id, old in list(full.stale.items()):
                sharded = full.sharded.get(old_id)
                if sharded is not None and id(sharded) in plain:
                    plain[id(old)] = plain[id(sharded)]
            _swap_optimizers(self.optimizers, plain, whole=True)
        swap_parameters(self.roots, plain)
        self.sharding.full = None  # the executor's next attach shards the new stages
        self.held = list({id(q): q for q in plain.values()}.values())

    def stash_grads(self, model: nn.Module) -> None:
        """Take the gradients off this process's (moved-in or kept) parameters, to be
        sharded onto the new sharded Parameters."""
        self.held = list({id(p): p for p in (*self.held, *model.parameters())}.values())
        for p in self.held:
            if p.grad is not None:
                self.grads[id(p)] = p.grad
                p.grad = None

    def reshard(self) -> None:
        """After the executor sharded its new stages: their sharded Parameters take the
        gradients and the optimizer state of the plain ones they replaced."""
        full = self.sharding.full
        assert full is not None, "the executor did not shard its stages"
        new = {id(p): full.sharded[id(p)] for p in self.held
               if full.stale.get(id(p)) is p and id(p) in full.sharded}
        with torch.no_grad():
            for p in self.held:
                grad = self.grads.get(id(p))
                if id(p) in new and grad is not None:
                    new[id(p)].grad = _shard_like(grad, new[id(p)])
            _swap_optimizers(self.optimizers, new, whole=False)
        swap_parameters(self.roots, new)
        self.held, self.grads = [], {}
