"""Re-balancing (and re-synthesising the schedule of) a Pipeline under torch.distributed while
it trains: every process's measured time of its own stages is gathered (an all-reduce: the
slowest replica of each stage counts), global rank 0 re-partitions for the ranks' measured
speeds (pipeline.planning.rank_speeds) and broadcasts its decision (a tensor: applied, the two
predicted steps, the stage sizes); every process then makes the same plan from those sizes
and, if it was adopted, moves the units whose pipeline rank changed with their gradients and
optimizer state (pipeline.execution.distributed.moves; under shard="full" on whole tensors,
gathered and sharded anew: fsdp_moves) before the executor is rebuilt. A
re-synthesised schedule's text is broadcast likewise (a new placement moves units too).

The optimizers whose state moves are those made by ``pipe.optimizer(...)`` and any optimizer
over this process's parameters that has stepped once (seen by a global optimizer step
pre-hook)."""

from __future__ import annotations

import logging
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from partitioner import partition
from pipeline.execution.distributed.context import DistContext
from pipeline.execution.distributed.fsdp_moves import Unsharded
from pipeline.execution.distributed.moves import UnitMove, holders, plan_moves, total_bytes
from pipeline.execution.distributed.shard import Sharding
from pipeline.execution.distributed.zero_moves import ZeroView
from pipeline.planning.calibration import Calibration, Rebalance
from pipeline.planning.costs import stage_costs
from pipeline.planning.decision import Decision
from pipeline.planning.rank_speeds import propose_for_ranks
from pipeline.planning.synthesis import SYNTH, Resynthesis, propose_schedule, running_limits
from scheduler import Op, Schedule, Timeline

log = logging.getLogger("hybridpipe")
OPS = (Op.F, Op.B, Op.W)


def own_stage_means(trace: Timeline, held: set[int], stages: int) -> list[list[float]]:
    """[op][stage] mean measured seconds of the stages in `held` (0 elsewhere)."""
    sums = [[0.0] * stages for _ in OPS]
    counts = [[0] * stages for _ in OPS]
    for e in trace.events:
        if e.stage in held:
            sums[OPS.index(e.op)][e.stage] += e.duration
            counts[OPS.index(e.op)][e.stage] += 1
    return [[s / c if c else 0.0 for s, c in zip(row, crow, strict=True)]
            for row, crow in zip(sums, counts, strict=True)]


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
    """The last adopted re-balance's move on this process: seconds (decision to rebuilt
    executor) and bytes received (weights, grads, optimizer state)."""

    seconds: float
    bytes_received: int
    tensors_moved: int


