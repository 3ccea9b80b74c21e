"""Planning, apart from running: the schedule (built by name, or a custom one:
pipeline.planning.custom_schedule), then capture -> profile (pipeline.planning.measure) ->
partition -> split -> stage costs from one example microbatch. `Planner.plan` is the
planning phase: it takes the first batch and returns the frozen `Decision`
(pipeline.planning.decision) that an executor places and runs. A later batch that changes a
dim the capture made static makes a new decision (`Planner.recaptured`), and so does a re-plan
from measured costs (`Planner.replan`: a new partition or schedule); the planner itself holds
only the settings.

In one process the planner decides alone. Under torch.distributed the executor's
`Coordination` makes global rank 0 decide (microbatch count, example, plan, costs) and every
other process follow (`agree`, carrying the records `FirstBatch` and `Partition`), so that all
processes split the model the same way; each `agree` also checks that every process has the
same settings (pipeline.planning.settings), and each piece of planning runs as a `phase` that
the other processes hear about if it fails (`Coordination.phase`, which the executor gives)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_map, tree_unflatten

from partitioner import Captured, CaptureError, capture, partition, split_model
from partitioner.activation_cost import RunsOf, price_policies
from partitioner.unit_costs import with_policies
from pipeline.planning.activation_plan import planned_activations
from pipeline.planning.activation_policies import SELECTIVE_BUDGET, SELECTIVE_SAVE_OPS
from pipeline.planning.autoplan import search
from pipeline.planning.costs import stage_costs
from pipeline.planning.custom_schedule import AUTO, checked_custom, load_custom
from pipeline.planning.decision import (
    AutoChoice,
    CaptureInputs,
    Coordination,
    Decision,
    FirstBatch,
    Pairs,
    Partition,
    Surveyed,
    with_activations_of,
)
from pipeline.planning.measure import (
    UnitRunner,
    as_meta,
    measure,
    on_meta,
    real_buffers_on_meta,
)
from pipeline.planning.microbatch import Microbatches, batch_size
from pipeline.planning.replan import Measured, Reason, Replanned, decide
from pipeline.planning.settings import PipelineSettings, input_settings, schedule_setting
from pipeline.planning.shapes import (
    carry_over,
    changed_static_dims,
    check_dims,
    describe,
    dims_of,
    pairs_for,
    still_static,
    with_dims,
)
from pipeline.planning.synthesis import OPTIMIZER_FACTOR
from scheduler import Schedule, build_schedule

log = logging.getLogger("hybridpipe")


@dataclass(frozen=True)
class PlannerHooks:
    """What the executor gives planning so that it measures what will run (the executor's
    `planner_hooks`): `unit_runner(unit, splits)`, what runs a captured unit when it is
    profiled (its compiled form under ``compile=``, so the balance, the simulator and "auto"
    see compiled costs; `splits`: B and W timed apart); `block_runs`, how the runtime runs a
    block under "full" and "selective" (the policies are priced on that code); `price_threads`,
    the pipeline ranks this process runs in threads (the prices are timed that many at once)."""

    unit_runner: Callable[[torch.nn.Module, bool], torch.nn.Module] | None = None
    block_runs: RunsOf | None = None
    price_threads: int = 1


def _capture_rows(args: tuple[Any, ...], example: tuple[Any, ...]) -> tuple[Any, ...]:
    """What to capture on: the example microbatch, or, when it has one row, two rows of the
    batch (its one row twice for a batch of one), so torch.export keeps the batch dim dynamic
    instead of specialising it to 1 with a warning (profiling uses the real microbatch)."""
    if batch_size(example, "inputs") != 1:
        return example
    if batch_size(args, "inputs") >= 2:
        return tuple(a[:2] for a in args)
    return tree_map(lambda t: torch.cat([t, t]) if isinstance(t, torch.Tensor) else t, example)


def _shapes(values: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v)
                 for v in values)


def _first_microbatch(args: tuple[Any, ...], count: int) -> tuple[Any, ...]:
    return tuple(Microbatches.split(args, count, "inputs").parts[0])



class Planner:
    """Plans a `Pipeline` with its `settings` (pipeline.planning.settings): `stages` pipeline
    ranks, `virtual_stages` chunks (stages) per rank, `microbatches` per batch (None: ``min(2 x
    ranks, batch size)`` of the first batch), `balance` as in `partitioner.partition`; `hooks`:
    what the executor gives it to measure what will run (`PlannerHooks`). It holds these only;
    each plan is a `Decision`. `surveyed`: the capture stages="auto" profiled
    (pipeline.planning.layout), reused when the first microbatch has its shapes.

    "auto" for the schedule, the microbatches or the virtual stages lets
    `pipeline.planning.autoplan` choose them by simulation on the first batch (profiled on a
    provisional microbatch of ``min(2 x ranks, batch)``), under `memory_limit` bytes per device;
    the others stay as given. The decision keeps the choice (`Decision.auto`)."""

    def __init__(
        self, model: torch.nn.Module, settings: PipelineSettings, *,
        hooks: PlannerHooks | None = None, surveyed: Surveyed | None = None,
    ) -> None:
        self.model = model
        self.settings = settings
        self.hooks = hooks if hooks is not None else PlannerHooks()
        self.surveyed = surveyed  # a capture profiled already, reused where it fits
        self.capture_method = settings.capture_method
        self.dynamic_dims = check_dims(settings.dynamic_dims)
        self.ranks = settings.ranks
        schedule, microbatches = settings.schedule, settings.microbatches
        virtual_stages = settings.virtual_stages
        self.auto = AUTO in (schedule, microbatches, virtual_stages)
        self.auto_schedule = schedule == AUTO  # re-synthesised from measured costs later
        self.auto_microbatches = microbatches == AUTO
        self.auto_virtual_stages = virtual_stages == AUTO
        self.memory_limit = settings.memory_limit
        # checkpoint_activations="auto": a policy per stage chosen under memory_limit.
        self.auto_activations = settings.auto_activations
        # The leader profiles the units at planning whatever the balance (rebalance=True: the
        # re-plan then has every unit's costs from one device, before the model is split).
        self.profile_up_front = settings.rebalance
        self.virtual_stages = virtual_stages if isinstance(virtual_stages, int) else None
        self.balance = settings.balance
        self.leaf_modules = settings.leaf_modules
        self.schedule_spec = schedule
        given = microbatches if isinstance(microbatches, int) else None
        custom = load_custom(schedule)
        if custom is not None and self.auto:
            raise ValueError(
                f"a custom schedule ({custom.name!r}) fixes microbatches and chunks; drop "
                "the 'auto' settings or pass schedule='auto'"
            )
        # The schedule when it is known before the first batch (else None).
        self.schedule: Schedule | None = (
            checked_custom(custom, self.ranks, given, self.virtual_stages) if custom is not None
            else self._build(given) if given is not None and not self.auto else None
        )
        # The microbatches per batch when known before the first batch.
        self.microbatches = given if custom is None else custom.num_microbatches

    @property
    def unit_runner(self) -> UnitRunner | None:
        """What runs a unit when it is profiled (`PlannerHooks.unit_runner`), B and W timed
        apart only where a schedule may split the backward (else the profiled units compile
        no input-grad graph)."""
        runner = self.hooks.unit_runner
        if runner is None:
            return None
        built = self.schedule
        splits = built is None or built.splits_backward or self.auto_schedule
        return lambda unit: runner(unit, splits)

    def _build(self, microbatches: int) -> Schedule:
        return build_schedule(
            str(self.schedule_spec), self.ranks, microbatches, self.virtual_stages
        )

    # -- the planning phase -----------------------------------------------------------------------

    def plan(
        self, args: tuple[Any, ...] | None, call_spec: TreeSpec | None, how: Coordination
    ) -> Decision:
        """Decide from one batch of flat inputs `args`, the leaves of the call `call_spec`
        describes (both needed on the leader only)."""
        with real_buffers_on_meta(self.model) as restore:
            decision = self._plan(args, call_spec, how)
            restore(decision.captured.graph_module, decision.captured.unit_module,
                    *decision.modules)
        return decision

    def _plan(
        self, args: tuple[Any, ...] | None, call_spec: TreeSpec | None, how: Coordination
    ) -> Decision:
        offer, profiled = self._first_batch(args, call_spec, how) if how.leads else (None, None)
        first: FirstBatch = how.agree("the first batch", offer, input_settings(args))
        inputs = CaptureInputs(first.call_spec, first.rows)
        with how.phase("capture of the model"):
            schedule = self._schedule_for(first)
            captured = profiled if profiled is not None else self._capture(inputs)
        part = None
        if how.leads:
            captured, part = self._partition(captured, schedule, first.example,
                                             profiled is not None, how)
        part = how.agree("the plan", part, {"schedule text": schedule_setting(schedule)})
        with how.phase("split of the model"):
            modules = tuple(split_model(captured, part.plan))
        return Decision(self.model, schedule, part.plan, captured, inputs, first.example,
                        modules, part.costs, first.auto)

    def _first_batch(
        self, args: tuple[Any, ...] | None, call_spec: TreeSpec | None, how: Coordination
    ) -> tuple[FirstBatch, Captured | None]:
        """(The leader) the microbatch count and example of the first batch, choosing the
        "auto" settings; with the capture, profiled on that example, when auto-planning made
        one (else None)."""
        if args is None or call_spec is None:
            raise ValueError(
                "the process that makes the plan (global rank 0, which holds stage 0) "
                "needs a batch of inputs for the first step/forward (or example_input=...)"
            )
        if on_meta(self.model):  # capture and estimate on meta: nothing is allocated
            args = as_meta(args)
        size = batch_size(args, "inputs")
        m = self.microbatches if self.microbatches is not None else min(2 * self.ranks, size)
        example = _first_microbatch(args, m)
        if not self.auto:
            first = FirstBatch(m, _capture_rows(args, example), example, call_spec, None)
            return first, self._reusable(first)
        with how.phase("auto-planning (capture and profiling of the model)"):
            captured = self._capture(CaptureInputs(call_spec, _capture_rows(args, example)))
            captured = captured.with_costs(
                measure(captured, self.model, example, how.device, self.unit_runner))
            if self.auto_activations:
                captured = self._price(captured, example)
            auto = self._choose(captured, size, batch_size(example, "inputs"))
        profiled = captured if auto.microbatches == m else None  # reused: same microbatch
        if profiled is None:
            m, example = auto.microbatches, _first_microbatch(args, auto.microbatches)
        return FirstBatch(m, _capture_rows(args, example), example, call_spec, auto), profiled

    def survey(self, args: tuple[Any, ...], call_spec: TreeSpec, how: Coordination) -> Surveyed:
        """(The leader) the model captured and profiled on the first microbatch of
        ``min(2 x ranks, batch)`` rows of `args` (as `plan` would), before the layout is
        chosen."""
        if on_meta(self.model):
            args = as_meta(args)
        example = _first_microbatch(args, min(2 * self.ranks, batch_size(args, "inputs")))
        inputs = CaptureInputs(call_spec, _capture_rows(args, example))
        captured = self._capture(inputs)
        captured = captured.with_costs(
            measure(captured, self.model, example, how.device, self.unit_runner))
        return Surveyed(captured, inputs, example)

    def _reusable(self, first: FirstBatch) -> Captured | None:
        """The surveyed capture, profiled, when it was made on inputs of the first batch's
        structure and shapes (else None: capture and profile anew)."""
        surveyed = self.surveyed
        if surveyed is None or surveyed.inputs.call_spec != first.call_spec:
            return None
        if (_shapes(surveyed.inputs.rows), _shapes(surveyed.example)) != (
                _shapes(first.rows), _shapes(first.example)):
            return None
        log.info("hybridpipe: planning reuses the capture and profile of the layout choice")
        return surveyed.captured

    def _schedule_for(self, first: FirstBatch) -> Schedule:
        """The schedule for the agreed first batch: the auto-planner's, the one known already,
        or built for its microbatch count."""
        auto, m = first.auto, first.microbatches
        if auto is not None:
            log.info("hybridpipe: auto-planned schedule=%s microbatches=%d virtual_stages=%d",
                     auto.schedule, m, auto.virtual_stages)
            if auto.built is not None:
                return auto.built
            return build_schedule(auto.schedule, self.ranks, m, auto.virtual_stages)
        if self.schedule is not None:
            return self.schedule
        log.info("hybridpipe: using microbatches=%d (2 x stages, capped by the batch)", m)
        return self._build(m)

    def _price(self, captured: Captured, example: tuple[Any, ...]) -> Captured:
        """`captured` (costed) with each activation policy's price on its units, as the
        runtime runs it."""
        hooks = self.hooks
        if hooks.block_runs is None:
            raise RuntimeError("checkpoint_activations=\"auto\" prices the policies with the "
                               "runtime's block runners: give the Planner PlannerHooks("
                               "block_runs=...)")
        prices = price_policies(captured, example, SELECTIVE_SAVE_OPS, SELECTIVE_BUDGET,
                                hooks.block_runs, hooks.price_threads)
        return captured.with_costs(with_policies(captured.costs, prices))

    def _partition(self, captured: Captured, schedule: Schedule, example: tuple[Any, ...],
                   profiled: bool, how: Coordination) -> tuple[Captured, Partition]:
        """(The leader) the capture with its costs when they are needed, the partition, and
        the stage costs while it holds the whole model; with checkpoint_activations="auto",
        the policy per stage in the plan."""
        costed = self.balance == "profile" or self.auto_activations or self.profile_up_front
        if costed and not profiled:
            with how.phase("profiling of the model"):
                captured = captured.with_costs(
                    measure(captured, self.model, example, how.device, self.unit_runner))
                if self.auto_activations:
                    captured = self._price(captured, example)
        with how.phase("partitioning of the model"):
            plan = partition(captured, schedule.num_stages, self.balance)
            costs = stage_costs(captured, plan) if costed else None
            if self.auto_activations and costs is not None:
                plan = planned_activations(plan, costs.prices, schedule, self.memory_limit,
                                           OPTIMIZER_FACTOR)
        return captured, Partition(plan, costs)

    def _capture(self, inputs: CaptureInputs, method: str | None = None) -> Captured:
        """Capture the model called with the flat inputs `inputs.rows`, the user's dynamic dims
        and those a later batch changed dynamic."""
        call_args, call_kwargs = tree_unflatten(list(inputs.rows), inputs.call_spec)
        return capture(
            self.model, call_args, call_kwargs, leaf_modules=self.leaf_modules,
            method=method or self.capture_method,
            dynamic_dims=pairs_for(inputs.rows, self.dynamic_dims) | inputs.changed,
        )

    def _choose(self, captured: Captured, size: int, profiled_batch: int) -> AutoChoice:
        """The fastest configuration predicted within the memory limit, the settings not left
        to "auto" held fixed."""
        fixed_name = None if self.schedule_spec == AUTO else [str(self.schedule_spec)]
        ranking = search(
            captured,
            world_size=self.ranks,
            pp=[self.ranks],
            batch_size=size,
            profiled_batch=profiled_batch,
            memory_limit=self.memory_limit,
            schedules=fixed_name,
            microbatches=None if self.auto_microbatches
            else [self.microbatches or min(2 * self.ranks, size)],
            virtual_stages=None if self.auto_virtual_stages or self.virtual_stages is None
            else [self.virtual_stages],
            choose_activations=self.auto_activations,
        )
        best = ranking.best
        return AutoChoice(best.schedule, best.microbatches, best.virtual_stages, best.built,
                          ranking)

    # -- later decisions --------------------------------------------------------------------------

    def recaptured(
        self, decision: Decision, inputs: Microbatches, how: Coordination
    ) -> Decision:
        """The decision for the microbatches `inputs`: `decision` itself unless they change a
        dim the capture made static (another sequence length). Then a new decision: the model
        captured again with that dim dynamic too (on the first capture's inputs, which the
        model is known to run), keeping the plan and costs when the units are the same (else
        re-partitioned); or, when the model's code fixes that size, `decision` remembering it
        (then `check_inputs` reports it)."""
        was = decision.capture
        changed = changed_static_dims(decision.captured, inputs.parts) - was.fixed
        if not changed:
            return decision
        if not how.keeps_whole_model:
            raise ValueError(
                f"this batch changes {describe(decision.captured, changed)}, a size the capture "
                "made static; under torch.distributed each process holds only its stages, so "
                f"the model cannot be captured again: build the Pipeline with dynamic_dims="
                f"{dims_of(changed)!r} (or give batches of the first batch's shape)"
            )
        log.info("hybridpipe: capturing again with %s dynamic",
                 describe(decision.captured, changed))
        wanted = dataclasses.replace(was, changed=was.changed | changed)
        try:  # on the first capture's rows: the model runs on those
            captured = self._capture(wanted, method="export")
        except CaptureError:
            captured = None
        fixed: Pairs = was.fixed | (changed if captured is None
                                    else frozenset(still_static(captured, changed)))
        if captured is None or fixed & changed:
            kept = dataclasses.replace(wanted, changed=wanted.changed - fixed, fixed=fixed)
            return dataclasses.replace(decision, capture=kept)
        return self._on_new_capture(decision, captured, wanted, changed, how)

    def _on_new_capture(self, decision: Decision, captured: Captured, inputs: CaptureInputs,
                        changed: set[tuple[int, int]], how: Coordination) -> Decision:
        """`decision` on a re-capture: its costs carried over when the units are the same,
        else partitioned again."""
        plan, costs = decision.plan, decision.costs
        carried = carry_over(decision.captured, captured)
        if carried is not None:
            captured = carried
        else:
            if not isinstance(self.balance, str):
                raise ValueError(
                    f"this batch changes {describe(decision.captured, changed)}; captured again "
                    f"with it dynamic the model has {len(captured)} units (was "
                    f"{len(decision.captured)}), so balance={list(self.balance)} no longer fits: "
                    f"build the Pipeline with dynamic_dims={dims_of(changed)!r} (then the counts "
                    "are of that capture), or balance='profile'/'parameters'"
                )
            if self.balance == "profile":
                captured = captured.with_costs(measure(
                    captured, self.model, decision.example, how.device, self.unit_runner))
            plan = partition(captured, decision.schedule.num_stages, self.balance)
            costs = stage_costs(captured, plan) if self.balance == "profile" else None
        plan = with_activations_of(with_dims(plan, captured), decision.plan)
        return dataclasses.replace(
            decision, plan=plan, captured=captured, capture=inputs,
            modules=tuple(split_model(captured, plan)), costs=costs,
        )

    def with_units(self, decision: Decision, units: Captured) -> Decision:
        """`decision` with the captured model whose every unit is profiled (`units`, the same
        units) and the per-stage costs summed from it."""
        return dataclasses.replace(decision, captured=units,
                                   costs=stage_costs(units, decision.plan))

    def replan(self, decision: Decision, measured: Measured | None, reason: Reason,
               how: Coordination, threshold: float = 0.05) -> Decision:
        """A re-plan of `decision` for `reason` ("rebalance": a new partition, for the units'
        measured costs or the ranks' measured speeds; "resynthesize": a new schedule;
        "elastic": a new partition from the unit costs an earlier run kept, at this run's
        layout, pipeline.planning.replan.from_unit_costs) from
        what was `measured` (read on the leader only): the leader decides
        (pipeline.planning.replan.decide) and every process follows, agreed as the first plan
        is (a `Replanned` record, carried by field name). Returns the decision to run, with
        the report in `replanned` (the same plan and schedule when it was not applied)."""
        offer = None
        if how.leads:
            if measured is None:
                raise ValueError("the leader of a re-plan needs what was measured")
            with how.phase(f"the {reason} re-plan"):
                offer = decide(decision, measured, reason, threshold, self.memory_limit)
        agreed: Replanned = how.agree(f"the {reason} re-plan", offer)
        return agreed.applied_to(decision)
