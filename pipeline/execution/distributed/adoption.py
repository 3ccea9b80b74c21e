"""A new decision adopted by a running distributed executor (a re-balance, a re-synthesised
schedule whose placement differs): the units whose pipeline rank changes move, in memory, with
their gradients and the state of this process's optimizers (pipeline.execution.distributed.moves;
a ZeRO-1 optimizer's state through zero_moves; under shard="full" on whole tensors, gathered
and sharded anew: fsdp_moves), then the executor is rebuilt for the new decision.

The optimizers whose state moves are those made by ``pipe.optimizer(...)`` (offered by the
executor's `make_optimizer`) and any optimizer over this process's parameters that has
stepped once (seen by a global optimizer step pre-hook)."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from pipeline.execution.distributed.context import DistContext
from pipeline.execution.distributed.fsdp_moves import Unsharded
from pipeline.execution.distributed.moves import UnitMove, holders, plan_moves, total_bytes
from pipeline.execution.distributed.shard import Sharding
from pipeline.execution.distributed.zero_moves import ZeroView
from pipeline.planning.decision import Decision

log = logging.getLogger("hybridpipe")


class Optimizers:
    """The optimizers over this process's parameters, in the order they became known."""

    _trackers: weakref.WeakSet[Optimizers] = weakref.WeakSet()
    _hooked = False

    def __init__(self, owned: Callable[[], set[int]]) -> None:
        self.owned = owned  # ids of this process's parameters
        self.known: list[weakref.ref[torch.optim.Optimizer]] = []
        self._seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        Optimizers._trackers.add(self)
        if not Optimizers._hooked:  # one global hook for every distributed Pipeline
            register_optimizer_step_pre_hook(Optimizers._on_step)
            Optimizers._hooked = True

    @staticmethod
    def _on_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for tracker in list(Optimizers._trackers):
            tracker.offer(opt)

    def offer(self, opt: torch.optim.Optimizer) -> None:
        """Know `opt` if it optimizes this process's parameters (checked once per optimizer)."""
        if opt in self._seen:
            return
        self._seen.add(opt)
        owned = self.owned()
        if any(id(p) in owned for g in opt.param_groups for p in g["params"]):
            self.known.append(weakref.ref(opt))

    def alive(self) -> list[torch.optim.Optimizer]:
        """The known optimizers still in use, less ZeRO's inner ones (moved with theirs)."""
        found = [o for o in (r() for r in self.known) if o is not None]
        inner = {id(o.optim) for o in found if isinstance(o, ZeroRedundancyOptimizer)}
        return [o for o in found if id(o) not in inner]


@dataclass(frozen=True)
class MoveReport:
    """The last adopted decision's move on this process: seconds (decision to rebuilt
    executor) and bytes received (weights, grads, optimizer state)."""

    seconds: float
    bytes_received: int
    tensors_moved: int


def move_then_rebuild(ctx: DistContext, sharding: Sharding, optimizers: Optimizers,
                   old: Decision, new: Decision, rebuild: Callable[[], None]) -> MoveReport:
    """Move the units whose pipeline rank differs between `old` and `new` (the same decision
    on every process), then `rebuild` the executor for `new`. Under shard="full" the move runs
    on whole tensors. Nothing changes on any process unless every process received all it
    needs (see pipeline.execution.distributed.moves)."""
    start = time.perf_counter()
    alive = optimizers.alive()
    unsharded = None
    if sharding.full is not None:
        unsharded = Unsharded(ctx, sharding, alive, [
            old.model, old.captured.graph_module, *old.modules, *new.modules])
        with ctx.guard("gathering of the sharded parameters for the move"):
            unsharded.gather()
    moves = plan_moves(holders(old.model, old.modules, old.schedule.placement),
                       holders(new.model, new.modules, new.schedule.placement),
                       ctx.layout.pp_rank)
    if not alive:
        log.warning(
            "hybridpipe: re-balancing with no known optimizer on %s (none made by "
            "pipe.optimizer(...), none over its parameters has stepped): an optimizer "
            "built over pipe.parameters() before now misses the parameters that arrive; "
            "build it after the re-balance", ctx.layout.describe())
    zeros = [ZeroView(o, ctx) for o in alive if isinstance(o, ZeroRedundancyOptimizer)]
    views = iter(zeros)
    mover = UnitMove(ctx, old.model, moves,
                     [next(views) if isinstance(o, ZeroRedundancyOptimizer) else o
                      for o in alive],
                     holders=[old.captured.graph_module, old.captured.unit_module,
                              new.captured.graph_module, new.captured.unit_module,
                              *old.modules, *new.modules])
    with ctx.guard("move of the re-balanced units"):
        for zero in zeros:
            zero.gather()
        staged = mover.receive()
        mover.agree_received()
    mover.commit(staged)  # every process has what it needs: no failure leaves a mix
    for zero in zeros:
        zero.rebuild()
    if unsharded is not None:
        unsharded.stash_grads(old.model)
    rebuild()
    if unsharded is not None:
        with ctx.guard("re-sharding of the moved units' state"):
            unsharded.reshard()
    report = MoveReport(time.perf_counter() - start, total_bytes(staged.values()), moves.moved)
    log.info("hybridpipe: moved %d tensors in %.3f s (%d bytes received here)",
             moves.moved, report.seconds, report.bytes_received)
    return report