class DistributedReplan:
    """The distributed re-balance and re-synthesis of one Pipeline (`ctx`: its processes)."""

    def __init__(self, ctx: DistContext, owned: Callable[[], set[int]]) -> None:
        self.ctx = ctx
        self.optimizers = Optimizers(owned)
        self.stage_times: list[list[list[float]]] = []  # per measured step: [op][stage]
        self.last_move: MoveReport | None = None

    def record(self, trace: Timeline, held: set[int], stages: int) -> None:
        self.stage_times = [*self.stage_times[-3:], own_stage_means(trace, held, stages)]

    def gathered_times(self) -> list[list[float]]:
        """[op][stage] median over the recorded steps, the maximum over the replicas."""
        stages = len(self.stage_times[0][0])
        local = torch.tensor([[statistics.median(step[o][s] for step in self.stage_times)
                               for s in range(stages)] for o in range(len(OPS))],
                             dtype=torch.float64, device=self.ctx.device)
        with self.ctx.guard("gathering of the measured stage times"):
            work = dist.all_reduce(local, op=dist.ReduceOp.MAX, async_op=True)
            self.ctx.wait_work(work, None, "the measured stage times")
        return local.cpu().tolist()

    def _measured(self, planned: Decision, calibration: Calibration | None) -> Calibration:
        """(Rank 0) its calibration (overhead, latency from its pipeline's gathered traces)
        with every stage's time gathered from the processes that ran it."""
        times = self.gathered_times()
        base = calibration if calibration is not None else Calibration(
            [], [], [], 0.0, 0.0, 1, planned.schedule.splits_backward)
        return replace(base, forward=times[0], backward=times[1], weight=times[2], per_step=())

    def _broadcast(self, values: list[float], text: str, what: str) -> tuple[list[float], str]:
        """Global rank 0's `values` (a fixed count every process knows) and `text` (UTF-8
        bytes, preceded by their length) on every process."""
        device = self.ctx.device
        head = torch.tensor([*values, float(len(text.encode()))], dtype=torch.float64,
                            device=device)
        with self.ctx.guard(f"agreement on {what}"):
            work = dist.broadcast(head, src=0, async_op=True)
            self.ctx.wait_work(work, None, what)
            length = int(head[-1].item())
            body = (torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
                    if self.ctx.layout.rank == 0
                    else torch.empty(length, dtype=torch.uint8, device=device))
            if body.numel():
                work = dist.broadcast(body, src=0, async_op=True)
                self.ctx.wait_work(work, None, what)
        return head[:-1].cpu().tolist(), bytes(body.cpu().numpy()).decode()

    def decide(
        self, planned: Decision, calibration: Calibration | None, threshold: float
    ) -> Rebalance:
        """Global rank 0's re-partition from the gathered times, the same on every process."""
        measured = self._measured(planned, calibration)
        values = [0.0] * (3 + planned.schedule.num_stages)
        if self.ctx.layout.rank == 0:
            profiled = planned.costs or stage_costs(planned.captured, planned.plan)
            report, plan = propose_for_ranks(planned.captured, planned.plan, planned.schedule,
                                             measured, profiled, threshold)
            values = [float(report.applied), report.predicted_before, report.predicted_after,
                      *map(float, plan.sizes)]
        values, _ = self._broadcast(values, "", "the re-balanced plan")
        return Rebalance(
            before=planned.plan.sizes, after=[int(v) for v in values[3:]],
            predicted_before=values[1], predicted_after=values[2], threshold=threshold,
            applied=bool(values[0]),
        )

    def decide_schedule(
        self, planned: Decision, calibration: Calibration | None, threshold: float,
        memory_limit: float | None,
    ) -> tuple[Resynthesis, Schedule | None]:
        """Global rank 0's schedule synthesised from the gathered times (its text broadcast),
        the same on every process; None when not applied."""
        measured = self._measured(planned, calibration)
        values, text = [0.0, 0.0, 0.0], ""
        if self.ctx.layout.rank == 0:
            profiled = planned.costs or stage_costs(planned.captured, planned.plan)
            limits = running_limits(planned.schedule, profiled, memory_limit)
            report, schedule = propose_schedule(planned.schedule, measured, profiled, limits,
                                                threshold)
            values = [float(report.applied), report.predicted_before, report.predicted_after]
            text = schedule.to_text() if report.applied else ""
        values, text = self._broadcast(values, text, "the re-synthesised schedule")
        report = Resynthesis(planned.schedule.name, values[1], values[2], threshold,
                             bool(values[0]))
        return report, Schedule.from_text(text, name=SYNTH) if report.applied else None

    def move(self, planned: Decision, new: Decision, adopt: Callable[[Decision], None],
             sharding: Sharding | None = None) -> None:
        """Move the units whose pipeline rank differs between `planned` and `new` (the same
        decision on every process), then `adopt` it (the executor is rebuilt for it).
        `sharding`: the executor's; under shard="full" the move runs on whole tensors."""
        start = time.perf_counter()
        optimizers = self.optimizers.alive()
        unsharded = None
        if sharding is not None and sharding.full is not None:
            unsharded = Unsharded(self.ctx, sharding, optimizers, [
                planned.model, planned.captured.graph_module, *planned.modules, *new.modules])
            with self.ctx.guard("gathering of the sharded parameters for the move"):
                unsharded.gather()
        moves = plan_moves(holders(planned.model, planned.modules, planned.schedule.placement),
                           holders(new.model, new.modules, new.schedule.placement),
                           self.ctx.layout.pp_rank)
        if not optimizers:
            log.warning(
                "hybridpipe: re-balancing with no known optimizer on %s (none made by "
                "pipe.optimizer(...), none over its parameters has stepped): an optimizer "
                "built over pipe.parameters() before now misses the parameters that arrive; "
                "build it after the re-balance", self.ctx.layout.describe())
        zeros = [ZeroView(o, self.ctx) for o in optimizers
                 if isinstance(o, ZeroRedundancyOptimizer)]
        views = iter(zeros)
        mover = UnitMove(self.ctx, planned.model, moves,
                         [next(views) if isinstance(o, ZeroRedundancyOptimizer) else o
                          for o in optimizers])
        with self.ctx.guard("move of the re-balanced units"):
            for zero in zeros:
                zero.gather()
            staged = mover.receive()
            mover.agree_received()
        mover.commit(staged)  # every process has what it needs: no failure leaves a mix
        for zero in zeros:
            zero.rebuild()
        if unsharded is not None:
            unsharded.stash_grads(planned.model)
        adopt(new)
        if unsharded is not None:
            with self.ctx.guard("re-sharding of the moved units' state"):
                unsharded.reshard()
        self.last_move = MoveReport(time.perf_counter() - start, total_bytes(staged.values()),
                                    moves.moved)
        log.info("hybridpipe: moved %d tensors in %.3f s (%d bytes received here)",
                 moves.moved, self.last_move.seconds, self.last_move.bytes_received)


def repartitioned(planned: Decision, sizes: list[int]) -> Decision:
    """`planned` split into stages of `sizes` units (the same plan on every process), with
    the stage costs where the units were profiled (global rank 0)."""
    captured = planned.captured
    plan = partition(captured, planned.schedule.num_stages, sizes)
    new = planned.repartitioned(plan)
    return replace(new, costs=stage_costs(captured, plan)) if captured.profiled else new
