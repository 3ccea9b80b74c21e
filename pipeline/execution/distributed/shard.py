"""Sharded data parallelism over the replicas of each pipeline rank (``Pipeline(...,
shard=...)``), with torch's own parts; `Sharding` is what the distributed executor runs:

- ``shard="optimizer"`` (ZeRO-1): gradients are all-reduced over the replicas as without
  sharding (`GradSync`); the optimizer is torch's `ZeroRedundancyOptimizer` over this process's
  parameters and its "dp" group, so each replica keeps and updates the state of about 1/dp of
  the parameters (whole parameters, balanced by size) and broadcasts them to the other
  replicas after its update (`optimizers`).
- ``shard="full"`` (FSDP2): `FullShard` applies ``fully_shard`` to this rank's stages, as one
  unit, over the "dp" sub-mesh; parameters, gradients and the optimizer state are DTensors
  sharded along dim 0. The unit is never called: the executor gathers the parameters before
  a step (or forward) and reduce-scatters the gradients after the step's last backward, as
  torch.distributed.pipelining drives an FSDP stage (its ``perform_reduce_grad``), since the
  runtime's step-private leaves keep FSDP's own autograd hooks out of the step. On
  tensor-parallel parameters the shards are DTensors on the (dp, tp) mesh
  (pipeline.execution.distributed.fsdp_tp, which also keeps whole what FSDP2 cannot shard).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from pipeline.execution.distributed.context import DistContext
from pipeline.execution.distributed.fsdp_tp import WholeOnReplicas, fsdp_dim, fsdp_placement
from pipeline.execution.distributed.optimizers import OptimizerCheck, build_optimizer
from pipeline.execution.distributed.ties import TieSync
from pipeline.execution.grads import parameter_slots
from pipeline.planning.settings import check_shard


class _RankStages(nn.Module):
    """The stages of one pipeline rank as one FSDP2 unit (one all-gather and one
    reduce-scatter per step; a parameter shared by two of them is sharded once). Never
    called: `FullShard` gathers and reduces around each step."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)


class FullShard:
    """FSDP2 over this process's stages on the "dp" sub-mesh (see the module docstring).

    At construction the stages' parameters become sharded DTensors, in the stage modules and
    in `model` (so ``model.named_parameters()`` and the Pipeline's name them as before);
    `stale` maps the id of each old parameter to it while it lives, `sharded` to the sharded
    one that replaced it (valid while the old one lives: a re-balance's move). `gather`
    all-gathers the parameters into the stages for a step or forward; `reduce`
    reduce-scatters (and averages) the gradients the step left on them into the sharded
    parameters' `.grad` and frees the gathered ones; `release` frees them without reducing
    (after a forward, or a failed step, whose gradients are dropped)."""

    def __init__(self, ctx: DistContext, model: nn.Module, stages: Sequence[nn.Module]) -> None:
        self.ctx = ctx
        before = {(id(owner), name): p for s in stages for owner, name, p in parameter_slots(s)}
        self.unit = _RankStages(stages)
        replicas = ctx.layout.data_parallel
        whole = [p for p in self.unit.parameters() if fsdp_dim(p, replicas) is None]
        with ctx.guard("sharding the stages (fully_shard)"):
            fully_shard(self.unit, mesh=ctx.mesh["dp"], reshard_after_forward=False,
                        shard_placement_fn=fsdp_placement(replicas),
                        ignored_params=set(whole))
        self.fsdp: FSDPModule = self.unit  # type: ignore[assignment]
        self.state = fully_shard.state(self.unit)  # type: ignore[attr-defined]
        self.state._lazy_init()  # the root's set-up, normally done by its first forward
        self.whole = WholeOnReplicas(ctx, stages, whole) if whole else None
        replaced: dict[int, Tensor] = {}
        self.sharded = replaced
        # The old parameters, while anything (an optimizer built too early) holds them.
        self.stale: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
        for s in stages:
            for owner, name, p in parameter_slots(s):
                old = before[(id(owner), name)]
                if p is not old:
                    replaced[id(old)] = p
                    self.stale[id(old)] = old
        for owner in model.modules():
            for name, held in owner._parameters.items():
                if held is not None and id(held) in replaced:
                    owner._parameters[name] = replaced[id(held)]  # type: ignore[assignment]

    def gather(self) -> None:
        """All-gather the parameters into the stages, kept until `reduce` or `release`."""
        self.fsdp.set_requires_gradient_sync(False)
        self.fsdp.set_reshard_after_backward(False)
        with self.ctx.guard("gathering the sharded parameters"):
            self.fsdp.unshard()
        if self.whole is not None:
            self.whole.enter()

    def reduce(self) -> None:
        """Reduce-scatter the gathered parameters' gradients over the replicas (their mean,
        added to the sharded `.grad`) and free the gathered parameters."""
        self.fsdp.set_requires_gradient_sync(True)
        self.fsdp.set_reshard_after_backward(True)
        self.fsdp.set_is_last_backward(True)
        with self.ctx.guard("the gradient reduce-scatter"):
            for state in self.state._state_ctx.all_states:
                for group in state._fsdp_param_groups:
                    group.post_backward()
            self.state._root_post_backward_final_callback()
        if self.whole is not None:
            self.whole.reduce()

    def release(self) -> None:
        """Free the gathered parameters, dropping any gradient on them."""
        sharded = {id(p) for p in self.sharded.values()}
        for p in self.unit.parameters():
            if id(p) not in sharded:  # a gathered one (a tp DTensor under tensor parallelism)
                p.grad = None
        self.fsdp.reshard()
        if self.whole is not None:
            self.whole.leave()


