"""Planning and setup: the planner (built once every process agrees on the settings), the flat
inputs stage 0 takes, the plan made from the first batch and loaded into the executor, and the
check that a later batch fits the captured graph."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from partitioner.capture import call_structure, check_inputs, check_mode
from partitioner.exported import flat_inputs
from pipeline.execution.executor import Executor
from pipeline.execution.program import LossFn
from pipeline.planning.microbatch import Batch, batch_size, split_microbatches, tensor_leaves
from pipeline.planning.planner import Planned, Planner
from pipeline.planning.settings import pipeline_settings
from scheduler import Schedule


class Setup:
    """The planner, the plan once made, and the batch shapes already checked against it.
    `load` gives a plan to the executor (with the facade's current loss and settings)."""

    def __init__(
        self, module: nn.Module, executor: Executor, planner: Planner,
        load: Callable[[Planned], None],
    ) -> None:
        self.module = module
        self.executor = executor
        self.planner = planner
        self.load = load
        self.planned: Planned | None = None
        self._checked: set[tuple[Any, ...]] = set()  # batch shapes that passed check_inputs

    @classmethod
    def plan_for(
        cls, model: nn.Module, executor: Executor, load: Callable[[Planned], None], stages: int,
        *, schedule: str | os.PathLike[str] | Schedule, microbatches: int | str | None,
        virtual_stages: int | str | None, balance: str | Sequence[int],
        leaf_modules: tuple[type, ...] | None, memory_limit: float | None, capture_method: str,
        loss_fn: LossFn | None, dynamic_dims: Sequence[int] = (),
    ) -> Setup:
        """The planner for these settings, once every process is checked to have built the
        same Pipeline (under torch.distributed; pipeline.planning.settings)."""
        with executor.setting_up():
            planner = Planner(
                model, stages, schedule=schedule, microbatches=microbatches,
                virtual_stages=virtual_stages, balance=balance, leaf_modules=leaf_modules,
                memory_limit=memory_limit, capture_method=capture_method,
                dynamic_dims=dynamic_dims,
            )
        ctx = executor.context
        executor.coordination.agree("the settings check", settings=pipeline_settings(
            stages=stages, data_parallel=1 if ctx is None else ctx.layout.data_parallel,
            schedule=schedule, built=planner.schedule, microbatches=microbatches,
            virtual_stages=virtual_stages, loss_fn=loss_fn, model=model, shard=executor.shard,
        ))
        return cls(model, executor, planner, load)

    def require_plan(self) -> Planned:
        """The plan; a RuntimeError explaining when it is made if not yet."""
        if self.planned is None:
            raise RuntimeError(
                "the plan is made from the first batch; pass example_input=... or run "
                "step/forward first"
            )
        return self.planned

    @property
    def schedule(self) -> Schedule:
        """The schedule; a RuntimeError explaining when it is built if not yet."""
        if self.planner.schedule is None:
            raise RuntimeError(
                "the schedule is built from the first batch because microbatches was not given; "
                "pass microbatches=... or example_input=..., or run step/forward first"
            )
        return self.planner.schedule

    def as_args(self, x: Batch) -> tuple[Any, ...]:
        """The flat input tensors stage 0 takes from a tensor or tuple/list batch (positional
        arguments) or a dict batch (keyword arguments), in the captured order."""
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
        if self.planned is not None:
            signature = inspect.signature(self.module.forward)
            return flat_inputs(self.planned.captured.in_spec, args, kwargs, signature)
        leaves, self.planner.call_spec = tree_flatten((args, kwargs))
        return tuple(leaves)

    def setup(self, args: tuple[Any, ...] | None) -> Planned:
        """Make the plan from one batch of inputs and give it to the executor."""
        with self.executor.setting_up():
            with self.executor.precision.planning(self.executor.devices):
                planned = self.planner.make(args, self.executor.coordination)
            self.load(planned)
        self.planned = planned
        return planned

    def args(self, x: Batch | None) -> tuple[Any, ...] | None:
        """`x` as positional arguments, planning first if this is the first batch."""
        args = None if x is None else self.as_args(x)
        if self.planned is None:
            self.setup(args)
        elif args is not None:
            self.check_inputs(self.planned, args)
        return args

    def check_inputs(self, planned: Planned, args: tuple[Any, ...]) -> None:
        """Fail before any tensor moves when a batch cannot run on the captured graph (a
        static dim changed that the model fixes, or the train/eval mode an export baked in);
        capture again, with that dim dynamic, when a batch changes a dim the capture made
        static but the model does not fix (pipeline.planning.shapes). A batch of shapes
        already checked is not checked again (the check costs ~0.2 ms per microbatch)."""
        check_mode(planned.captured)
        shapes = (id(planned), tuple(
            (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t) for t in args
        ))
        if shapes in self._checked:
            return
        with self.executor.setting_up():
            with self.executor.precision.planning(self.executor.devices):
                recaptured = self.planner.recapture(planned, args, self.executor.coordination)
            if recaptured is not None:
                self.load(recaptured)
                self.planned = planned = recaptured
        m = min(planned.schedule.num_microbatches, batch_size(args, "inputs"))
        for mb in split_microbatches(args, m, "inputs"):
            check_inputs(planned.captured, mb)
        if len(self._checked) >= 64:
            self._checked.clear()
        self._checked.add(shapes)
