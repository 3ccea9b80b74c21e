"""A Pipeline's planning phase and its batches: the layout for the world when stages="auto"
(`auto_layout`), the planner (built once every process agrees on the settings; it plans
nothing yet), the decision made from the first batch (`plan`, loaded into the executor), and
every batch as the flat inputs stage 0 takes, split once into the decision's microbatches and
checked against the captured graph (`inputs`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import TreeSpec, tree_flatten

from partitioner.capture import call_structure, check_inputs
from partitioner.exported import flat_inputs
from pipeline.execution.choose import Job, job_before_layout
from pipeline.execution.compiled import CompileStats, compile_options
from pipeline.execution.executor import Executor, planner_hooks
from pipeline.execution.program import LossFn
from pipeline.planning.costs import StageCosts
from pipeline.planning.decision import Decision, Surveyed
from pipeline.planning.layout import LayoutChoice, check_layout_settings, choose_layout
from pipeline.planning.microbatch import Batch, Microbatches, batch_size, tensor_leaves
from pipeline.planning.planner import Planner
from pipeline.planning.settings import PipelineSettings, compared_settings
from scheduler import Schedule


class PlanningPhase:
    """The planner, the decision once made, and the batch shapes already checked against it.
    `load` gives a decision to the executor (with the facade's current loss and settings)."""

    def __init__(
        self, module: nn.Module, executor: Executor, planner: Planner,
        load: Callable[[Decision], None],
    ) -> None:
        self.module = module
        self.executor = executor
        self.planner = planner
        self.load = load
        self._checked: set[tuple[Any, ...]] = set()  # batch shapes that passed check_inputs

    @classmethod
    def agreed(
        cls, model: nn.Module, executor: Executor, load: Callable[[Decision], None],
        settings: PipelineSettings, *, loss_fn: LossFn | None, surveyed: Surveyed | None = None,
    ) -> PlanningPhase:
        """The planner for these settings, with the executor's hooks, once every process is
        checked to have built the same Pipeline (under torch.distributed;
        pipeline.planning.settings). Plans nothing: the decision is made by `plan`."""
        with executor.setting_up():
            planner = Planner(model, settings, hooks=executor.planner_hooks(), surveyed=surveyed)
        executor.coordination.agree("the settings check", settings=compared_settings(
            settings, data_parallel=executor.processes.data_parallel,
            built=planner.schedule, loss_fn=loss_fn, model=model,
        ))
        return cls(model, executor, planner, load)

    @property
    def decision(self) -> Decision | None:
        """The running decision, which the executor holds (None before the first plan)."""
        return self.executor.planned

    def require_plan(self) -> Decision:
        """The decision; a RuntimeError explaining when it is made if not yet."""
        if self.decision is None:
            raise RuntimeError(
                "the plan is made from the first batch; pass example_input=... or run "
                "step/forward first"
            )
        return self.decision

    @property
    def schedule(self) -> Schedule:
        """The schedule; a RuntimeError explaining when it is built if not yet."""
        if self.decision is not None:
            return self.decision.schedule
        if self.planner.schedule is None:
            raise RuntimeError(
                "the schedule is built from the first batch because microbatches was not given; "
                "pass microbatches=... or example_input=..., or run step/forward first"
            )
        return self.planner.schedule

    @property
    def microbatches(self) -> int | None:
        """Microbatches per batch (None until the first batch when not given)."""
        decision = self.decision
        return decision.microbatches if decision is not None else self.planner.microbatches

    def costs(self) -> StageCosts:
        """The decision's per-stage profiled costs; when they were not profiled up front, every
        unit is measured now by the processes holding it (under torch.distributed every
        process calls it then)."""
        decision = self.require_plan()
        if decision.costs is None:
            with self.executor.precision.planning(self.executor.devices):
                units = self.executor.measure_units(decision)
            decision = self.planner.with_units(decision, units)
            self.executor.adopt(decision)
        assert decision.costs is not None  # with_units sets them
        return decision.costs

    # -- the planning phase -----------------------------------------------------------------------

    def plan(self, args: tuple[Any, ...] | None, call_spec: TreeSpec | None) -> Decision:
        """Decide from one batch of flat inputs (None on a process without stage 0's inputs)
        and give the decision to the executor."""
        with self.executor.setting_up():
            with self.executor.precision.planning(self.executor.devices):
                decision = self.planner.plan(args, call_spec, self.executor.coordination)
            self.load(decision)
        return decision

    def plan_on(self, x: Batch) -> Decision:
        """`plan` on a batch as the caller gives it (example_input)."""
        return self.plan(*self.flat_inputs(x))

    # -- batches ----------------------------------------------------------------------------------

    def inputs(self, x: Batch | None, *, whole: bool) -> Microbatches | None:
        """Batch `x` split into microbatches: the decision's count for a step (`whole`), at
        most one per row for a forward. The first batch is planned on first (`plan`); every
        batch is checked against the capture (`check`)."""
        args, call_spec = self.flat_inputs(x) if x is not None else (None, None)
        if self.decision is None:
            self.plan(args, call_spec)
        if args is None:
            return None
        m = self.require_plan().microbatches
        split = Microbatches.split(args, m if whole else min(m, batch_size(args, "inputs")))
        self.check(args, split)
        return split

    def flat_inputs(self, x: Batch) -> tuple[tuple[Any, ...], TreeSpec | None]:
        """The flat input tensors stage 0 takes from a tensor or tuple/list batch (positional
        arguments) or a dict batch (keyword arguments), in the captured order; with their
        call's structure before the first decision (None after: the capture's)."""
        try:
            tensor_leaves(x, "inputs")
        except TypeError as err:
            raise TypeError(
                f"{err}; inputs must be a tensor or a tuple/list/dict of tensors (split along "
                "dim 0); pass a constant argument (a flag such as output_hidden_states=True) "
                "through the model instead: set it in its config, or wrap the model in a module "
                "whose forward passes it"
            ) from None
        args, kwargs = call_structure(x)
        if self.decision is not None:
            signature = inspect.signature(self.module.forward)
            in_spec = self.decision.captured.in_spec
            return flat_inputs(in_spec, args, kwargs, signature), None
        leaves, call_spec = tree_flatten((args, kwargs))
        return tuple(leaves), call_spec

    def check(self, args: tuple[Any, ...], split: Microbatches) -> None:
        """Fail before any tensor moves when a batch cannot run on the captured graph (a
        static dim changed that the model fixes); capture again, with that dim dynamic, when a
        batch changes a dim the capture made static but the model does not fix
        (pipeline.planning.shapes). A batch of shapes already checked is not checked again
        (the check costs ~0.2 ms per microbatch)."""
        decision = self.require_plan()
        shapes = (id(decision), split.count, tuple(
            (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t) for t in args
        ))
        if shapes in self._checked:
            return
        with self.executor.setting_up():
            with self.executor.precision.planning(self.executor.devices):
                new = self.planner.recaptured(decision, split, self.executor.coordination)
            self.executor.adopt(new)  # a new capture's stages are placed anew
            decision = new
        for part in split.parts:
            check_inputs(decision.captured, part)
        if len(self._checked) >= 64:
            self._checked.clear()
        self._checked.add(shapes)


def auto_layout(
    model: nn.Module, example_input: Batch | None, settings: PipelineSettings,
) -> tuple[LayoutChoice, Job]:
    """stages="auto" (pipeline.planning.layout): the layout chosen on this process's device
    by the job's processes, met here through the Pipeline's setup agreement (the distributed
    executor takes it over); under ``compile=`` the units are profiled compiled, as the stages
    will run them."""
    check_layout_settings(example_input, schedule=settings.schedule,
                          microbatches=settings.microbatches, data_parallel=settings.data_parallel,
                          what="stages" if settings.stages == "auto" else "tensor_parallel")
    job = job_before_layout(settings.timeout)
    options = compile_options(settings.compile) if settings.shard != "full" else None
    choice = choose_layout(
        model, example_input, job.coordination, settings, world_size=job.world_size,
        rank=job.rank, hooks=planner_hooks(options, CompileStats()),
    )
    return choice, job
