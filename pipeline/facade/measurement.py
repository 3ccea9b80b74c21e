"""The measured steps of a Pipeline: their traces, the calibration made from them,
the predicted step (simulate), and the re-plans from measured costs (rebalance: a new
partition; for schedule="auto", resynthesize: a new schedule; after a restart at another
layout, the elastic re-plan from the unit costs the checkpoint kept), each a planning phase
(`Planner.replan`) whose decision the executor adopts (`Executor.adopt`)."""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping
from dataclasses import replace

from torch.optim import Optimizer

from partitioner.unit_costs import UnitCosts
from pipeline.facade.planning_phase import PlanningPhase
from pipeline.planning.autoplan import SYNTH_MAX_CELLS
from pipeline.planning.calibration import (
    Calibration,
    Rebalance,
    calibrate,
    calibrated_costs,
    measured_node_costs,
    predict_calibrated,
)
from pipeline.planning.costs import StageCosts, costs_for_stages, predict
from pipeline.planning.replan import Measured, Reason, from_unit_costs, own_stage_means
from pipeline.planning.synthesis import Resynthesis
from scheduler import Schedule, Timeline, build_schedule

log = logging.getLogger("hybridpipe")


class MeasuredSteps:
    """Step traces of one Pipeline (`setup` gives its plan and executor) and what is computed
    from them; `auto_rebalance`: re-balance once when two measured steps are in. With
    schedule="auto" a schedule is synthesised once from two measured steps of the running one
    (after any re-balance), up to `SYNTH_MAX_CELLS` stages x microbatches."""

    def __init__(self, setup: PlanningPhase, stages: int, auto_rebalance: bool) -> None:
        self.setup = setup
        self.stages = stages
        self.auto_rebalance = auto_rebalance
        self.trace: Timeline | None = None
        # Measured traces for calibration: the last few steps after the first (warm-up) one.
        self.measured: collections.deque[Timeline] = collections.deque(maxlen=4)
        # Per measured step, [op][stage] mean seconds of the stages this process ran.
        self.stage_times: collections.deque[list[list[float]]] = collections.deque(maxlen=4)
        self.steps = 0
        self.rebalanced: Rebalance | None = None
        self.resynthesized: Resynthesis | None = None

    def record(self, trace: Timeline) -> None:
        """Keep a step's measured figures (not the first, warm-up step's), and re-plan once
        when asked to and two measured steps are in."""
        self.trace = trace
        self.steps += 1
        schedule = self.setup.schedule
        ops = 3 if schedule.splits_backward else 2
        complete = len(trace.events) == ops * schedule.num_stages * schedule.num_microbatches
        if self.steps > 1:
            if complete:
                self.measured.append(trace)
            held = set(self.setup.executor.held())
            self.stage_times.append(own_stage_means(trace, held, schedule.num_stages))
        if self.auto_rebalance and self.rebalanced is None and len(self.stage_times) >= 2:
            self.rebalance()
        if (self.setup.planner.auto_schedule and self.resynthesized is None
                and len(self.stage_times) >= 2
                and schedule.num_stages * schedule.num_microbatches <= SYNTH_MAX_CELLS):
            self.resynthesize()

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
            captured is None or not captured.profiled
        ):
            raise ValueError(
                f"schedule {target.name!r} has {target.num_stages} stages and this plan "
                f"{profiled.num_stages}; another stage count re-partitions the units' profiled "
                "costs, which this process lacks (under torch.distributed the plan's stage "
                "count can be simulated, and another one where the units were profiled)"
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

    def _measurement(self, what: str) -> Measured:
        """What a re-plan starts from (every process gathers it): every stage's measured times
        (the slowest replica's) with the calibration's overhead and latency, and every unit's
        profiled costs: profiled up front on one device (then, where each pipeline rank runs
        on a device of its own, a stage's deviation is its rank's speed), or measured now by
        the processes holding them (each unit's cost is then its rank's already)."""
        if not self.stage_times:
            raise ValueError(f"{what} needs measured steps: run at least two steps first")
        on_one_device = self.setup.require_plan().costs is not None
        self.profiled_costs()
        decision = self.setup.require_plan()
        times = self.setup.executor.stage_times(list(self.stage_times))
        base = self.calibration or Calibration(
            [], [], [], 0.0, 0.0, 1, decision.schedule.splits_backward)
        calibration = replace(base, forward=times[0], backward=times[1], weight=times[2],
                              per_step=())
        return Measured(calibration, decision.captured,
                        on_one_device and self.setup.executor.measures_rank_speeds)

    def _from_measured(self, reason: Reason, threshold: float) -> Rebalance | Resynthesis:
        """A re-plan for `reason` (`Planner.replan`), adopted by the executor when applied;
        every process calls it at the same step. The old traces describe the old plan."""
        setup = self.setup
        measured = self._measurement(reason)
        new = setup.planner.replan(setup.require_plan(), measured, reason,
                                   setup.executor.coordination, threshold)
        report = new.replanned
        assert report is not None  # a re-plan's decision carries its report
        if report.applied:
            setup.executor.adopt(new)
            self.measured.clear()
            self.stage_times.clear()
        log.info("hybridpipe: %s", report)
        return report

    def rebalance(self, threshold: float = 0.05) -> Rebalance:
        report = self._from_measured("rebalance", threshold)
        assert isinstance(report, Rebalance)
        self.rebalanced = report
        return report

    def rebalance_from(self, costs: Mapping[str, UnitCosts], optimizer: Optimizer | None,
                       threshold: float) -> Rebalance:
        """The elastic re-plan: the running decision re-partitioned from unit costs an earlier
        run of the model measured (its checkpoint's; `Planner.replan`, "elastic"), adopted
        with those costs (so later re-plans and checkpoints keep them), the units' state in
        `optimizer` moving with them; every process calls it."""
        setup = self.setup
        decision = setup.require_plan()
        units = decision.captured.with_costs(costs)  # a ValueError for another model's units
        decision = setup.planner.with_units(decision, units)
        new = setup.planner.replan(decision, from_unit_costs(units, decision.plan), "elastic",
                                   setup.executor.coordination, threshold)
        report = new.replanned
        assert isinstance(report, Rebalance)  # an elastic re-plan re-partitions
        setup.executor.adopt(new, carrying=() if optimizer is None else (optimizer,))
        if report.applied:
            self.measured.clear()
            self.stage_times.clear()
        log.info("hybridpipe: elastic %s", report)
        return report

    def resynthesize(self, threshold: float = 0.05) -> Resynthesis:
        report = self._from_measured("resynthesize", threshold)
        assert isinstance(report, Resynthesis)
        self.resynthesized = report
        return report
