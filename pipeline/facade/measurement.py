"""The measured steps of a Pipeline: their traces, the calibration made from them,
the predicted step (simulate), re-partitioning from measured costs (rebalance) and, for
schedule="auto", a schedule synthesised from measured costs (resynthesize)."""

from __future__ import annotations

import collections
import logging

from pipeline.execution.distributed.executor import DistributedExecutor
from pipeline.execution.distributed.shard import Sharding
from pipeline.facade.replan import DistributedReplan, repartitioned
from pipeline.facade.setup import Setup
from pipeline.planning.autoplan import SYNTH_MAX_CELLS
from pipeline.planning.calibration import (
    Calibration,
    Rebalance,
    calibrate,
    calibrated_costs,
    measured_node_costs,
    predict_calibrated,
    propose_rebalance,
)
from pipeline.planning.costs import StageCosts, costs_for_stages, predict
from pipeline.planning.decision import Decision
from pipeline.planning.synthesis import Resynthesis, propose_schedule, running_limits
from scheduler import Schedule, Timeline, build_schedule

log = logging.getLogger("hybridpipe")


class MeasuredSteps:
    """Step traces of one Pipeline (`setup` gives its plan and executor) and what is computed
    from them; `auto_rebalance`: re-balance once when two traces are in. With
    schedule="auto", in one process, a schedule is synthesised once from two traces of the
    running one (after any re-balance), up to `SYNTH_MAX_CELLS` stages x microbatches."""

    def __init__(self, setup: Setup, stages: int, auto_rebalance: bool) -> None:
        self.setup = setup
        self.stages = stages
        self.auto_rebalance = auto_rebalance
        self.trace: Timeline | None = None
        # Measured traces for calibration: the last few steps after the first (warm-up) one.
        self.measured: collections.deque[Timeline] = collections.deque(maxlen=4)
        self.steps = 0
        self.rebalanced: Rebalance | None = None
        self.resynthesized: Resynthesis | None = None
        ctx = setup.executor.context
        self.replan = None if ctx is None else DistributedReplan(ctx, self._owned)
        if self.replan is not None and auto_rebalance:
            setup.planner.profile_units = True  # rank 0 profiles before the model is split

    def _owned(self) -> set[int]:
        return {id(p) for m in self.setup.executor.held().values() for p in m.parameters()}

    def record(self, trace: Timeline) -> None:
        """Keep a complete step trace for calibration (not the first, warm-up step's), and
        re-balance once when asked to and two traces are in."""
        self.trace = trace
        self.steps += 1
        schedule = self.setup.schedule
        ops = 3 if schedule.splits_backward else 2
        complete = len(trace.events) == ops * schedule.num_stages * schedule.num_microbatches
        if self.steps > 1 and complete:
            self.measured.append(trace)
        if self.steps > 1 and self.replan is not None:
            self.replan.record(trace, set(self.setup.executor.held()), schedule.num_stages)
        if self.auto_rebalance and self.rebalanced is None and self._ready():
            self.rebalance()
        if (self.setup.planner.auto_schedule and self.resynthesized is None and self._ready()
                and schedule.num_stages * schedule.num_microbatches <= SYNTH_MAX_CELLS):
            self.resynthesize()

    def _ready(self) -> bool:
        """Two measured steps of the running plan are in (every stage's, under torchrun)."""
        return len(self.measured if self.replan is None else self.replan.stage_times) >= 2

    @property
    def calibration(self) -> Calibration | None:
        if not self.measured:
            return None
        return calibrate(self.setup.schedule, list(self.measured))

    def profiled_costs(self) -> StageCosts:
        return self.setup.costs()

    def simulate(
        self, schedule: Schedule | str | None, comm: float | None, calibrated: bool
    ) -> Timeline:
        profiled = self.profiled_costs()
        calibration = self.calibration if calibrated else None
        if schedule is None:
            schedule = self.setup.schedule
        elif isinstance(schedule, str):
            schedule = build_schedule(
                schedule, self.stages, self.setup.schedule.num_microbatches
            )
        target = schedule
        planned = self.setup.decision
        captured = planned.captured if planned is not None else None
        if target.num_stages != profiled.num_stages and (
            not self.setup.executor.coordination.keeps_whole_model or captured is None
        ):
            raise ValueError(
                f"schedule {target.name!r} has {target.num_stages} stages and this plan "
                f"{profiled.num_stages}; under torch.distributed only the plan's stage count "
                "can be simulated"
            )
        balance = self.setup.planner.balance
        balance = balance if isinstance(balance, str) else "profile"

        def costs_of(step: Calibration | None) -> StageCosts:
            costs = profiled if step is None else calibrated_costs(step, profiled)
            if captured is None or target.num_stages == costs.num_stages:
                return costs
            plan = self.setup.require_plan().plan
            scaled = captured if step is None else measured_node_costs(captured, plan, costs)
            return costs_for_stages(scaled, target.num_stages, balance)

        if calibration is None:
            return predict(target, costs_of(None), latency=comm or 0.0)
        return predict_calibrated(target, calibration, costs_of, latency=comm)

    def _measured_in_one_process(self, what: str, why: str) -> Calibration:
        """The calibration `what` (a re-plan from measured costs) starts from; it needs
        measured steps and every stage in this process (`why` says what stops it otherwise)."""
        calibration = self.calibration
        if calibration is None:
            raise ValueError(f"{what} needs measured steps: run at least two steps first")
        if not self.setup.executor.coordination.keeps_whole_model:
            raise ValueError(f"{what} works in one process: under torch.distributed {why}")
        return calibration

    def _adopt(self, new: Decision) -> None:
        """Run `new` from the next step on; the old traces describe the old plan."""
        self.setup.adopt(new)
        self.measured.clear()
        if self.replan is not None:
            self.replan.stage_times.clear()

    def rebalance(self, threshold: float = 0.05) -> Rebalance:
        if self.replan is not None:
            return self._rebalance_distributed(self.replan, threshold)
        calibration = self._measured_in_one_process(
            "rebalance",
            "each process holds only its stages' weights; pass balance=[...] with the sizes "
            "it reports instead",
        )
        setup = self.setup
        planned = setup.require_plan()
        report, plan = propose_rebalance(
            planned.captured, planned.plan, planned.schedule, calibration, self.profiled_costs(),
            threshold,
        )
        if report.applied:
            self._adopt(planned.repartitioned(plan))
        self.rebalanced = report
        log.info("hybridpipe: %s", report)
        return report

    def _check_distributed(self, what: str, replan: DistributedReplan) -> None:
        """What a distributed re-plan needs, checked alike on every process before any
        tensor moves: the units' profiled costs on rank 0 and two measured steps."""
        planner = self.setup.planner
        if not (planner.balance == "profile" or planner.auto or planner.auto_activations
                or planner.profile_units):
            raise ValueError(
                f"{what} under torch.distributed needs the units' profiled costs, which global "
                f"rank 0 takes before the model is split; balance={planner.balance!r} skips "
                "them: build the Pipeline with rebalance=True or balance='profile'"
            )
        if len(replan.stage_times) < 2:
            raise ValueError(f"{what} needs measured steps: run at least three steps first")

    def _sharding(self) -> Sharding | None:
        executor = self.setup.executor
        return executor.sharding if isinstance(executor, DistributedExecutor) else None

    def _rebalance_distributed(self, replan: DistributedReplan, threshold: float) -> Rebalance:
        """Every process calls it at the same step (pipeline.facade.replan)."""
        self._check_distributed("rebalance", replan)
        planned = self.setup.require_plan()
        report = replan.decide(planned, self.calibration, threshold)
        if report.applied:
            replan.move(planned, repartitioned(planned, report.after), self._adopt,
                        self._sharding())
        self.rebalanced = report
        log.info("hybridpipe: %s", report)
        return report

    def _resynthesize_distributed(
        self, replan: DistributedReplan, threshold: float
    ) -> Resynthesis:
        """Every process calls it at the same step; a new placement moves units."""
        self._check_distributed("resynthesize", replan)
        planned = self.setup.require_plan()
        report, schedule = replan.decide_schedule(
            planned, self.calibration, threshold, self.setup.planner.memory_limit)
        if schedule is not None:
            replan.move(planned, planned.rescheduled(schedule), self._adopt, self._sharding())
        self.resynthesized = report
        log.info("hybridpipe: %s", report)
        return report

    def resynthesize(self, threshold: float = 0.05) -> Resynthesis:
        if self.replan is not None:
            return self._resynthesize_distributed(self.replan, threshold)
        calibration = self._measured_in_one_process(
            "resynthesize",
            "every process would have to switch at the same step; pass the schedule it reports "
            "instead",
        )
        setup = self.setup
        profiled = self.profiled_costs()  # first: it may profile, making a new decision
        planned = setup.require_plan()
        limits = running_limits(planned.schedule, profiled, setup.planner.memory_limit)
        report, schedule = propose_schedule(
            planned.schedule, calibration, profiled, limits, threshold
        )
        if report.applied:
            self._adopt(planned.rescheduled(schedule))
        self.resynthesized = report
        log.info("hybridpipe: %s", report)
        return report
