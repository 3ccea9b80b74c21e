"""Planning, apart from running: the schedule (built by name or adopted from a custom one and
validated), then capture -> profile -> partition -> split -> stage costs from one example
microbatch. `Planner.make` returns a `Planned` for an executor to place and run.

In one process the planner decides alone. Under torch.distributed the executor's
`Coordination` makes global rank 0 decide (microbatch count, example, plan, costs) and every
other process follow (`agree`), so that all processes split the model the same way; each
`agree` also checks that every process has the same settings (pipeline.planning.settings), and each
piece of planning runs as a `phase` that the other processes hear about if it fails
(pipeline.execution.distributed.agreement)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils._pytree import TreeSpec, tree_map, tree_unflatten

from partitioner import (
    Captured,
    CaptureError,
    Plan,
    StageModule,
    capture,
    partition,
    profile,
    split_model,
)
from partitioner.estimate import estimate
from pipeline.planning.autoplan import AutoPlan, search
from pipeline.planning.costs import StageCosts, stage_costs
from pipeline.planning.microbatch import batch_size, split_microbatches
from pipeline.planning.settings import Settings, input_settings, schedule_setting
from pipeline.planning.shapes import (
    Pairs,
    carry_over,
    changed_static_dims,
    check_dims,
    describe,
    dims_of,
    pairs_for,
    still_static,
    with_dims,
)
from scheduler import SCHEDULES, Schedule, build_schedule, validate

log = logging.getLogger("hybridpipe")


class Agree(Protocol):
    """The leader's `value` on every process, once every process's `settings` match; `what`
    names the point of setup in messages."""

    def __call__(self, what: str, value: Any = None, settings: Settings | None = None) -> Any: ...


def decide_alone(what: str, value: Any = None, settings: Settings | None = None) -> Any:
    """`Agree` for one process: its own value."""
    return value


def _no_phase(what: str) -> AbstractContextManager[None]:
    return nullcontext()


@dataclass(frozen=True)
class Coordination:
    """How the processes of a job make one plan. `leads`: this process decides (always in one
    process; global rank 0 under torch.distributed). `agree`: see `Agree`. `device`: where
    profiling runs. `keeps_whole_model`: False when the executor frees the stages other
    processes hold (then costs cannot be profiled later). `phase(what)`: the context a piece
    of planning runs in (under torch.distributed its failure reaches the other processes)."""

    leads: bool
    agree: Agree
    device: torch.device
    keeps_whole_model: bool
    phase: Callable[[str], AbstractContextManager[None]] = _no_phase


@dataclass
class Planned:
    """The result of planning: the model, the schedule, the partition, the captured (and maybe
    profiled) model with the example it was captured on, every stage's module in stage order
    (sharing the model's parameters), and the profiled per-stage costs (None until profiled)."""

    model: torch.nn.Module
    schedule: Schedule
    plan: Plan
    captured: Captured
    example: tuple[Any, ...]
    modules: list[StageModule]
    costs: StageCosts | None


AUTO = "auto"


def _load_custom(spec: object) -> Schedule | None:
    if isinstance(spec, Schedule):
        return spec
    if isinstance(spec, str) and (spec in SCHEDULES or spec == AUTO):
        return None
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if path.is_file():
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"schedule file {str(spec)!r} is not text (byte {err.start} is "
                    f"{err.object[err.start:err.start + 1]!r}, not UTF-8); give a text file "
                    "with one line of actions per rank, e.g. written by Schedule.to_text()"
                ) from None
            return Schedule.from_text(text, name=path.stem)
        raise ValueError(
            f"schedule {str(spec)!r} is neither a known schedule nor a file; choose one of "
            f"{sorted(SCHEDULES)}, pass a scheduler.Schedule, or a schedule text file's path"
        )
    raise TypeError(
        f"schedule must be a name, a path or a scheduler.Schedule, got {type(spec).__name__}"
    )