class Sharding:
    """The executor's shard mode (`check_shard`), run through these calls (what GradSync
    all-reduces is the data-parallel pass's, pipeline.execution.passes.data_parallel):
    `attach` (after each (re)build), `gather` / `reduce` / `release`
    around each step or forward, `forward_grad`, `norm_group` (the group a gradient norm is
    summed over) and `make_optimizer`."""

    def __init__(self, shard: object, ctx: DistContext) -> None:
        self.shard = check_shard(shard)
        self.ctx = ctx
        self.full: FullShard | None = None
        self.stages: dict[int, nn.Module] = {}
        self.check = None if self.shard is None else OptimizerCheck(self.shard, self)

    def held(self) -> dict[int, nn.Module]:
        return self.stages

    def replaced(self, p: Tensor) -> bool:
        """Whether `p` is a parameter that "full" replaced by a sharded one (and an optimizer
        built before the plan still holds)."""
        return self.full is not None and self.full.stale.get(id(p)) is p

    def attach(
        self, model: nn.Module, stages: Mapping[int, nn.Module], ties: TieSync | None
    ) -> None:
        """After the executor is built and the replicas hold replica 0's weights: under "full"
        shard the stages, once (a meta model's once its weights are loaded)."""
        self.stages = dict(stages)
        if self.shard != "full" or self.full is not None or any(
            t.is_meta for m in stages.values() for t in m.parameters()
        ):
            return
        self.full = FullShard(self.ctx, model, list(stages.values()))
        if ties is not None:
            ties.rebind(model)

    def gather(self, rebind: Callable[[], None]) -> None:
        """Under "full": all-gather the parameters into the stages; `rebind` tells the
        runtime where they now are."""
        if self.full is not None:
            self.full.gather()
            rebind()

    def reduce(self) -> None:
        if self.full is not None:
            self.full.reduce()

    def release(self) -> None:
        if self.full is not None:
            self.full.release()

    def forward_grad(self, grad: bool) -> bool:
        """Whether a forward keeps its graph: not under "full", whose gathered parameters are
        freed after it."""
        return grad and self.full is None

    @property
    def norm_group(self) -> dist.ProcessGroup | None:
        """Replicas hold equal gradients unless sharded: then a norm sums over every process
        (None: the default group), else over the pipeline."""
        return None if self.full is not None else self.ctx.pp_group

    def make_optimizer(
        self, params: Sequence[nn.Parameter], optimizer_class: type[torch.optim.Optimizer],
        **kwargs: Any,
    ) -> torch.optim.Optimizer:
        """The optimizer of this process's `params` for the mode (`build_optimizer`)."""
        if self.shard is not None and not self.stages:
            raise ValueError(
                f"pipe.optimizer(...) with shard={self.shard!r} needs the plan (each process's "
                "share of the parameters): pass example_input=... to Pipeline, or call it after "
                "the first step"
            )
        if self.shard == "full" and self.full is None:
            raise ValueError(
                "pipe.optimizer(...) with shard='full' needs the stages' weights (the model is "
                "on the meta device): load them (load_state_dict / load_checkpoint) or "
                "initialise them (init_fn=...) first"
            )
        made = build_optimizer(self.shard, params, optimizer_class, self.ctx, **kwargs)
        if self.check is not None:
            self.check.allow(made)
        return made