def on_meta(model: torch.nn.Module) -> bool:
    """Whether the model was built on the meta device (any parameter or buffer there)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _as_meta(value: Any) -> Any:
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)


def measure(captured: Captured, model: torch.nn.Module, example: tuple[Any, ...],
            device: torch.device) -> None:
    """Profile the captured units, or estimate them (FLOPs + bytes on meta,
    partitioner.estimate) when the model is on the meta device."""
    if on_meta(model):
        estimate(captured, example, device=device)
    else:  # a meta model materialised since it was captured: time it on zeros of those shapes
        real = tree_map(lambda t: torch.zeros_like(t, device="cpu")
                        if isinstance(t, torch.Tensor) and t.is_meta else t, example)
        profile(captured, model, real, device=device)


def _capture_rows(args: tuple[Any, ...], example: tuple[Any, ...]) -> tuple[Any, ...]:
    """What to capture on: the example microbatch, or two rows of the batch when it has one
    row, so torch.export keeps the batch dim dynamic (profiling uses the real microbatch)."""
    if batch_size(example, "inputs") == 1 and batch_size(args, "inputs") >= 2:
        return tuple(a[:2] for a in args)
    return example


class Planner:
    """Makes the plan of a `Pipeline`: `ranks` pipeline ranks, `virtual_stages` chunks
    (stages) per rank, `microbatches` per batch (None: ``min(2 x ranks, batch size)`` of the
    first batch), `balance` as in `partitioner.partition`.

    "auto" for the schedule, the microbatches or the virtual stages lets
    `pipeline.planning.autoplan` choose them by simulation on the first batch (profiled on a
    provisional microbatch of ``min(2 x ranks, batch)``), under `memory_limit` bytes per device;
    the others stay as given. The search result is kept as `autoplan`."""

    def __init__(
        self,
        model: torch.nn.Module,
        ranks: int,
        *,
        schedule: str | os.PathLike[str] | Schedule,
        microbatches: int | str | None,
        virtual_stages: int | str | None,
        balance: str | Sequence[int],
        leaf_modules: tuple[type, ...] | None,
        memory_limit: float | None = None,
        capture_method: str = "auto",
        dynamic_dims: Sequence[int] = (),
    ) -> None:
        self.model = model
        self.capture_method = capture_method
        self.dynamic_dims = check_dims(dynamic_dims)
        # (flat input, dim) pairs a later batch changed: captured dynamic from then on.
        self.changed: Pairs = set()
        self._fixed: Pairs = set()  # pairs the model's code keeps static
        self._rows: tuple[Any, ...] = ()  # the flat inputs of the last capture
        # The pytree structure of (args, kwargs) whose leaves `make`'s flat inputs are.
        self.call_spec: TreeSpec | None = None
        self.ranks = ranks
        self.auto = AUTO in (schedule, microbatches, virtual_stages)
        self.auto_schedule = schedule == AUTO  # re-synthesised from measured costs later
        self.memory_limit = memory_limit
        self.autoplan: AutoPlan | None = None
        self._auto_m = microbatches == AUTO
        self._auto_v = virtual_stages == AUTO
        self.microbatches: int | None = microbatches if isinstance(microbatches, int) else None
        self.virtual_stages: int | None = (
            virtual_stages if isinstance(virtual_stages, int) else None
        )
        self.balance = balance
        self.leaf_modules = leaf_modules
        self.schedule_spec = schedule
        self.schedule: Schedule | None = None
        custom = _load_custom(schedule)
        if custom is not None:
            if self.auto:
                raise ValueError(
                    f"a custom schedule ({custom.name!r}) fixes microbatches and chunks; drop "
                    "the 'auto' settings or pass schedule='auto'"
                )
            self.schedule = self._adopt(custom)
        elif self.microbatches is not None and not self.auto:
            self.schedule = self._build(self.microbatches)

    def _build(self, microbatches: int) -> Schedule:
        return build_schedule(
            str(self.schedule_spec), self.ranks, microbatches, self.virtual_stages
        )

    def _adopt(self, schedule: Schedule) -> Schedule:
        """Check a custom schedule against the settings and validate it."""
        if schedule.num_ranks != self.ranks:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_ranks} ranks but stages="
                f"{self.ranks}; make them equal"
            )
        if self.microbatches not in (None, schedule.num_microbatches):
            raise ValueError(
                f"schedule {schedule.name!r} runs {schedule.num_microbatches} microbatches but "
                f"microbatches={self.microbatches}; drop microbatches or make them equal"
            )
        if self.virtual_stages not in (None, schedule.virtual_stages):
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.virtual_stages} stages per rank but "
                f"virtual_stages={self.virtual_stages}; drop virtual_stages or make them equal"
            )
        if schedule.num_stages % schedule.num_ranks:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_stages} stages on "
                f"{schedule.num_ranks} ranks; give every rank the same number of stages"
            )
        validate(schedule)
        self.microbatches = schedule.num_microbatches
        return schedule

    def make(self, args: tuple[Any, ...] | None, how: Coordination) -> Planned:
        """Plan from one batch of flat inputs `args` (the leaves of the call `call_spec`
        describes; needed on the leader only)."""
        offer = None
        profiled: tuple[Captured, tuple[Any, ...]] | None = None
        if how.leads:
            if args is None:
                raise ValueError(
                    "the process that makes the plan (global rank 0, which holds stage 0) "
                    "needs a batch of inputs for the first step/forward (or example_input=...)"
                )
            if on_meta(self.model):  # capture and estimate on meta: nothing is allocated
                args = _as_meta(args)
            size = batch_size(args, "inputs")
            m = self.microbatches if self.microbatches is not None else min(2 * self.ranks, size)
            example = tuple(split_microbatches(args, m, "inputs")[0])
            choice = None
            if self.auto:
                with how.phase("auto-planning (capture and profiling of the model)"):
                    provisional = self._capture(_capture_rows(args, example))
                    measure(provisional, self.model, example, how.device)
                    choice = self._choose(provisional, size, batch_size(example, "inputs"))
                if choice[1] == m:
                    profiled = (provisional, example)  # reuse: same microbatch
                else:
                    m = choice[1]
                    example = tuple(split_microbatches(args, m, "inputs")[0])
            offer = (m, _capture_rows(args, example), example, choice, self.call_spec)
        m, rows, example, choice, self.call_spec = how.agree(
            "the first batch", offer, input_settings(args)
        )
        with how.phase("capture of the model"):
            if choice is not None:
                name, _, v, built = choice
                self.microbatches, self.virtual_stages = m, v
                if built is None:
                    self.schedule_spec = name
                self.schedule = built if built is not None else self._build(m)
                log.info("hybridpipe: auto-planned schedule=%s microbatches=%d virtual_stages=%d",
                         name, m, v)
            if self.microbatches is None:
                self.microbatches = m
                log.info("hybridpipe: using microbatches=%d (2 x stages, capped by the batch)", m)
            if self.schedule is None:
                self.schedule = self._build(m)
            schedule = self.schedule
            captured = profiled[0] if profiled is not None else self._capture(rows)
        plan = costs = None
        if how.leads:
            if self.balance == "profile" and profiled is None:
                with how.phase("profiling of the model"):
                    measure(captured, self.model, example, how.device)
            with how.phase("partitioning of the model"):
                plan = partition(captured, schedule.num_stages, self.balance)
                # Costs are measured by the leader while it still holds the whole model.
                costs = stage_costs(captured, plan) if self.balance == "profile" else None
        plan, costs = how.agree(
            "the plan", (plan, costs), {"schedule text": schedule_setting(schedule)}
        )
        with how.phase("split of the model"):
            modules = split_model(captured, plan)
        return Planned(self.model, schedule, plan, captured, example, modules, costs)

    def _capture(self, rows: tuple[Any, ...], method: str | None = None) -> Captured:
        """Capture the model called with the flat inputs `rows` (structure `call_spec`)."""
        if self.call_spec is None:
            raise RuntimeError("planning needs the inputs' structure (Pipeline._as_args)")
        self._rows = rows
        call_args, call_kwargs = tree_unflatten(list(rows), self.call_spec)
        return capture(
            self.model, call_args, call_kwargs, leaf_modules=self.leaf_modules,
            method=method or self.capture_method,
            dynamic_dims=pairs_for(rows, self.dynamic_dims) | self.changed,
        )

    def recapture(
        self, planned: Planned, args: tuple[Any, ...], how: Coordination
    ) -> Planned | None:
        """A new Planned when the batch `args` changes a dim the capture made static (another
        sequence length): the model captured again with that dim dynamic too (on the first
        capture's inputs, which the model is known to run), keeping the plan and costs when
        the units are the same (else re-partitioned). None when nothing changed, or the
        model's code fixes the size (then `check_inputs` reports it)."""
        m = min(planned.schedule.num_microbatches, batch_size(args, "inputs"))
        microbatches = split_microbatches(args, m, "inputs")
        changed = changed_static_dims(planned.captured, microbatches) - self._fixed
        if not changed:
            return None
        if not how.keeps_whole_model:
            raise ValueError(
                f"this batch changes {describe(planned.captured, changed)}, a size the capture "
                "made static; under torch.distributed each process holds only its stages, so "
                f"the model cannot be captured again: build the Pipeline with dynamic_dims="
                f"{dims_of(changed)!r} (or give batches of the first batch's shape)"
            )
        self.changed |= changed
        log.info("hybridpipe: capturing again with %s dynamic",
                 describe(planned.captured, changed))
        try:  # on the first capture's rows: the model runs on those
            captured: Captured | None = self._capture(self._rows, method="export")
        except CaptureError:
            captured = None
        self._fixed |= changed if captured is None else still_static(captured, changed)
        if captured is None or self._fixed & changed:
            self.changed -= self._fixed
            return None
        plan, costs = planned.plan, planned.costs
        if not carry_over(planned.captured, captured):
            if not isinstance(self.balance, str):
                raise ValueError(
                    f"this batch changes {describe(planned.captured, changed)}; captured again "
                    f"with it dynamic the model has {len(captured)} units (was "
                    f"{len(planned.captured)}), so balance={list(self.balance)} no longer fits: "
                    f"build the Pipeline with dynamic_dims={dims_of(changed)!r} (then the counts "
                    "are of that capture), or balance='profile'/'parameters'"
                )
            if self.balance == "profile":
                measure(captured, self.model, planned.example, how.device)
            plan = partition(captured, planned.schedule.num_stages, self.balance)
            costs = stage_costs(captured, plan) if self.balance == "profile" else None
        plan = with_dims(plan, captured)
        modules = split_model(captured, plan)
        return Planned(
            self.model, planned.schedule, plan, captured, planned.example, modules, costs
        )

    def _choose(
        self, captured: Captured, size: int, profiled_batch: int
    ) -> tuple[str, int, int, Schedule | None]:
        """(schedule, microbatches, virtual stages, the schedule if synthesised): the fastest
        predicted within the memory limit, the settings not left to "auto" held fixed."""
        fixed_name = None if self.schedule_spec == AUTO else [str(self.schedule_spec)]
        self.autoplan = search(
            captured,
            world_size=self.ranks,
            pp=[self.ranks],
            batch_size=size,
            profiled_batch=profiled_batch,
            memory_limit=self.memory_limit,
            schedules=fixed_name,
            microbatches=None if self._auto_m else [self.microbatches or min(2 * self.ranks, size)],
            virtual_stages=None if self._auto_v or self.virtual_stages is None
            else [self.virtual_stages],
        )
        best = self.autoplan.best
        return best.schedule, best.microbatches, best.virtual_stages, best.built

    def costs(self, planned: Planned, how: Coordination) -> StageCosts:
        """Per-stage profiled seconds (profiling now, on the planning example, if needed)."""
        if planned.costs is not None:
            return planned.costs
        if not how.keeps_whole_model:
            raise RuntimeError(
                "under torch.distributed the stage costs are measured on global rank 0 before "
                "the model is split; build the Pipeline with balance='profile' to simulate it"
            )
        captured = planned.captured
        if not captured.profiled:
            measure(captured, self.model, planned.example, how.device)
        planned.costs = stage_costs(captured, planned.plan)
        return planned.costs
